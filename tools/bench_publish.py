#!/usr/bin/env python3
"""Benchmark: publishing an RL-like sequence vs saving full safetensors, and materializing vs reading.

On a synthetic bf16 model (default 1 GB) where each step changes ~1% of elements by a few ulps, prints
side by side, from one run: bytes stored per delta vs a full safetensors file; publish wall time vs
``safetensors.torch.save_file`` of the full state dict (+ fsync) to the same storage; the trainer-blocking
time of ``publish``; materialize time vs reading the full safetensors; and the storage's raw write/read
bandwidth measured in the same run. Medians over the steps; ratios are what to compare across machines.

    python tools/bench_publish.py                        # 1 GB model, 6 versions, under /tmp
    python tools/bench_publish.py --size 2GB --steps 8 --dir /mnt/nfs/bench
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckptstream import Publisher, Stream  # noqa: E402
from ckptstream.cli.options import parse_bytes  # noqa: E402
from ckptstream.storage import fsync_path  # noqa: E402
from ckptstream.testing.models import TinyModelSpec, rl_like_step, tiny_state_dict  # noqa: E402


def drop_caches() -> bool:
    """Empty the page cache (root only), so reads come from the storage itself; False if not allowed."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def raw_bandwidth(directory: Path, nbytes: int) -> tuple[float, float]:
    """Write+fsync then read back ``nbytes`` in 16 MiB blocks; returns (write B/s, read B/s)."""
    block = os.urandom(16 << 20)
    path = directory / "raw.bin"

    def write() -> None:
        with open(path, "wb") as f:
            for _ in range(max(1, nbytes // len(block))):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())

    def read() -> int:
        total = 0
        with open(path, "rb", buffering=0) as f:
            buffer = bytearray(16 << 20)
            while n := f.readinto(buffer):
                total += n
        return total

    write_s, _ = timed(write)
    drop_caches()
    read_s, total = timed(read)
    path.unlink()
    return total / write_s, total / read_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=parse_bytes, default=parse_bytes("1GB"))
    parser.add_argument("--steps", type=int, default=6, help="versions to publish (1 keyframe + deltas)")
    parser.add_argument("--fraction", type=float, default=0.01, help="fraction of elements changed per step")
    parser.add_argument("--dir", help="storage directory (default: a temp dir under /tmp)")
    parser.add_argument("--out", default="/dev/shm" if os.path.isdir("/dev/shm") else None,
                        help="where materialized directories go, as a follower's cache would "
                             "(default /dev/shm, else the storage directory)")
    args = parser.parse_args()

    root = Path(args.dir or tempfile.mkdtemp(prefix="ckptstream-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    spec = TinyModelSpec.for_size(args.size)
    state = tiny_state_dict(spec)
    full_bytes = sum(t.numel() * t.element_size() for t in state.values())
    print(f"model: {spec.arch}, {spec.num_layers} layers, hidden {spec.hidden_size}, {len(state)} tensors, "
          f"{full_bytes / 1e9:.2f} GB bf16; {args.fraction:.1%} of elements change per step; storage {root}; "
          f"{torch.get_num_threads()} threads")

    write_bw, read_bw = raw_bandwidth(root, full_bytes)
    generator = torch.Generator().manual_seed(0)
    url = str(root / "stream")
    full_dir = root / "full"
    full_dir.mkdir(exist_ok=True)
    rows = []
    with Publisher(url, keyframe_every=args.steps + 1) as publisher:
        for step in range(args.steps):
            if step:
                rl_like_step(state, fraction=args.fraction, generator=generator)
            full_path = full_dir / f"step{step}.safetensors"
            os.sync()  # earlier writes must not be flushed inside the next timed operation
            save_s, _ = timed(lambda path=full_path: (save_file(state, str(path)), fsync_path(path)))
            full_file_bytes = full_path.stat().st_size
            if step:
                full_path.unlink()  # keep only the last full file, for the read comparison
            os.sync()
            start = time.perf_counter()
            future = publisher.publish(state, step=step)
            blocked = time.perf_counter() - start
            manifest = future.result()
            publish_s = time.perf_counter() - start
            rows.append(dict(step=step, kind=manifest.kind, stored=manifest.stored_bytes, full=full_file_bytes,
                             save_s=save_s, publish_s=publish_s, blocked_s=blocked))
            print(f"  version {step}: {manifest.kind:8} stored {manifest.stored_bytes / 1e6:9.2f} MB "
                  f"({100 * manifest.stored_bytes / full_file_bytes:6.2f}% of full)  publish {publish_s:6.2f} s "
                  f"(blocked {1000 * blocked:6.1f} ms)  full save_file+fsync {save_s:6.2f} s", flush=True)
        last_full = full_dir / f"step{args.steps - 1}.safetensors"
        save_file(state, str(last_full))

    stream = Stream(url)
    latest = stream.latest()
    out = Path(tempfile.mkdtemp(prefix="ckptstream-bench-", dir=args.out)) if args.out else root
    cold = drop_caches()
    read_s, _ = timed(lambda: load(last_full.read_bytes()))
    drop_caches()
    materialize_s, _ = timed(lambda: stream.materialize(latest, out / "mat", overwrite=True))
    base = stream.materialize(latest - 1, out / "base", overwrite=True)
    drop_caches()
    follow_s, _ = timed(lambda: stream.materialize(latest, out / "next", base_dir=base, overwrite=True))

    deltas = [r for r in rows if r["kind"] == "delta"]
    med = lambda key: statistics.median(r[key] for r in deltas)  # noqa: E731
    delta_fraction = statistics.median(r["stored"] / r["full"] for r in deltas)
    print()
    print(f"{'measure':44} {'ckptstream':>14} {'baseline':>14} {'ratio':>8}  target")
    print(f"{'bytes per delta version (median)':44} {med('stored') / 1e6:11.2f} MB {deltas[0]['full'] / 1e6:11.2f} MB "
          f"{100 * delta_fraction:7.2f}%  <= 1.5% (full safetensors file)")
    print(f"{'delta publish wall time (median)':44} {med('publish_s'):12.2f} s {med('save_s'):12.2f} s "
          f"{med('save_s') / med('publish_s'):7.1f}x  >= 3x faster (save_file + fsync)")
    print(f"{'trainer-blocking time of publish (median)':44} {1000 * med('blocked_s'):11.1f} ms "
          f"{med('save_s'):12.2f} s {med('save_s') / med('blocked_s'):7.0f}x  (vs a synchronous full save)")
    chain = len(stream.chain(latest))
    print(f"{f'materialize v{latest} (chain of {chain}) GB/s':44} {full_bytes / materialize_s / 1e9:12.2f}   "
          f"{full_bytes / read_s / 1e9:12.2f}   {read_s / materialize_s:7.2f}x  (read + load of the full file)")
    print(f"{'materialize from previous version GB/s':44} {full_bytes / follow_s / 1e9:12.2f}   "
          f"{read_bw / 1e9:12.2f}   {(full_bytes / follow_s) / read_bw:7.2f}x  >= 0.8x raw read bandwidth")
    print(f"{'materialize from keyframe vs raw read':44} {full_bytes / materialize_s / 1e9:12.2f}   "
          f"{read_bw / 1e9:12.2f}   {(full_bytes / materialize_s) / read_bw:7.2f}x  >= 0.8x raw read bandwidth")
    print(f"{'storage raw write (fsync) / read GB/s':44} {write_bw / 1e9:12.2f}   {read_bw / 1e9:12.2f}   "
          f"{'(page cache dropped before each read)' if cold else '(page cache could not be dropped)'}")
    if out != root:
        shutil.rmtree(out, ignore_errors=True)
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
