#!/usr/bin/env python3
"""Benchmark: publishing an FSDP2 model from its shards (``DistributedPublisher.publish_sharded``, no gather)
against what trainers do today, a ``full_tensor()`` gather of every parameter followed by a single-rank
``Publisher.publish`` on rank 0. One run prints, side by side, per rank of a ``--world``-rank CPU job (gloo):

- blocked: the seconds ``publish`` keeps the trainer from its next step (the sharded path: its own shards'
  snapshot; the gather path: every parameter's gather, then rank 0's snapshot), medians of the deltas;
- committed: until the version is committed (``.result()``), medians of the deltas;
- peak extra host memory: the process's peak RSS while it publishes and commits the version (Linux's
  ``VmHWM``, reset first through ``/proc/self/clear_refs``) minus its RSS just before, the largest over the
  versions, beside the rank's shard bytes. So that memory freed earlier (the model's initialization) and kept
  by the allocator does not hide new allocations, the ranks run with glibc's ``MALLOC_MMAP_THRESHOLD_`` fixed
  at 64 KiB (every tensor its own mapping, returned to the system when freed) and ``malloc_trim`` before
  each version.

Each mode runs in a job of its own (fresh processes: freed memory of one does not flatter the other), over a
keyframe and ``--versions - 1`` deltas (an RL-like step of 1 % of the elements between versions).

    unshare --net sh -c 'ip link set lo up && exec python3 tools/bench_fsdp_publish.py'          # 4 x ~100 MB
    unshare --net sh -c 'ip link set lo up && exec python3 tools/bench_fsdp_publish.py --layers 4 --dim 512'
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckptstream.testing.models import rl_like_step  # noqa: E402

MODES = ("sharded", "gather")


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)  # free memory the allocator holds goes back first
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def _rank(rank: int, world: int, port: int, mode: str, args: argparse.Namespace, url: str, report: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ckptstream.writer import DistributedPublisher, Publisher

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(args.dim, args.dim, bias=False) for _ in range(args.layers)))
    model = model.to(torch.bfloat16)
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    shard_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    options = dict(workers=args.workers, keyframe_every=100)
    if mode == "sharded":
        publisher = DistributedPublisher(url, timeout=datetime.timedelta(seconds=600), **options)
    else:
        publisher = Publisher(url, **options) if rank == 0 else None
    rows = []
    for version in range(args.versions):
        if version:
            with torch.no_grad():
                rl_like_step({str(i): p.to_local() for i, p in enumerate(model.parameters())}, fraction=0.01,
                             generator=torch.Generator().manual_seed(100 * version + rank))
        dist.barrier()
        _reset_peak()
        before = _rss_bytes("VmRSS")
        start = time.perf_counter()
        if mode == "sharded":
            future = publisher.publish_sharded(model.state_dict(), version)
        else:
            full = {name: t.full_tensor() for name, t in model.state_dict().items()}  # a collective, every rank
            future = publisher.publish(full, version) if publisher is not None else None
            del full
        blocked = time.perf_counter() - start
        kind = future.result().kind if future is not None else None
        committed = time.perf_counter() - start
        peak = _rss_bytes("VmHWM") - before
        rows.append({"version": version, "kind": kind, "blocked": blocked, "committed": committed,
                     "peak_extra": peak})
    if publisher is not None:
        publisher.close()
    Path(report, f"{mode}-{rank}.json").write_text(json.dumps({"shard_bytes": shard_bytes, "rows": rows}))
    dist.destroy_process_group()


def _job(mode: str, args: argparse.Namespace, root: Path) -> list[dict]:
    """Run one mode in a job of its own; every rank's report."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = str(root / f"stream-{mode}")
    context = multiprocessing.get_context("spawn")
    ranks = [context.Process(target=_rank, args=(rank, args.world, port, mode, args, url, str(root)))
             for rank in range(args.world)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join()
    if any(p.exitcode != 0 for p in ranks):
        raise SystemExit(f"{mode}: a rank failed ({[p.exitcode for p in ranks]})")
    return [json.loads((root / f"{mode}-{rank}.json").read_text()) for rank in range(args.world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=4, help="ranks (default 4)")
    parser.add_argument("--layers", type=int, default=25, help="Linear layers of the model (default 25)")
    parser.add_argument("--dim", type=int, default=2048, help="their width (default 2048: 8 MiB each in bf16)")
    parser.add_argument("--versions", type=int, default=4, help="a keyframe and deltas (default 4)")
    parser.add_argument("--workers", type=int, default=2, help="encoding threads per rank (default 2)")
    parser.add_argument("--dir", help="where the streams go (default a temporary directory, removed)")
    args = parser.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(64 << 10)  # (inherited by the ranks: see the docstring)
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench-fsdp-"))
    try:
        results = {mode: _job(mode, args, root) for mode in MODES}
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    model_bytes = args.layers * args.dim * args.dim * 2
    print(f"model: {args.layers} x [{args.dim}, {args.dim}] bf16 = {model_bytes / 2**20:.0f} MiB, "
          f"{args.world} CPU ranks (gloo), {args.versions} versions (a keyframe, then deltas of 1 % changed)")
    print(f"{'rank':>4} {'shard MiB':>9} | {'mode':>7} {'blocked s':>9} {'committed s':>11} "
          f"{'peak extra MiB':>14} {'x shard':>7} {'kinds':>20}")
    summary = {}
    for mode in MODES:
        for rank, report in enumerate(results[mode]):
            rows = report["rows"]
            deltas = [r for r in rows if r["version"]] or rows
            blocked = statistics.median(r["blocked"] for r in deltas)
            committed = statistics.median(r["committed"] for r in deltas)
            peak = max(r["peak_extra"] for r in rows)
            kinds = ",".join((r["kind"] or "-")[0] for r in rows)
            summary.setdefault(mode, []).append((blocked, peak))
            print(f"{rank:>4} {report['shard_bytes'] / 2**20:>9.1f} | {mode:>7} {blocked:>9.3f} {committed:>11.3f} "
                  f"{peak / 2**20:>14.1f} {peak / report['shard_bytes']:>7.2f} {kinds:>20}")
    blocked_ratio = max(b for b, _ in summary["sharded"]) / max(b for b, _ in summary["gather"])
    peak_ratio = max(p for _, p in summary["sharded"]) / max(p for _, p in summary["gather"])
    print(f"sharded / gather: trainer blocked (slowest rank) x{blocked_ratio:.2f}, "
          f"peak extra host memory (largest rank) x{peak_ratio:.2f}")


if __name__ == "__main__":
    main()
