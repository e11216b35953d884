#!/usr/bin/env python3
"""Benchmark: decoding at storage speed, and delta sizes per chunk layout.

Decode (medians of ``--repeats``, side by side from one run, a synthetic bf16 model, 1 % of elements
changed per step by 1–3 ulps, the stream a directory on the storage given by ``--dir``):
  (a) raw cold read bandwidth of the files of the newest version's chain (keyframe + deltas), read
      sequentially in 16 MiB blocks;
  (b) ``materialize`` of the newest version (keyframe + chain of deltas) from cold, as model bytes per
      second, and its ratio to (a) (target >= 0.8x);
  (c) the follower's apply-one-delta (``Stream.write_into`` with ``base_dir`` the previous version's
      materialized directory, what ``VersionCache.acquire`` does) vs a plain copy of that directory's weight
      files on the same machine (target <= 1.5x).
Before every cold read the stream's files are evicted from the page cache with ``posix_fadvise(DONTNEED)``
(``--drop-caches``: the whole page cache, as root; the run says which).

Sizes (``--sizes``): stored bytes of one 4 MiB chunk per layout at 0.1 / 1 / 10 % changed elements, bf16
and fp32, and the decode speed of each.

    python tools/bench_decode.py                      # 1 GB model, 5 deltas, under /tmp, outputs in /dev/shm
    python tools/bench_decode.py --size 2GB --dir /mnt/nfs/bench
    python tools/bench_decode.py --sizes-only
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckptstream import Publisher, Stream, codec  # noqa: E402
from ckptstream.cli.options import parse_bytes  # noqa: E402
from ckptstream.format import data_path  # noqa: E402
from ckptstream.testing.models import TinyModelSpec, rl_like_step, tiny_state_dict  # noqa: E402

BLOCK = 16 << 20


def make_cold(files: list[Path], drop_caches: bool) -> str:
    """Evict ``files`` from the page cache; returns how: ``fadvise`` (``posix_fadvise(DONTNEED)`` on each
    file, after a sync: only these files go cold) or ``drop_caches`` (the whole page cache, root only: also
    the libraries' code pages, which the decoder then faults back in from disk)."""
    os.sync()
    if drop_caches:
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            return "drop_caches"
        except OSError:
            pass
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise"


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def read_files(files: list[Path]) -> int:
    buffer = bytearray(BLOCK)
    total = 0
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buffer):
                total += n
    return total


def copy_weights(src: Path, dst: Path) -> None:
    dst.mkdir()
    for path in sorted(src.glob("*.safetensors")):
        shutil.copyfile(path, dst / path.name)


def decode_benchmark(args: argparse.Namespace) -> None:
    root = Path(args.dir or tempfile.mkdtemp(prefix="ckptstream-bench-decode-"))
    root.mkdir(parents=True, exist_ok=True)
    out = Path(tempfile.mkdtemp(prefix="ckptstream-bench-decode-", dir=args.out)) if args.out else root
    spec = TinyModelSpec.for_size(args.size)
    url = str(root / "stream")
    state = tiny_state_dict(spec)
    full_bytes = sum(t.numel() * t.element_size() for t in state.values())
    generator = torch.Generator().manual_seed(0)
    with Publisher(url, keyframe_every=args.deltas + 1) as publisher:
        for step in range(args.deltas + 1):
            if step:
                rl_like_step(state, fraction=args.fraction, generator=generator)
            publisher.publish(state, step=step).result()
    del state
    stream = Stream(url)
    latest = stream.latest()
    chain = stream.chain(latest)
    files = [root / "stream" / data_path(m.version, f.name) for m in chain for f in m.files]
    stored = sum(m.stored_bytes for m in chain)
    print(f"model: {spec.arch}, {spec.num_layers} layers, hidden {spec.hidden_size}, {len(chain[0].tensors)} "
          f"tensors, {full_bytes / 1e9:.2f} GB bf16; chain of {len(chain)} ({stored / 1e9:.3f} GB stored, deltas "
          f"{statistics.median(m.stored_bytes for m in chain[1:]) / 1e6:.1f} MB each); storage {root}; outputs "
          f"in {out}; {os.cpu_count()} cores; {args.repeats} repeats", flush=True)

    raw, mat, follow, copy = [], [], [], []
    base = stream.materialize(latest - 1, out / "base")
    how = ""
    for _ in range(args.repeats):
        how = make_cold(files, args.drop_caches)
        raw.append(timed(lambda: read_files(files)))
        make_cold(files, args.drop_caches)
        mat.append(timed(lambda: stream.materialize(latest, out / "mat")))
        shutil.rmtree(out / "mat")
        make_cold(files, args.drop_caches)
        (out / "next").mkdir()
        follow.append(timed(lambda: stream.write_into(latest, out / "next", base_dir=base)))
        shutil.rmtree(out / "next")
        copy.append(timed(lambda: copy_weights(base, out / "copy")))
        shutil.rmtree(out / "copy")
    raw_s, mat_s, follow_s, copy_s = (statistics.median(x) for x in (raw, mat, follow, copy))
    raw_bw = stored / raw_s
    print()
    print(f"{f'measure (median of {args.repeats})':48} {'seconds':>8} {'GB/s':>7}   ratio / target")
    print(f"{'(a) raw cold read of the chain files':48} {raw_s:8.3f} {raw_bw / 1e9:7.2f}   (cache: {how})")
    print(f"{f'(b) materialize v{latest} (keyframe + {len(chain) - 1} deltas), cold':48} {mat_s:8.3f} "
          f"{full_bytes / mat_s / 1e9:7.2f}   {full_bytes / mat_s / raw_bw:.2f}x of (a)   target >= 0.8x")
    print(f"{f'(c) follower: apply one delta to v{latest - 1}':48} {follow_s:8.3f} "
          f"{full_bytes / follow_s / 1e9:7.2f}   {follow_s / copy_s:.2f}x the copy   target <= 1.5x")
    print(f"{'    plain copy of the model files (same fs)':48} {copy_s:8.3f} {full_bytes / copy_s / 1e9:7.2f}")
    print(f"  all runs: raw {fmt(raw)} | materialize {fmt(mat)} | follower {fmt(follow)} | copy {fmt(copy)}")
    shutil.rmtree(out if out != root else out / "base", ignore_errors=True)
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)


def fmt(values: list[float]) -> str:
    return " ".join(f"{v:.3f}" for v in values)


def sizes_benchmark(repeats: int) -> None:
    """Stored size of one 4 MiB chunk per layout and change rate, and decode time of each (old and new
    frames timed alternately, so that a busy machine slows both alike)."""
    print(f"\n{'dtype':8} {'changed':>7} {'layout':>7} {'stored %':>9} {'before %':>9} {'apply ms':>9} "
          f"{'before':>7} {'zstd ms':>8} {'before':>7}")
    generator = torch.Generator().manual_seed(1)
    for dtype in (torch.bfloat16, torch.float32):
        for fraction in (0.001, 0.01, 0.1):
            n = codec.DEFAULT_CHUNK_BYTES // dtype.itemsize
            base = (torch.randn(n, generator=generator) * 0.02).to(dtype)
            new = base.clone()
            rl_like_step({"w": new}, fraction=fraction, generator=generator)
            a, b = codec.as_bytes(new), codec.as_bytes(base)
            frame, _, layout = codec.encode_chunk(a, b, dtype.itemsize, shuffle=True, level=1)
            # Before: the same payload compressed in one pass (one entropy table per 128 KiB block).
            before = codec._compressor(3).compress(codec.SparseChunks(
                *_positions_values(a, b, dtype.itemsize), dtype.itemsize, elements=n, chunk_elements=n,
                shuffle=True).payload(0)) if layout == "sparse" else frame
            apply_new, apply_old, zstd_new, zstd_old = decode_ms([frame, before], a, b, dtype.itemsize, layout,
                                                                 max(repeats, 15))
            print(f"{str(dtype).removeprefix('torch.'):8} {fraction:7.1%} {layout:>7} "
                  f"{100 * len(frame) / a.numel():9.3f} {100 * len(before) / a.numel():9.3f} "
                  f"{apply_new:9.2f} {apply_old:7.2f} {zstd_new:8.3f} {zstd_old:7.3f}")


def decode_ms(frames: list[bytes], new: torch.Tensor, base: torch.Tensor, itemsize: int, layout: str,
              repeats: int) -> list[float]:
    """Median milliseconds of applying each stored XOR chunk of ``frames`` to a copy of ``base`` (checked
    to give ``new``), then of decompressing each alone; the frames alternate within each repeat."""
    applies: list[list[float]] = [[] for _ in frames]
    zstds: list[list[float]] = [[] for _ in frames]
    for _ in range(repeats):
        for stored, apply_times, zstd_times in zip(frames, applies, zstds):
            target = base.clone()
            apply_times.append(timed(lambda t=target, f=stored: codec.apply_chunk(
                t, f, itemsize, shuffle=True, layout=layout, xor=True)))
            assert torch.equal(target, new)
            zstd_times.append(timed(lambda f=stored: codec._decompress(f, 2 * new.numel() + 8, exact=False)))
    return [1000 * statistics.median(t) for t in applies] + [1000 * statistics.median(t) for t in zstds]


def _positions_values(a: torch.Tensor, b: torch.Tensor, itemsize: int) -> tuple[torch.Tensor, torch.Tensor]:
    xor = codec._xor(a, b)
    positions = codec._changed_positions(xor, itemsize)
    return positions, xor.view(codec.INT_OF_SIZE[itemsize])[positions]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=parse_bytes, default=parse_bytes("1GB"))
    parser.add_argument("--deltas", type=int, default=5, help="deltas after the keyframe")
    parser.add_argument("--fraction", type=float, default=0.01, help="fraction of elements changed per step")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", help="storage directory (default: a temp dir under /tmp)")
    parser.add_argument("--out", default="/dev/shm" if os.path.isdir("/dev/shm") else None,
                        help="where materialized directories go, as a follower's cache would (default /dev/shm)")
    parser.add_argument("--drop-caches", action="store_true",
                        help="drop the whole page cache before each cold read (root), not only the stream's files")
    parser.add_argument("--sizes-only", action="store_true", help="only the per-layout chunk sizes")
    parser.add_argument("--no-sizes", action="store_true", help="only the decode figures")
    args = parser.parse_args()
    if not args.sizes_only:
        decode_benchmark(args)
    if not args.no_sizes:
        sizes_benchmark(args.repeats)


if __name__ == "__main__":
    main()
