#!/usr/bin/env python3
"""Generate the golden stream, the conformance vector of FORMAT.md ("Golden stream"): a keyframe and a
delta of a few small tensors, with the hashes of the tensors every version must decode to.

The delta holds every encoding a reader must implement: ``xor-zstd`` with a sparse and a dense chunk,
``unchanged``, ``zstd`` (a tensor new in the delta), and a tensor the keyframe has and the delta drops.
The expected hashes are computed here from the tensors that were published, not by reading the stream.
It was generated once and committed; run it again only if the format changes (the bytes differ on every
run: stream id, times, writer ids).

    python tools/make_golden_stream.py                   # writes tests/data/golden-stream{,.json}
    python tools/make_golden_stream.py --pieces          # writes tests/data/golden-pieces{,.json}

``--pieces`` writes the vector of format version 3 ("Tensors in pieces"): two ranks of a real
torch.distributed job (gloo, on loopback) publish DTensor shards of the tensors of ``pieces_versions``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import shutil
import socket
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckptstream import Publisher, Stream  # noqa: E402
from ckptstream.codec import dtype_name, tensor_hash  # noqa: E402
from ckptstream.format import (ENCODING_PIECES, ENCODING_UNCHANGED, ENCODING_XOR_ZSTD, ENCODING_ZSTD,  # noqa: E402
                               LAYOUT_DENSE, LAYOUT_SPARSE, PIECES_FORMAT_VERSION)

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


PIECES_WORLD = 2
"""Ranks writing the pieces vector."""


def pieces_versions() -> list[dict[str, tuple[torch.Tensor, str]]]:
    """The whole tensors of version 0 and version 1 of the pieces vector, each with how the ranks hold it
    (``shard0``, ``shard1``: a DTensor ``Shard(dim)``; ``replicate``)."""
    g = torch.Generator().manual_seed(20261205)
    v0 = {
        "embed.weight": ((torch.randn(7, 6, generator=g) * 0.02).bfloat16(), "shard0"),  # rows [0, 4), [4, 7)
        "proj.weight": (torch.randn(4, 6, generator=g), "shard1"),                      # columns [0, 3), [3, 6)
        "norm.weight": (torch.ones(6, dtype=torch.bfloat16), "replicate"),                # whole, one rank
        "tiny.bias": (torch.tensor([0.25]), "shard0"),                                  # rank 1's shard empty
    }
    v1 = {name: (t.clone(), how) for name, (t, how) in v0.items()}
    v1["embed.weight"][0].view(-1)[5] *= 1.5     # rank 0's piece only: the other is unchanged
    v1["proj.weight"][0][::3] += 1.0             # rows 0 and 3: both pieces (columns [0, 3) and [3, 6))
    v1["norm.weight"][0][2] = 2.0
    return [v0, v1]


def _pieces_rank(rank: int, world: int, port: int, url: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from ckptstream.writer.distributed import DistributedPublisher

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (world,))
    placements = {"shard0": [Shard(0)], "shard1": [Shard(1)], "replicate": [Replicate()]}
    with DistributedPublisher(url, assets={"config.json": b'{"model_type": "golden"}\n'}, chunk_bytes=CHUNK_BYTES,
                              delta_max_ratio=1.0, keyframe_every=10, workers=1) as publisher:
        for step, state in enumerate(pieces_versions()):
            sharded = {name: distribute_tensor(t, mesh, placements[how]) for name, (t, how) in state.items()}
            publisher.publish_sharded(sharded, step, step=step,
                                      metadata={"note": "ckptstream golden stream, pieces"}).result()
    dist.destroy_process_group()


def check_pieces(url: str) -> None:
    """The pieces vector shows what it is meant to cover (FORMAT.md, "Golden stream")."""
    stream = Stream(url)
    key, delta = stream.manifest(0), stream.manifest(1)
    assert key.format_version == delta.format_version == PIECES_FORMAT_VERSION
    pieced = {t.name: [(p.offsets, p.encoding) for p in t.pieces]
              for t in delta.tensors if t.encoding == ENCODING_PIECES}
    assert pieced == {"embed.weight": [((0, 0), ENCODING_XOR_ZSTD), ((4, 0), ENCODING_UNCHANGED)],
                      "proj.weight": [((0, 0), ENCODING_XOR_ZSTD), ((0, 3), ENCODING_XOR_ZSTD)]}, pieced
    assert delta.tensor("norm.weight").encoding == ENCODING_XOR_ZSTD
    assert delta.tensor("tiny.bias").encoding == ENCODING_UNCHANGED
    assert len(key.files) == len(delta.files) == PIECES_WORLD


def write_pieces(out: Path) -> None:
    stream_dir = out / "golden-pieces"
    shutil.rmtree(stream_dir, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    ranks = [context.Process(target=_pieces_rank, args=(rank, PIECES_WORLD, port, str(stream_dir)))
             for rank in range(PIECES_WORLD)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join()
    assert [p.exitcode for p in ranks] == [0] * PIECES_WORLD
    check_pieces(str(stream_dir))
    states = [{name: t for name, (t, _) in state.items()} for state in pieces_versions()]
    write_expected(out / "golden-pieces.json", "golden-pieces/", states)
    print(f"wrote {stream_dir} and {out / 'golden-pieces.json'}")


def write_expected(path: Path, what: str, states: list[dict[str, torch.Tensor]]) -> None:
    expected = {
        "description": f"Decoding every version of {what} must give exactly these tensors "
                       "(FORMAT.md, 'Golden stream'); hash = xxh3-128 of the raw little-endian bytes.",
        "versions": {str(v): {name: {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "hash": tensor_hash(t)}
                              for name, t in state.items()} for v, state in enumerate(states)},
    }
    path.write_text(json.dumps(expected, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "tests" / "data"),
                        help="directory to write golden-stream/ and golden-stream.json into")
    parser.add_argument("--pieces", action="store_true", help="write the vector of tensors in pieces instead")
    args = parser.parse_args()
    out = Path(args.out)
    if args.pieces:
        write_pieces(out)
        return
    stream_dir = out / "golden-stream"
    shutil.rmtree(stream_dir, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    states = versions()
    with Publisher(str(stream_dir), assets={"config.json": b'{"model_type": "golden"}\n'}, chunk_bytes=CHUNK_BYTES,
                   delta_max_ratio=1.0, keyframe_every=10, workers=1) as publisher:
        for step, state in enumerate(states):
            publisher.publish(state, step=step, metadata={"note": "ckptstream golden stream"}).result()
    check(str(stream_dir))
    write_expected(out / "golden-stream.json", "golden-stream/", states)
    total = sum(p.stat().st_size for p in stream_dir.rglob("*") if p.is_file())
    assert total <= MAX_TOTAL_BYTES, total
    print(f"wrote {stream_dir} ({total} bytes) and {out / 'golden-stream.json'}")


if __name__ == "__main__":
    main()
