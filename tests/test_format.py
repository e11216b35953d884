"""The format module: names, seals, schema validation."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from ckptstream import IncompatibleStreamError, IntegrityError, UnsafeManifestError
from ckptstream.errors import EXIT_NOT_FOUND, TensorNotFoundError
from ckptstream.format import (ADAPTER_CONFIG_FILE, ADAPTER_FORMAT_VERSION, ENCODING_PIECES, FORMAT_VERSION,
                               MAX_JSON_DEPTH, MAX_SHAPE_DIMS, PIECES_FORMAT_VERSION, STREAM_FILE, STREAM_KIND_ADAPTER,
                               STREAM_KIND_WEIGHTS, AdapterInfo, ChangeCheck, FileEntry, Manifest, StreamInfo,
                               TensorEntry, check_element,
                               content_hash, is_safe_file_name, join_pieces, manifest_format_version, manifest_path,
                               parse_version_name, pieces_hash, shard_groups, tensor_name_problem, version_name)
from tests.helpers import reseal


def _manifest(**changes) -> Manifest:
    data = b"\0" * 16
    fields = dict(version=3, kind="keyframe", base_version=None, keyframe_version=3, chain_length=0,
                  stream_id="s", created="2026-01-01T00:00:00Z",
                  files=(FileEntry("a.safetensors", 100, content_hash(b"x")),),
                  tensors=(TensorEntry("w", "BF16", (2, 4), content_hash(data), "raw", "a.safetensors", 8, 16,
                                       content_hash(data)),))
    fields.update(changes)
    return Manifest(**fields)


def test_version_names_sort_numerically():
    names = [version_name(v) for v in (0, 9, 10, 123456789012 // 1000, 999)]
    assert sorted(names) == [version_name(v) for v in sorted((0, 9, 10, 123456789, 999))]
    assert parse_version_name(version_name(42) + ".json") == 42
    assert parse_version_name(".tmp-x") is None
    assert manifest_path(7) == "manifests/000000000007.json"
    with pytest.raises(ValueError):
        version_name(-1)


def test_manifest_round_trip_and_seal():
    manifest = _manifest()
    raw = manifest.to_bytes()
    assert Manifest.from_bytes(raw, version=3) == manifest
    for position in range(0, len(raw), 7):
        flipped = bytearray(raw)
        flipped[position] ^= 0x02
        with pytest.raises(IntegrityError):
            Manifest.from_bytes(bytes(flipped), version=3)
    with pytest.raises(UnsafeManifestError, match="claims version 3"):
        Manifest.from_bytes(raw, version=4)


def test_a_manifest_is_written_a_member_per_line_and_a_tensor_per_line():
    data = b"\0" * 16
    tensors = tuple(TensorEntry(f"layer.{i}.w", "BF16", (2, 4), content_hash(data), "raw", "a.safetensors", 16 * i, 16,
                                content_hash(data)) for i in range(3))
    manifest = _manifest(tensors=tensors, files=(FileEntry("a.safetensors", 48, content_hash(b"x")),),
                         metadata={"loss": 1.5, "tags": ["a", {"b": None}]})
    raw = manifest.to_bytes()
    lines = raw.decode().split("\n")
    body = json.loads(raw)
    assert lines[0] == "{" and lines[-1] == "}" and len(lines) == 2 + len(body) + 2 + len(body["files"]) + len(tensors)
    rows = [json.loads(line.rstrip(",")) for line in lines if line.startswith('  {"name": "layer.')]
    assert rows == body["tensors"]
    assert ' "metadata": {"loss": 1.5, "tags": ["a", {"b": null}]},' in lines
    assert lines[-2].startswith(' "manifest_hash": "xxh3-128:')
    assert Manifest.from_bytes(raw, version=3) == manifest
    # (an earlier writer's layout, json.dumps(indent=1), reads the same: readers do not depend on it)
    assert Manifest.from_bytes(_reseal(json.dumps(body, indent=1).encode()), version=3) == manifest


def test_unsafe_names_and_ranges_are_refused():
    for name in ("../x", "a/b", "", ".hidden", "x" * 300, "C:\\x"):
        assert not is_safe_file_name(name)
    with pytest.raises(UnsafeManifestError, match="beyond the end"):
        Manifest.from_bytes(_manifest(files=(FileEntry("a.safetensors", 20, content_hash(b"x")),)).to_bytes(),
                            version=3)
    bad = _manifest(tensors=(TensorEntry("w", "BF16", (2, 4), content_hash(b""), "raw", "a.safetensors", 8, 15,
                                         content_hash(b"")),))
    with pytest.raises(UnsafeManifestError, match="need 16"):
        Manifest.from_bytes(bad.to_bytes(), version=3)


def test_names_and_hashes_with_a_trailing_newline_are_refused():
    """``$`` matches before a final newline: each whole name and hash must match its rule."""
    assert is_safe_file_name("a.safetensors") and not is_safe_file_name("a.safetensors\n")
    newline_name = _manifest(files=(FileEntry("a.safetensors\n", 100, content_hash(b"x")),))
    with pytest.raises(UnsafeManifestError, match="file name"):
        Manifest.from_bytes(newline_name.to_bytes(), version=3)
    newline_hash = _manifest(files=(FileEntry("a.safetensors", 100, content_hash(b"x") + "\n"),))
    with pytest.raises(IntegrityError, match="is not an xxh3-128: hash"):
        Manifest.from_bytes(newline_hash.to_bytes(), version=3)


def test_newer_format_version_is_refused():
    with pytest.raises(IncompatibleStreamError, match=f"format version {FORMAT_VERSION + 1} is not supported"):
        Manifest.from_bytes(_manifest(format_version=FORMAT_VERSION + 1).to_bytes(), version=3)


def test_shard_groups():
    assert shard_groups([5, 5, 5, 20, 1], 10) == [[0, 1], [2], [3], [4]]
    assert shard_groups([], 10) == []


def test_manifests_and_stream_files_are_strict_json():
    with pytest.raises(ValueError, match="NaN and Infinity"):
        _manifest(metadata={"loss": float("nan")}).to_bytes()
    with pytest.raises(ValueError, match="nested deeper"):
        _manifest(metadata={"deep": _nested(MAX_JSON_DEPTH)}).to_bytes()
    raw = _manifest(metadata={"loss": 1.5}).to_bytes()
    assert raw == _manifest(metadata={"loss": 1.5}).to_bytes()  # the byte form is deterministic
    for bad in (raw.replace(b'"loss": 1.5', b'"loss": NaN'), raw.replace(b'"loss": 1.5', b'"loss": Infinity'),
                raw.replace(b'"metadata": {', b'"metadata": {"step": 1, "step": 2,')):
        with pytest.raises(IntegrityError, match="not valid JSON"):
            Manifest.from_bytes(_reseal(bad), version=3)
    many = ", ".join(f'"k{i}": {i}' for i in range(200_000)).encode()  # (found in linear time: a forged input)
    with pytest.raises(IntegrityError, match="'k7' appears twice"):
        Manifest.from_bytes(_reseal(raw.replace(b'"metadata": {', b'"metadata": {' + many + b', "k7": 0, ')),
                            version=3)
    entry = _manifest().tensors[0]  # a field deeper than the C encoder recurses: a ValueError naming the manifest
    with pytest.raises(ValueError, match="manifest of version 3 is nested deeper"):
        _manifest(tensors=(dataclasses.replace(entry, changed=_nested(100_000)),)).to_bytes()
    info = StreamInfo("s", "2026-01-01T00:00:00Z")
    assert StreamInfo.from_bytes(info.to_bytes()) == info
    for bad in (info.to_bytes().replace(b'"s"', b'"s", "stream_id": "t"'), "\ufeff".encode() + info.to_bytes(),
                info.to_bytes().decode().encode("utf-16")):
        with pytest.raises(IntegrityError):
            StreamInfo.from_bytes(bad)


def _nested(depth: int) -> object:
    value: object = 0
    for _ in range(depth):
        value = [value]
    return value


def _reseal(raw: bytes) -> bytes:
    """Seal ``raw`` again, as a writer would (FORMAT.md, "Manifest seal")."""
    key = b'"manifest_hash": "xxh3-128:'
    start = raw.rfind(key) + len(key)
    zeroed = raw[:start] + b"0" * 32 + raw[start + 32:]
    return raw[:start] + content_hash(zeroed)[len("xxh3-128:"):].encode() + raw[start + 32:]


@pytest.mark.parametrize("name", ["", "a\nb", "tab\there", "x\x7f", "c1\x85", "\ud800", "é" * 513, "__metadata__"])
def test_tensor_names_follow_the_one_rule(name):
    assert tensor_name_problem(name) is not None
    with pytest.raises(UnsafeManifestError):
        Manifest.from_bytes(_manifest(tensors=(_raw_tensor(name),)).to_bytes(), version=3)


@pytest.mark.parametrize("name", ["model.layers.0.weight", "é" * 512, "名前", "a b", "\u2028sep", "x" * 1024])
def test_tensor_names_the_rule_allows(name):
    # isprintable() refused some of these before (a space-like separator, non-Latin scripts are fine)
    assert tensor_name_problem(name) is None
    manifest = _manifest(tensors=(_raw_tensor(name),))
    assert Manifest.from_bytes(manifest.to_bytes(), version=3).tensors[0].name == name


def _raw_tensor(name: str) -> TensorEntry:
    data = b"\0" * 16
    return TensorEntry(name, "BF16", (2, 4), content_hash(data), "raw", "a.safetensors", 8, 16, content_hash(data))


def test_shapes_have_at_most_16_dimensions():
    ok = TensorEntry("w", "U8", (1,) * MAX_SHAPE_DIMS, content_hash(b"\0"), "raw", "a.safetensors", 8, 1,
                     content_hash(b"\0"))
    assert Manifest.from_bytes(_manifest(tensors=(ok,)).to_bytes(), version=3).tensors[0].shape == ok.shape
    bad = TensorEntry("w", "U8", (1,) * (MAX_SHAPE_DIMS + 1), ok.hash, "raw", "a.safetensors", 8, 1, ok.hash)
    with pytest.raises(UnsafeManifestError, match="invalid shape"):
        Manifest.from_bytes(_manifest(tensors=(bad,)).to_bytes(), version=3)


@pytest.mark.parametrize("name", ["model.safetensors", "Model-00001-of-00002.SAFETENSORS", "pytorch_model.bin",
                                  "model.safetensors.index.json", "ckptstream.json", "x.pt", "w.gguf"])
def test_reserved_asset_names_are_refused(name):
    info = StreamInfo("s", "2026-01-01T00:00:00Z", (FileEntry(name, 1, content_hash(b"x")),))
    with pytest.raises(ValueError, match="reserved"):
        info.to_bytes()
    raw = StreamInfo("s", "2026-01-01T00:00:00Z", (FileEntry("config.json", 1, content_hash(b"x")),)).to_bytes()
    with pytest.raises(UnsafeManifestError, match="reserved") as exc:
        StreamInfo.from_bytes(raw.replace(b'"config.json"', json.dumps(name).encode()))
    assert exc.value.file == "stream.json"


def test_a_missing_tensor_is_a_tensor_not_found_error():
    with pytest.raises(TensorNotFoundError, match="version 3, tensor nope: this version has no such tensor") as exc:
        _manifest().tensor("nope")
    assert isinstance(exc.value, KeyError) and exc.value.exit_code == EXIT_NOT_FOUND


def test_a_dense_chunk_cannot_claim_more_than_a_zstd_frame_holds():
    def delta(raw: int, stored: int) -> Manifest:
        entry = TensorEntry("w", "U8", (raw,), content_hash(b""), "zstd", "d.zst", 0, stored, content_hash(b""),
                            chunks=((raw, stored, "dense"),))
        return _manifest(version=4, kind="delta", base_version=3, keyframe_version=3, chain_length=1,
                         files=(FileEntry("d.zst", stored, content_hash(b"")),), tensors=(entry,))

    assert Manifest.from_bytes(delta(32768 * 100, 100).to_bytes(), version=4).tensors[0].nbytes == 32768 * 100
    with pytest.raises(UnsafeManifestError, match="cannot be stored in a zstd frame of 100") as info:
        Manifest.from_bytes(delta(1 << 30, 100).to_bytes(), version=4)  # before: a 1 GiB buffer, then an error
    assert info.value.tensor == "w"


def test_a_change_check_round_trips_and_one_of_an_unknown_version_is_kept_unread():
    def delta(check: object) -> bytes:
        entry = TensorEntry("w", "BF16", (8,), content_hash(b""), "xor-zstd", "d.zst", 0, 9, content_hash(b""),
                            chunks=((16, 9, "sparse"),), changed=2)
        raw = _manifest(version=4, kind="delta", base_version=3, keyframe_version=3, chain_length=1,
                        files=(FileEntry("d.zst", 9, content_hash(b"")),), tensors=(entry,)).to_json()
        raw["tensors"][0]["check"] = check
        raw["manifest_hash"] = "xxh3-128:" + "0" * 32
        return Manifest.from_bytes(reseal(json.dumps(raw, indent=1).encode()), version=4)

    check = ChangeCheck(2, (1 << 64) - 1, 5)
    assert delta(check.to_json()).tensors[0].check == check
    assert check.to_json() == {"version": 1, "count": 2, "old": "ffffffffffffffff", "new": "0000000000000005"}
    assert check + ChangeCheck(1, 2, 3) == ChangeCheck(3, 1, 8)  # sums mod 2^64
    later = delta({"version": 2, "anything": [1]}).tensors[0].check
    assert not later.known  # kept, unread: a reader needing it builds its change another way
    for bad in ({"version": 1, "count": 2, "old": "0" * 15, "new": "0" * 16}, {"count": 2}, "0" * 16,
                {"version": 1, "count": -1, "old": "0" * 16, "new": "0" * 16}, None,
                {"version": 1, "count": 9, "old": "0" * 16, "new": "0" * 16},  # more than the tensor's 8 elements
                {"version": 1, "count": 3, "old": "0" * 16, "new": "0" * 16}):  # not its 'changed' (2)
        with pytest.raises(UnsafeManifestError):
            delta(bad)
    # (golden terms, for other implementations: position 0 with bits 0; position 1 with the bits of bf16 1.0)
    assert (check_element(0, 0), check_element(1, 0x3F80)) == (0x48218226FF3CD4BF, 0x424C7253238919CC)


# ------------------------------------------------------------------------------------------- stream kinds

ADAPTER = AdapterInfo(base_name="Qwen/Qwen3-8B", base_hash=content_hash(b"base"), rank=16,
                      target_modules=("q_proj", "v_proj"))
CONFIG_ASSET = FileEntry(ADAPTER_CONFIG_FILE, 2, content_hash(b"{}"))


def _adapter_stream(**changes) -> StreamInfo:
    fields = dict(stream_id="s", created="2026-01-01T00:00:00Z", assets=(CONFIG_ASSET,), kind=STREAM_KIND_ADAPTER,
                  adapter=ADAPTER)
    fields.update(changes)
    return StreamInfo(**fields)


def test_a_weights_stream_json_is_written_as_before_kinds_existed():
    golden = (Path(__file__).parent / "data" / "golden-stream" / STREAM_FILE).read_bytes()
    info = StreamInfo.from_bytes(golden)  # written without a kind: a weights stream
    assert (info.kind, info.adapter, info.format_version) == (STREAM_KIND_WEIGHTS, None, 1)
    assert info.to_bytes() == golden
    assert b'"kind"' not in StreamInfo("s", "2026-01-01T00:00:00Z").to_bytes()
    explicit = json.loads(golden)
    explicit["kind"] = "weights"
    assert StreamInfo.from_bytes(json.dumps(explicit).encode()) == info


def test_an_adapter_stream_json_round_trips_at_format_version_2():
    info = _adapter_stream()
    raw = info.to_bytes()
    body = json.loads(raw)
    assert (body["format_version"], body["kind"]) == (ADAPTER_FORMAT_VERSION, "adapter")
    assert body["adapter"] == {"base": {"name": "Qwen/Qwen3-8B", "hash": ADAPTER.base_hash}, "rank": 16,
                               "target_modules": ["q_proj", "v_proj"]}
    assert StreamInfo.from_bytes(raw) == info
    unknown = _adapter_stream(adapter=dataclasses.replace(ADAPTER, base_hash=None))
    assert json.loads(unknown.to_bytes())["adapter"]["base"] == {"name": "Qwen/Qwen3-8B"}
    assert StreamInfo.from_bytes(unknown.to_bytes()) == unknown


@pytest.mark.parametrize("change, problem", [
    (lambda b: b.update(kind="gguf"), "unknown stream kind 'gguf'"),
    (lambda b: b.pop("adapter"), "only an adapter stream, has an 'adapter' block"),
    (lambda b: b.update(kind="weights"), "only an adapter stream, has an 'adapter' block"),
    (lambda b: b.update(assets=[]), "lacks the asset adapter_config.json"),
    (lambda b: b.update(format_version=1), "needs format version 2"),
    (lambda b: b["adapter"].update(rank=0), "rank 0 is not an integer in \\[1, 65536\\]"),
    (lambda b: b["adapter"].update(target_modules=["q_proj", "q_proj"]), "listed twice"),
    (lambda b: b["adapter"]["base"].update(name=""), "base model name"),
    (lambda b: b["adapter"]["base"].update(hash="md5:x"), "is not an xxh3-128: hash"),
    (lambda b: b["adapter"].pop("base"), "missing field 'base'"),
])
def test_a_stream_json_of_an_unknown_or_incomplete_kind_is_refused(change, problem):
    body = json.loads(_adapter_stream().to_bytes())
    change(body)
    with pytest.raises(UnsafeManifestError, match=problem) as exc:
        StreamInfo.from_bytes(json.dumps(body).encode())
    assert exc.value.file == STREAM_FILE
    with pytest.raises(ValueError, match="lacks the asset"):
        _adapter_stream(assets=()).to_bytes()  # nor does a writer write one


def _pieced_manifest(boxes, *, format_version=PIECES_FORMAT_VERSION, whole_hash=None, **piece_changes) -> Manifest:
    """A keyframe of one F32 [4, 6] tensor stored in the pieces ``boxes`` ((offsets, shape) each), each in a
    file of its own."""
    files, pieces = [], []
    for i, (offsets, shape) in enumerate(boxes):
        size = 4 * math.prod(shape)
        files.append(FileEntry(f"p{i}.safetensors", 8 + size, content_hash(b"x")))
        pieces.append(TensorEntry("w", "F32", shape, content_hash(bytes([i])), "raw", f"p{i}.safetensors", 8, size,
                                  content_hash(bytes([i])), offsets=offsets, **piece_changes))
    pieces_hashes = pieces_hash(p.hash for p in pieces)
    whole = TensorEntry("w", "F32", (4, 6), whole_hash or pieces_hashes, ENCODING_PIECES, pieces=tuple(pieces))
    return _manifest(files=tuple(files), tensors=(whole,), format_version=format_version)


def test_a_tensor_in_pieces_round_trips_at_format_version_3():
    boxes = [((0, 0), (2, 3)), ((0, 3), (2, 3)), ((2, 0), (2, 3)), ((2, 3), (2, 3))]  # a 2 x 2 grid
    manifest = _pieced_manifest(boxes)
    assert manifest_format_version(manifest.tensors) == PIECES_FORMAT_VERSION
    parsed = Manifest.from_bytes(manifest.to_bytes(), version=3)
    assert parsed == manifest and parsed.format_version == 3
    assert [(p.name, p.dtype, p.offsets) for p in parsed.tensor("w").pieces] == [("w", "F32", b) for b, _ in boxes]
    assert b'"offsets"' in manifest.to_bytes() and manifest.to_bytes().count(b'"name"') == len(boxes) + 1


@pytest.mark.parametrize("boxes, problem", [
    ([((0, 0), (2, 6)), ((3, 0), (1, 6))], "consecutive intervals"),       # rows 2 missing
    ([((0, 0), (3, 6)), ((2, 0), (2, 6))], "consecutive intervals"),       # overlapping rows
    ([((0, 0), (2, 6)), ((2, 0), (1, 6))], "do not cover dimension 0"),     # the last row missing
    ([((0, 0), (2, 3)), ((0, 3), (2, 3)), ((2, 0), (2, 3))], "not each cell of one grid"),  # a cell missing
    ([((2, 0), (2, 6)), ((0, 0), (2, 6))], "ascending order"),
    ([((0, 0), (4, 6)), ((0, 0), (4, 6))], "not each cell of one grid"),   # the same piece twice
    ([((0,), (4,))], "dimensions"),
    ([((0, 0), (0, 6)), ((0, 0), (4, 6))], "empty"),
])
def test_pieces_that_do_not_tile_their_tensor_are_refused(boxes, problem):
    with pytest.raises(UnsafeManifestError, match=problem):
        Manifest.from_bytes(_pieced_manifest(boxes).to_bytes(), version=3)


def test_pieces_need_format_version_3_and_their_own_hash():
    boxes = [((0, 0), (2, 6)), ((2, 0), (2, 6))]
    with pytest.raises(UnsafeManifestError, match="encoding 'pieces' is not allowed"):
        Manifest.from_bytes(_pieced_manifest(boxes, format_version=1).to_bytes(), version=3)
    with pytest.raises(UnsafeManifestError, match="hash of its pieces' hashes"):
        Manifest.from_bytes(_pieced_manifest(boxes, whole_hash=content_hash(b"w")).to_bytes(), version=3)
    raw = _pieced_manifest(boxes).to_bytes()
    body = json.loads(raw)
    body["tensors"][0]["pieces"][1]["name"] = "w"  # a piece has its tensor's name, never one of its own
    with pytest.raises(UnsafeManifestError, match="without 'name'"):
        Manifest.from_bytes(_reseal(json.dumps(body, indent=1).encode()), version=3)
    body = json.loads(raw)
    body["tensors"][0]["pieces"][1]["file"] = body["tensors"][0]["pieces"][0]["file"]
    with pytest.raises(UnsafeManifestError, match="two pieces are stored in p0.safetensors"):
        Manifest.from_bytes(_reseal(json.dumps(body, indent=1).encode()), version=3)


def test_join_pieces_joins_each_writers_pieces_in_order():
    manifest = _pieced_manifest([((0, 0), (2, 6)), ((2, 0), (2, 6))])
    whole = manifest.tensors[0]
    parts = [dataclasses.replace(whole, hash="", pieces=(p,)) for p in reversed(whole.pieces)]  # rank 1 first
    assert join_pieces(parts) == [whole]
    with pytest.raises(ValueError, match="dimension 0 into consecutive intervals"):
        join_pieces(parts[:1])  # rank 0's piece missing
    with pytest.raises(ValueError, match="given twice"):
        join_pieces([manifest.tensors[0], _manifest().tensors[0], _manifest().tensors[0]])
