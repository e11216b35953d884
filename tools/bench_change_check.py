"""What change checks cost the publisher, and what the change built from the deltas alone saves the reader.

A synthetic bf16 model (``--tensors`` tensors of ``--elements`` elements), a fraction of its elements changed by
a few ulps (``--fraction``, as RL steps change them):

- publisher: the host delta encoder's time with the checks (``codec.encode_checked_chunk``) and without them
  (the same chunks through ``codec.encode_chunk``), alternated, the median of ``--repeat`` runs each;
- reader: the change from version 0 to 1 built from the deltas and the cached copy of version 0
  (``build_change_from_deltas``, layout ``packed-1``) and from the deltas alone (``build_change_unbased``,
  ``xor-1``): bytes read from storage (measured, ``Stream.bytes_read``), pages of the cached copy the first
  one touches (4 KiB pages holding a changed element: what its memory-mapped gather reads from the host's
  disk or page cache), the model's bytes (what decoding the version into the cache reads from the copy),
  and each build's time.

    python tools/bench_change_check.py --tensors 32 --elements 4194304 --fraction 0.01
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckptstream import Publisher, Stream, codec  # noqa: E402
from ckptstream.format import ChangeCheck, Manifest  # noqa: E402
from ckptstream.testing.models import rl_like_step  # noqa: E402
from ckptstream.vllm_loader.inplace.change import build_change_from_deltas, build_change_unbased  # noqa: E402
from ckptstream.writer.encode import BaseVersion, DeltaEncoder  # noqa: E402

PAGE = 4096


def _unchecked_chunk(new, base, itemsize, *, first, place, shuffle, level):
    """``encode_checked_chunk`` without the check: the encoder's work before change checks."""
    return (*codec.encode_chunk(new, base, itemsize, shuffle=shuffle, level=level), ChangeCheck())


def _encode_seconds(state: dict, base: dict, workers: int, checked: bool) -> float:
    manifest = Manifest(version=0, kind="keyframe", base_version=None, keyframe_version=0, chain_length=0,
                        stream_id="s", created="", files=(), tensors=())
    real = codec.encode_checked_chunk
    codec.encode_checked_chunk = real if checked else _unchecked_chunk
    try:
        with ThreadPoolExecutor(workers) as pool:
            started = time.perf_counter()
            encoded = DeltaEncoder(pool).encode(list(state.items()), BaseVersion(manifest, base))
            seconds = time.perf_counter() - started
    finally:
        codec.encode_checked_chunk = real
    assert encoded is not None and all((t.check is not None) for t in encoded.tensors if t.encoding == "xor-zstd")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=32)
    parser.add_argument("--elements", type=int, default=1 << 22)
    parser.add_argument("--fraction", type=float, default=0.01)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    base = {f"layer.{i}.weight": torch.randn(args.elements, generator=generator).to(torch.bfloat16)
            for i in range(args.tensors)}
    state = {n: t.clone() for n, t in base.items()}
    rl_like_step(state, fraction=args.fraction, max_ulps=4, generator=generator)
    model_bytes = sum(t.numel() * t.element_size() for t in base.values())

    timings: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.repeat):
        for checked in (False, True):
            timings[checked].append(_encode_seconds(state, base, args.workers, checked))

    with tempfile.TemporaryDirectory() as tmp:
        url = str(Path(tmp) / "stream")
        with Publisher(url, keyframe_every=10) as publisher:
            publisher.publish(base).result()
            publisher.publish(state).result()
        stream = Stream(url)
        delta = stream.manifest(1)
        cached = stream.materialize(0, Path(tmp) / "v0")
        pages = 0
        for name, old in base.items():
            changed = torch.nonzero(codec.bit_pattern(old) != codec.bit_pattern(state[name])).view(-1)
            pages += torch.unique(changed * old.element_size() // PAGE).numel()
        builds = {}
        for layout in ("packed-1", "xor-1"):
            stream = Stream(url)  # (nothing cached from the other build)
            before, started = stream.bytes_read(), time.perf_counter()
            out = Path(tmp) / f"{layout}.safetensors"
            if layout == "xor-1":
                summary = build_change_unbased(stream, out, base=0, version=1, max_fraction=0.5)
            else:
                summary = build_change_from_deltas(stream, cached, out, base=0, version=1, max_fraction=0.5)
            assert summary.problem is None, summary
            builds[layout] = {"seconds": round(time.perf_counter() - started, 3),
                              "storage_bytes": stream.bytes_read() - before,
                              "cached_copy_bytes": pages * PAGE if layout == "packed-1" else 0,
                              "change_file_bytes": out.stat().st_size}
    print(json.dumps({
        "model_bytes": model_bytes, "changed_elements": summary.changed, "delta_stored_bytes": delta.stored_bytes,
        "encode_s_without_checks": round(statistics.median(timings[False]), 3),
        "encode_s_with_checks": round(statistics.median(timings[True]), 3),
        "check_overhead": round(statistics.median(timings[True]) / statistics.median(timings[False]) - 1, 3),
        "change_builds": builds,
        "decode_into_cache_reads_cached_copy_bytes": model_bytes}, indent=1))


if __name__ == "__main__":
    main()
