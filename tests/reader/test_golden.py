"""The golden stream (tests/data/golden-stream, FORMAT.md "Golden stream"): committed bytes of a keyframe
and a delta that any conforming reader decodes to the tensors of golden-stream.json. Read here with the
reader alone, from a copy, so the committed files stay as they are."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ckptstream import Stream
from ckptstream.codec import dtype_name, tensor_hash
from ckptstream.format import LAYOUT_DENSE, LAYOUT_SPARSE

DATA = Path(__file__).resolve().parents[1] / "data"
EXPECTED = json.loads((DATA / "golden-stream.json").read_text())["versions"]


@pytest.fixture
def golden(tmp_path) -> Stream:
    copy = tmp_path / "golden-stream"
    shutil.copytree(DATA / "golden-stream", copy)
    return Stream(str(copy))


def test_golden_stream_is_small_and_covers_every_encoding(golden):
    files = [p for p in (DATA / "golden-stream").rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= 100_000
    assert golden.versions() == [0, 1]
    delta = golden.manifest(1)
    assert {t.encoding for t in delta.tensors} == {"xor-zstd", "unchanged", "zstd"}
    layouts = [layout for t in delta.tensors for _, _, layout in t.chunks]
    assert LAYOUT_SPARSE in layouts and LAYOUT_DENSE in layouts
    assert set(EXPECTED["0"]) - set(EXPECTED["1"]) == {"old.bias"}  # the delta drops a tensor


@pytest.mark.parametrize("version", [0, 1])
def test_golden_stream_decodes_to_the_expected_tensors(golden, version):
    got = {name: {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "hash": tensor_hash(t)}
           for name, t in golden.iter_tensors(version)}
    assert got == EXPECTED[str(version)]
    report = golden.verify(version)
    assert report.tensors == len(EXPECTED[str(version)])


def test_golden_stream_materializes_from_its_keyframe_copy(golden, tmp_path):
    from safetensors.torch import load_file

    base = golden.materialize(0, tmp_path / "v0")
    out = golden.materialize(1, tmp_path / "v1", base_dir=base)
    got = {name: tensor_hash(t) for name, t in load_file(out / "model.safetensors").items()}
    assert got == {name: spec["hash"] for name, spec in EXPECTED["1"].items()}
    assert (out / "config.json").read_bytes() == b'{"model_type": "golden"}\n'
