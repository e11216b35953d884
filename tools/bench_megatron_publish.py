#!/usr/bin/env python3
"""Benchmark: how long ``MegatronPublisher.publish`` blocks a Megatron trainer, against a synchronous full
save of the same weights. Run under torchrun; CPU (gloo) or GPUs (NCCL, one per rank).

Each rank holds its tensor-parallel part of a bf16 GPTModel of about ``--size`` bytes (random weights).
Each step changes 1 % of the elements by a few ulps (``rl_like_step``, in place, on the parameters'
device), then times, on the same weights:
  * ckptstream: ``publish`` (tensor-parallel gather + snapshot: on GPUs the device encoder's change
    detection, ``--device-delta off`` the copy into reused host buffers), until it returns; the background
    encode/write/commit is timed separately (the trainer does not wait for it);
  * sync save: the same gather, ``.cpu()``, ``safetensors.save_file`` of the Hugging Face tensors and
    fsync, on every writing rank in parallel — what a trainer does to hand weights over through a disk.
Prints one row per step, the medians over the steps after the first with their ratio, the first and the
largest later blocking, and (on GPUs) the publisher's extra device memory and pinned host memory.

    torchrun --standalone --nproc-per-node 2 tools/bench_megatron_publish.py --size 256MB --steps 6
    torchrun --standalone --nproc-per-node 2 tools/bench_megatron_publish.py --size 15GB --dir /tmp/b   # 2 GPUs
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckptstream import Stream  # noqa: E402
from ckptstream.cli.options import parse_bytes  # noqa: E402
from ckptstream.storage import fsync_path  # noqa: E402
from ckptstream.testing.models import TinyModelSpec, rl_like_step, tiny_config  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=parse_bytes, default=parse_bytes("256MB"), help="model bytes (bf16)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--tp", type=int, help="tensor-parallel size (default: the world size)")
    parser.add_argument("--dir", help="scratch directory (default: a temp dir)")
    parser.add_argument("--device-delta", choices=("auto", "off"), default="auto",
                        help="auto: the device encoder on GPUs; off: the host path")
    parser.add_argument("--json", help="rank 0 also writes the figures to this file")
    args = parser.parse_args()

    from megatron.core import parallel_state as mpu

    from ckptstream.testing.megatron import build_gpt_model, initialize_parallel
    from ckptstream.writer.megatron import MegatronPublisher

    device = initialize_parallel(tp=args.tp or int(os.environ["WORLD_SIZE"]))
    cuda = device.type == "cuda"
    rank, world = dist.get_rank(), dist.get_world_size()
    root = Path(args.dir or (tempfile.gettempdir() + "/ckptstream-bench-megatron"))
    hf_dir = root / "hf"
    spec = TinyModelSpec.for_size(args.size, vocab_size=32000 if args.size >= (1 << 30) else 8192)
    if rank == 0:
        hf_dir.mkdir(parents=True, exist_ok=True)
        (hf_dir / "config.json").write_text(json.dumps(tiny_config(spec)))
        for old in (root / "stream", root / "sync"):
            shutil.rmtree(old, ignore_errors=True)
        (root / "sync").mkdir(parents=True)
    dist.barrier()

    model = build_gpt_model(hf_dir, params_dtype=torch.bfloat16).to(device)
    torch.manual_seed(rank)
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(1.0) if param.dim() == 1 else param.normal_(0.0, 0.02)
    params = {name: param.data for name, param in model.named_parameters()}
    local_bytes = sum(p.numel() * p.element_size() for p in params.values())
    if cuda:
        torch.cuda.synchronize()
        memory_before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    publisher = MegatronPublisher(str(root / "stream"), model, hf_dir, keyframe_every=args.steps + 1,
                                  workers=min(16, os.cpu_count() or 1),
                                  device_delta=None if args.device_delta == "auto" else False)
    if rank == 0:
        device_name = torch.cuda.get_device_name() if cuda else "CPU"
        print(f"{world} ranks on {device_name}, TP={mpu.get_tensor_model_parallel_world_size()}; model "
              f"{spec.num_layers} layers, hidden {spec.hidden_size}: {local_bytes * world / 1e9:.2f} GB bf16 "
              f"({local_bytes / 1e9:.2f} GB per rank); torch {torch.__version__}", flush=True)
        print(f"{'step':>4} {'kind':>8} {'publish blocks':>15} {'commit after':>13} {'sync save':>10} {'stored':>10}")
    generator = torch.Generator().manual_seed(1)
    rows = []
    for step in range(args.steps):
        if step:
            rl_like_step(params, fraction=0.01, generator=generator)
        blocked = _timed(lambda step=step: publisher.publish(step, step=step), cuda)
        started = time.perf_counter()
        publisher.wait()  # the background encode, write and commit (a trainer would go on training)
        commit = time.perf_counter() - started
        sync = _timed(lambda: _sync_save(publisher, root / "sync" / f"rank{rank}.safetensors"), cuda)
        if rank == 0:
            latest = Stream(str(root / "stream")).manifest(step)
            rows.append((blocked, commit, sync))
            print(f"{step:4d} {latest.kind:>8} {blocked:14.3f}s {commit:12.3f}s {sync:9.3f}s "
                  f"{latest.stored_bytes / 1e6:8.1f}MB", flush=True)
    device_memory, pinned = publisher.device_memory_bytes, publisher.pinned_memory_bytes
    peak = torch.cuda.max_memory_allocated() - memory_before if cuda else 0
    publisher.close()
    if rank == 0 and len(rows) > 1:
        steady = rows[1:]
        blocked, commit, sync = (statistics.median(r[i] for r in steady) for i in range(3))
        print(f"median over steps 1..{args.steps - 1}: publish blocks {blocked:.3f}s, sync save {sync:.3f}s "
              f"-> {sync / blocked:.1f}x less blocking; background commit {commit:.3f}s")
        print(f"first publish blocks {rows[0][0]:.3f}s; largest later {max(r[0] for r in steady):.3f}s")
        if cuda:
            print(f"rank 0: device copy held {device_memory / 1e9:.2f} GB ({device_memory / local_bytes:.2f}x its "
                  f"{local_bytes / 1e9:.2f} GB), peak extra device memory {peak / 1e9:.2f} GB "
                  f"({peak / local_bytes:.2f}x), pinned host {pinned / 1e6:.0f} MB", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({
                "ranks": world, "model_bytes": local_bytes * world, "rows": rows, "median_blocked_s": blocked,
                "median_sync_save_s": sync, "median_commit_s": commit, "first_blocked_s": rows[0][0],
                "max_later_blocked_s": max(r[0] for r in steady), "device_memory_bytes": device_memory,
                "peak_extra_device_memory_bytes": peak, "pinned_bytes": pinned}, indent=1))
    dist.destroy_process_group()


def _timed(work, cuda: bool) -> float:
    """Wall time of ``work`` on every rank, from a common start to the last rank's end."""
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    started = time.perf_counter()
    work()
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    return time.perf_counter() - started


def _sync_save(publisher, path: Path) -> None:
    from safetensors.torch import save_file

    tensors = {name: tensor.cpu().contiguous() for name, tensor in publisher.iter_hf_tensors()}
    if tensors:
        save_file(tensors, str(path))
        fsync_path(path)


if __name__ == "__main__":
    main()
