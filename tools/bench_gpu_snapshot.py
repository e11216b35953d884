#!/usr/bin/env python3
"""Benchmark + check on a GPU machine: publishing CUDA tensors.

A bf16 model (default 15 GB, 7B-shaped) lives on the GPU; each step changes 1 % of its elements by a few
ulps there (``rl_like_step``), and ``Publisher.publish`` snapshots it into reused pinned host buffers. Prints, side by
side: the trainer-blocking time of ``publish`` (first call, which allocates the pinned buffers, and the
steady state) against a naive ``{name: t.cpu()}`` copy; the background encode+write time; the delta size.
Then checks that every published version decodes bit-exactly to what was on the GPU.

    python tools/bench_gpu_snapshot.py --size 15GB --steps 4 --dir /tmp/gpu-bench
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckptstream import Publisher, Stream  # noqa: E402
from ckptstream.cli.options import parse_bytes  # noqa: E402
from ckptstream.codec import tensor_hash  # noqa: E402
from ckptstream.testing.models import TinyModelSpec, rl_like_step, tiny_state_dict  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=parse_bytes, default=parse_bytes("15GB"))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--dir", help="stream directory (default: a temp dir)")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a GPU"

    spec = TinyModelSpec.for_size(args.size, vocab_size=32000)
    state = {name: t.cuda() for name, t in tiny_state_dict(spec).items()}
    full = sum(t.numel() * t.element_size() for t in state.values())
    print(f"GPU: {torch.cuda.get_device_name()}; model {full / 1e9:.1f} GB bf16 in {len(state)} tensors "
          f"({spec.num_layers} layers, hidden {spec.hidden_size}); torch {torch.__version__}", flush=True)

    torch.cuda.synchronize()
    started = time.perf_counter()
    naive = {name: t.cpu() for name, t in state.items()}
    naive_s = time.perf_counter() - started
    del naive

    root = Path(args.dir or tempfile.mkdtemp(prefix="ckptstream-gpu-"))
    generator = torch.Generator().manual_seed(0)
    expected, rows = [], []
    with Publisher(str(root / "stream"), keyframe_every=args.steps + 1, workers=16) as publisher:
        for step in range(args.steps):
            if step:
                rl_like_step(state, fraction=0.01, generator=generator)
            torch.cuda.synchronize()
            started = time.perf_counter()
            future = publisher.publish(state, step=step)
            blocked = time.perf_counter() - started
            manifest = future.result()
            total = time.perf_counter() - started
            expected.append({name: tensor_hash(t.cpu()) for name, t in state.items()})
            rows.append((step, manifest.kind, manifest.stored_bytes, blocked, total))
            print(f"  version {step}: {manifest.kind:8} stored {manifest.stored_bytes / 1e6:9.1f} MB "
                  f"({100 * manifest.stored_bytes / full:6.2f}%)  publish blocked {blocked:6.3f} s, "
                  f"committed after {total:6.2f} s", flush=True)

    stream = Stream(str(root / "stream"))
    for version, want in enumerate(expected):
        got = {name: tensor_hash(t) for name, t in stream.iter_tensors(version)}
        assert got == want, f"version {version} does not decode to what was on the GPU"
    steady = statistics.median(r[3] for r in rows[2:]) if len(rows) > 2 else rows[-1][3]
    print()
    print(f"naive {{name: t.cpu()}} copy:                {naive_s:7.3f} s ({full / naive_s / 1e9:.1f} GB/s)")
    print(f"publish blocked, first call (pins buffers): {rows[0][3]:7.3f} s")
    print(f"publish blocked, steady state (median):     {steady:7.3f} s ({full / steady / 1e9:.1f} GB/s), "
          f"{naive_s / steady:.1f}x less than the naive copy")
    print(f"delta stored (median): {statistics.median(r[2] for r in rows[1:]) / 1e6:.1f} MB of {full / 1e9:.1f} GB")
    print("every version decodes bit-exactly to the GPU tensors: ok")
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
