#!/usr/bin/env python3
"""Generate the golden stream, the conformance vector of FORMAT.md ("Golden stream"): a keyframe and a
delta of a few small tensors, with the hashes of the tensors every version must decode to.

The delta holds every encoding a reader must implement: ``xor-zstd`` with a sparse and a dense chunk,
``unchanged``, ``zstd`` (a tensor new in the delta), and a tensor the keyframe has and the delta drops.
The expected hashes are computed here from the tensors that were published, not by reading the stream.
It was generated once and committed; run it again only if the format changes (the bytes differ on every
run: stream id, times, writer ids).

    python tools/make_golden_stream.py                   # writes tests/data/golden-stream{,.json}
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckptstream import Publisher, Stream  # noqa: E402
from ckptstream.codec import dtype_name, tensor_hash  # noqa: E402
from ckptstream.format import ENCODING_UNCHANGED, ENCODING_XOR_ZSTD, ENCODING_ZSTD, LAYOUT_DENSE, LAYOUT_SPARSE  # noqa: E402

CHUNK_BYTES = 256
MAX_TOTAL_BYTES = 100_000


def versions() -> list[dict[str, torch.Tensor]]:
    """The tensors of version 0 and version 1."""
    g = torch.Generator().manual_seed(20261201)
    v0 = {
        "embed.weight": (torch.randn(32, 16, generator=g) * 0.02).bfloat16(),  # 1024 bytes: 4 chunks
        "layer.0.weight": torch.randn(8, 16, generator=g),                    # F32, 512 bytes: 2 chunks
        "layer.0.bias": torch.randn(16, generator=g).half(),
        "norm.weight": torch.ones(16, dtype=torch.bfloat16),
        "old.bias": torch.arange(6, dtype=torch.int64),
        "mask": torch.tensor([True, False, True, True, False, False, True, False]),
    }
    v1 = {k: v.clone() for k, v in v0.items() if k != "old.bias"}  # old.bias: dropped by the delta
    embed = v1["embed.weight"].view(-1)
    embed[3] = embed[3] * 1.5                    # chunk 0 of embed.weight: one change, sparse
    embed[128:256] = embed[128:256] * -1.0       # chunk 1: every element changed, dense
    v1["layer.0.weight"].view(-1)[::17] += 1.0   # a few changes in both chunks: sparse
    v1["layer.0.bias"].view(-1)[0] = 2.0
    v1["mask"][1] = True
    v1["added.weight"] = torch.linspace(-1, 1, 24).reshape(2, 3, 4)  # new in the delta: zstd
    return [v0, v1]


def check(url: str) -> None:
    """The delta shows every encoding and layout the vector is meant to cover."""
    delta = Stream(url).manifest(1)
    assert delta.kind == "delta" and Stream(url).manifest(0).kind == "keyframe"
    encodings = {t.encoding for t in delta.tensors}
    layouts = {layout for t in delta.tensors if t.encoding == ENCODING_XOR_ZSTD for _, _, layout in t.chunks}
    assert {ENCODING_XOR_ZSTD, ENCODING_UNCHANGED, ENCODING_ZSTD} <= encodings, encodings
    assert {LAYOUT_SPARSE, LAYOUT_DENSE} <= layouts, layouts
    embed = delta.tensor("embed.weight")
    assert [layout for _, _, layout in embed.chunks][:2] == [LAYOUT_SPARSE, LAYOUT_DENSE], embed.chunks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "tests" / "data"),
                        help="directory to write golden-stream/ and golden-stream.json into")
    args = parser.parse_args()
    out = Path(args.out)
    stream_dir = out / "golden-stream"
    shutil.rmtree(stream_dir, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    states = versions()
    with Publisher(str(stream_dir), assets={"config.json": b'{"model_type": "golden"}\n'}, chunk_bytes=CHUNK_BYTES,
                   delta_max_ratio=1.0, keyframe_every=10, workers=1) as publisher:
        for step, state in enumerate(states):
            publisher.publish(state, step=step, metadata={"note": "ckptstream golden stream"}).result()
    check(str(stream_dir))
    expected = {
        "description": "Decoding every version of golden-stream/ must give exactly these tensors "
                       "(FORMAT.md, 'Golden stream'); hash = xxh3-128 of the raw little-endian bytes.",
        "versions": {str(v): {name: {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "hash": tensor_hash(t)}
                              for name, t in state.items()} for v, state in enumerate(states)},
    }
    (out / "golden-stream.json").write_text(json.dumps(expected, indent=1) + "\n")
    total = sum(p.stat().st_size for p in stream_dir.rglob("*") if p.is_file())
    assert total <= MAX_TOTAL_BYTES, total
    print(f"wrote {stream_dir} ({total} bytes) and {out / 'golden-stream.json'}")


if __name__ == "__main__":
    main()
