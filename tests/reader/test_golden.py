"""The golden streams (tests/data/golden-stream and, of format version 3, golden-pieces; FORMAT.md "Golden
stream"): committed bytes of a keyframe and a delta that any conforming reader decodes to the tensors of
golden-stream.json (golden-pieces.json). Read here with the reader alone, from a copy, so the committed files
stay as they are."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from ckptstream import IncompatibleStreamError, IntegrityError, Stream
from ckptstream import format as format_module
from ckptstream.codec import INT_OF_SIZE, dtype_name, tensor_hash
from ckptstream.format import LAYOUT_DENSE, LAYOUT_SPARSE, PIECES_FORMAT_VERSION

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


# ---------------------------------------------------------------------------------------- format version 3

PIECES_EXPECTED = json.loads((DATA / "golden-pieces.json").read_text())["versions"]


@pytest.fixture
def golden_pieces(tmp_path) -> Stream:
    copy = tmp_path / "golden-pieces"
    shutil.copytree(DATA / "golden-pieces", copy)
    return Stream(str(copy))


def test_golden_pieces_cover_pieces_along_both_dimensions_and_their_deltas(golden_pieces):
    files = [p for p in (DATA / "golden-pieces").rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= 100_000
    assert golden_pieces.versions() == [0, 1]
    for version in (0, 1):
        assert golden_pieces.manifest(version).format_version == PIECES_FORMAT_VERSION
    delta = golden_pieces.manifest(1)
    assert [(p.offsets, p.shape) for p in delta.tensor("proj.weight").pieces] == [((0, 0), (4, 3)), ((0, 3), (4, 3))]
    assert [p.encoding for p in delta.tensor("embed.weight").pieces] == ["xor-zstd", "unchanged"]


@pytest.mark.parametrize("version", [0, 1])
def test_golden_pieces_decode_to_the_expected_whole_tensors(golden_pieces, version):
    got = {name: {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "hash": tensor_hash(t)}
           for name, t in golden_pieces.iter_tensors(version)}
    assert got == PIECES_EXPECTED[str(version)]
    assert golden_pieces.verify(version).tensors == len(PIECES_EXPECTED[str(version)])


def test_golden_pieces_materialize_whole_and_from_a_base_copy(golden_pieces, tmp_path):
    from safetensors.torch import load_file, save_file

    base = golden_pieces.materialize(0, tmp_path / "v0")
    for out in (golden_pieces.materialize(1, tmp_path / "v1"),
                golden_pieces.materialize(1, tmp_path / "v1-on-v0", base_dir=base)):
        got = {name: tensor_hash(t) for name, t in load_file(out / "model.safetensors").items()}
        assert got == {name: spec["hash"] for name, spec in PIECES_EXPECTED["1"].items()}
        golden_pieces.check_materialized(out, 1)  # the whole tensors checked against the pieces' hashes
    tensors = load_file(out / "model.safetensors")
    tensors["proj.weight"][3, 4] += 1.0  # an element of the second piece (columns 3 to 5)
    save_file(tensors, out / "model.safetensors")
    with pytest.raises(IntegrityError, match="differs from the base version") as refused:
        golden_pieces.check_materialized(out, 1)
    assert refused.value.tensor == "proj.weight"
    # Pieces decoded on the base copy start from it: a damaged copy is named, never used.
    tensors = load_file(base / "model.safetensors")
    tensors["embed.weight"][6, 0] += 1.0  # in the piece that version 1 leaves unchanged
    save_file(tensors, base / "model.safetensors")
    with pytest.raises(IntegrityError, match="the given base copy differs") as refused:
        golden_pieces.materialize(1, tmp_path / "v1-on-damaged", base_dir=base)
    assert (refused.value.version, refused.value.tensor) == (0, "embed.weight")


def test_golden_pieces_changes_are_those_of_the_whole_tensors(golden_pieces):
    before, after = dict(golden_pieces.iter_tensors(0)), dict(golden_pieces.iter_tensors(1))
    found = dict(golden_pieces.changes_since(1, 0, lambda e, positions, values: (e.name, (positions, values)),
                                             max_tensor_bytes=1 << 20))
    for name, new in after.items():
        ints = INT_OF_SIZE[new.element_size()]
        old_bits, new_bits = before[name].reshape(-1).view(ints), new.reshape(-1).view(ints)
        positions, values = found[name]
        assert positions.numel() or name == "tiny.bias"
        assert positions.tolist() == torch.nonzero(old_bits != new_bits).reshape(-1).tolist(), name
        assert torch.equal(old_bits[positions] ^ values, new_bits[positions]), name


def test_a_reader_of_format_2_refuses_pieces_and_reads_the_rest(golden, golden_pieces, monkeypatch):
    monkeypatch.setattr(format_module, "FORMAT_VERSION", 2)
    for version in (0, 1):
        with pytest.raises(IncompatibleStreamError, match="format version 3 is not supported.*Upgrade ckptstream"):
            golden_pieces.manifest(version)
    assert len(dict(golden.iter_tensors(1))) == len(EXPECTED["1"])  # streams of format 1 and 2: read as before


def test_golden_pieces_mirror_bundle_and_relay_as_any_stream(golden_pieces, tmp_path):
    from ckptstream.bundle import export_bundle, import_bundle
    from ckptstream.mirror import Mirror
    from ckptstream.relay import Relay
    from ckptstream.storage import open_storage

    Mirror(golden_pieces, open_storage(str(tmp_path / "mirror"))).run_once()
    bundle = tmp_path / "pieces.tar"
    export_bundle(golden_pieces, bundle)
    import_bundle(bundle, open_storage(str(tmp_path / "imported")))
    with Relay(golden_pieces.url, token="t") as relay:  # (over HTTP: no listing, the latest-version hint)
        copies = (Stream(str(tmp_path / "mirror")), Stream(str(tmp_path / "imported")),
                  Stream(relay.url, storage_options={"token": "t"}))
        for copy in copies:
            assert copy.versions() == [0, 1]
            got = {name: tensor_hash(t) for name, t in copy.iter_tensors(1)}
            assert got == {name: spec["hash"] for name, spec in PIECES_EXPECTED["1"].items()}


def test_golden_pieces_change_for_in_place_updates(golden_pieces, tmp_path):
    """What a follower applies in place (``vllm_loader.change``): built from the pieces' deltas and the
    served version's copy, it holds exactly the elements that differ, with their old and new values."""
    from safetensors import safe_open

    from ckptstream.vllm_loader.inplace.change import build_change_from_deltas, read_change

    base = golden_pieces.materialize(0, tmp_path / "v0")
    out = tmp_path / "change.safetensors"
    summary = build_change_from_deltas(golden_pieces, base, out, base=0, version=1, max_fraction=1.0)
    assert summary.problem is None and summary.changed == 14
    before, after = dict(golden_pieces.iter_tensors(0)), dict(golden_pieces.iter_tensors(1))
    with safe_open(str(out), framework="pt") as handle:
        changes = dict(read_change(handle))
    assert set(changes) == {"embed.weight", "proj.weight", "norm.weight"}
    for name, (shape, positions, old, new) in changes.items():
        assert shape == tuple(after[name].shape)
        patched = before[name].clone().reshape(-1)
        patched[positions] = new
        assert torch.equal(before[name].reshape(-1)[positions], old) and torch.equal(patched, after[name].reshape(-1))
