"""Crafted streams a reader must refuse with a clear error (version / file / tensor named) instead of a
foreign exception, a crash or a silently wrong result: deep JSON, absurd sizes, assets posing as weights,
keyframe headers that disagree with their manifest, inconsistent chains, damaged base directories, bad
version references."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file

from ckptstream import IntegrityError, Publisher, Stream, UnsafeManifestError
from ckptstream.errors import (EXIT_INTEGRITY, EXIT_NOT_FOUND, EXIT_USAGE, InvalidVersionError,
                               NotADirectoryOutputError, TensorNotFoundError)
from ckptstream.format import (LATEST_HINT_FILE, STREAM_FILE, content_hash, data_path, manifest_path,
                               parse_latest_hint)
from ckptstream.reader import ReplicaRecord, write_replica
from ckptstream.reader import files as files_module
from ckptstream.reader.files import DataFiles
from ckptstream.storage import open_storage
from ckptstream.storage.wrapper import WrapperStorage
from ckptstream.testing.models import rl_like_step
from tests.helpers import random_state

SEAL_KEY = b'"manifest_hash": "xxh3-128:'


@pytest.fixture
def two_versions(stream_url):
    """Version 0 (a keyframe with assets) and 1 (a delta)."""
    return _publish_two_versions(stream_url)


def _publish_two_versions(url: str) -> str:
    state = random_state(0, scale=2)
    with Publisher(url, assets={"config.json": b'{"model_type": "x"}'}, chunk_bytes=2048) as publisher:
        publisher.publish(state).result()
        rl_like_step(state, fraction=0.05)
        publisher.publish(state).result()
    return url


def _replace(url: str, path: str, data: bytes) -> None:
    storage = open_storage(url)
    storage.delete(path)
    storage.put(path, data)


def _reseal(raw: bytes) -> bytes:
    """Seal manifest bytes again, as a writer does (FORMAT.md, "Manifest seal")."""
    start = raw.rfind(SEAL_KEY) + len(SEAL_KEY)
    zeroed = raw[:start] + b"0" * 32 + raw[start + 32:]
    return raw[:start] + content_hash(zeroed)[len("xxh3-128:"):].encode() + raw[start + 32:]


def _forge_raw(url: str, version: int, change: Callable[[bytes], bytes]) -> None:
    """Change a manifest's bytes and seal them again, as a malicious or buggy writer would."""
    raw = open_storage(url).read(manifest_path(version))
    changed = change(raw)
    assert changed != raw
    _replace(url, manifest_path(version), _reseal(changed))


def _forge(url: str, version: int, edit: Callable[[dict], None]) -> None:
    def change(raw: bytes) -> bytes:
        body = json.loads(raw)
        edit(body)
        return json.dumps(body, indent=1).encode()
    _forge_raw(url, version, change)


# ------------------------------------------------------------------------------------------ deep JSON

def test_deeply_nested_stream_file_is_an_integrity_error(two_versions):
    raw = open_storage(two_versions).read(STREAM_FILE)
    deep = b"[" * 5000 + b"]" * 5000
    nested = raw.replace(b'"format": "ckptstream"', b'"x": ' + deep + b', "format": "ckptstream"')
    _replace(two_versions, STREAM_FILE, nested)
    with pytest.raises(IntegrityError, match="nested deeper") as info:
        Stream(two_versions).info()
    assert info.value.file == STREAM_FILE and info.value.exit_code == EXIT_INTEGRITY


@pytest.mark.parametrize("field", ["metadata", "step"])
def test_deeply_nested_manifest_is_an_integrity_error(two_versions, field):
    deep = b'{"a": ' * 2000 + b"1" + b"}" * 2000
    old = b'"metadata": {}' if field == "metadata" else b'"step": null'
    _forge_raw(two_versions, 1, lambda raw: raw.replace(old, b'"' + field.encode() + b'": ' + deep))
    for action in (lambda s: s.manifest(1), lambda s: s.verify(1), lambda s: s.versions() and s.chain(1)):
        with pytest.raises(IntegrityError, match="nested deeper") as info:
            action(Stream(two_versions))
        assert info.value.version == 1 and info.value.file == manifest_path(1)


def test_deep_or_mistyped_replica_records_are_skipped(two_versions):
    storage = open_storage(two_versions)
    write_replica(storage, ReplicaRecord("good", version=1, state="serving", heartbeat=1.0))
    storage.put("replicas/deep.json", b'{"replica_id": "deep", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}")
    storage.put("replicas/typed.json", b'{"replica_id": "typed", "version": "1", "heartbeat": "soon"}')
    storage.put("replicas/nan.json", b'{"replica_id": "nan", "heartbeat": NaN}')
    storage.put("replicas/huge.json", b'{"replica_id": "huge", "host": "' + b"x" * (1 << 20) + b'"}')
    assert [r.replica_id for r in Stream(two_versions).replicas()] == ["good"]


@pytest.mark.timeout(120)  # before the fix, each read below blocked for ever opening its FIFO
def test_small_files_that_are_fifos_are_not_read(local_url):
    """A FIFO opened for reading blocks until a writer comes: planted as a replica record it is skipped (by
    ``replicas`` and ``wait_for_version``), as the latest-version hint it is replaced by the next commit."""
    url = _publish_two_versions(local_url)
    write_replica(open_storage(url), ReplicaRecord("good", version=1, state="serving", heartbeat=time.time()))
    os.mkfifo(Path(url) / "replicas" / "fifo.json")
    assert [r.replica_id for r in Stream(url).replicas()] == ["good"]
    assert [r.replica_id for r in Stream(url).wait_for_version(1, timeout=60)] == ["good"]
    (Path(url) / LATEST_HINT_FILE).unlink()
    os.mkfifo(Path(url) / LATEST_HINT_FILE)
    with Publisher(url, assets={"config.json": b'{"model_type": "x"}'}) as publisher:
        assert publisher.publish(random_state(1, scale=2)).result().version == 2
    assert parse_latest_hint((Path(url) / LATEST_HINT_FILE).read_bytes()) == 2


# ------------------------------------------------------------------------------------------ absurd sizes

def _raw_entry(body: dict) -> dict:
    return next(t for t in body["tensors"] if t["encoding"] == "raw")


def test_declared_file_size_beyond_the_real_one_is_refused_before_reading(two_versions):
    name = None

    def edit(body: dict) -> None:
        nonlocal name
        body["files"][0]["size"] = 2**50
        entry = _raw_entry(body)
        entry["offset"] = 2**49
        name = entry["name"]
    _forge(two_versions, 0, edit)
    for action in (lambda s: s.read_tensor(0, name), lambda s: dict(s.iter_tensors(1)), lambda s: s.verify(0)):
        with pytest.raises(IntegrityError, match=f"manifest says {2**50} \\(truncated\\)") as info:
            action(Stream(two_versions))
        assert info.value.version == 0 and info.value.file.startswith(data_path(0, ""))


def test_huge_tensor_length_is_refused_before_allocating(two_versions, tmp_path):
    name = None

    def edit(body: dict) -> None:
        nonlocal name
        body["files"][0]["size"] = 2**50
        entry = _raw_entry(body)
        entry.update(dtype="U8", shape=[2**46], length=2**46)
        name = entry["name"]
    _forge(two_versions, 0, edit)
    for action in (lambda s: s.read_tensor(0, name), lambda s: s.materialize(0, tmp_path / "m")):
        with pytest.raises(IntegrityError, match="manifest says") as info:
            action(Stream(two_versions))
        assert info.value.version == 0 and info.value.tensor == name
    assert not (tmp_path / "m").exists()


# ------------------------------------------------------------------------------------ assets as weights

@pytest.mark.parametrize("asset", ["model.safetensors", "model.safetensors.index.json", "ckptstream.json"])
def test_an_asset_cannot_replace_the_weights(two_versions, tmp_path, asset):
    storage = open_storage(two_versions)
    forged = {"a": torch.full((4,), 7.0)}
    from safetensors.torch import save

    data = save(forged)
    storage.put(f"assets/{asset}", data)
    info = json.loads(storage.read(STREAM_FILE))
    info["assets"][0].update(name=asset, size=len(data), hash=content_hash(data))  # config.json renamed
    _replace(two_versions, STREAM_FILE, json.dumps(info, indent=1).encode())
    for action in (lambda s: s.materialize(1, tmp_path / "out"), lambda s: s.verify(1), lambda s: s.info()):
        with pytest.raises(UnsafeManifestError, match="reserved") as exc:
            action(Stream(two_versions))
        assert exc.value.file == STREAM_FILE
    assert not (tmp_path / "out").exists()


def test_materialize_never_writes_an_asset_over_a_weight_file(two_versions, tmp_path):
    from ckptstream.reader.materialize import build_directory

    tmp_path = tmp_path / "outputs"
    tmp_path.mkdir()
    stream = Stream(two_versions)
    manifest = stream.manifest(0)

    def decode(sink):
        return (sink(entry, tensor) for entry, (_, tensor) in zip(manifest.tensors, stream.iter_tensors(0)))

    for name in ("model.safetensors", "notes.txt"):  # reserved, and (case below) already written
        assets = [("notes.txt", b"a"), ("notes.txt", b"b")] if name == "notes.txt" else [(name, b"forged")]
        with pytest.raises(UnsafeManifestError, match="would replace"):
            build_directory(tmp_path / name, manifest, decode=decode, assets=assets, marker={"version": 0},
                            overwrite=False, shard_bytes=1 << 30)
        assert not (tmp_path / name).exists()
    assert not list(tmp_path.iterdir())  # no temporary directory left either


# ------------------------------------------------------------------------------ keyframe header vs manifest

def _first_raw(body: dict) -> dict:
    return next(t for t in body["tensors"] if t["encoding"] == "raw" and t["dtype"] == "BF16")


def _retype(body: dict) -> None:
    _first_raw(body)["dtype"] = "F16"


def _reshape(body: dict) -> None:
    entry = _first_raw(body)
    entry["shape"] = [entry["shape"][1], entry["shape"][0]]


def _rename(body: dict) -> None:
    _first_raw(body)["name"] = "renamed.weight"


def _drop(body: dict) -> None:
    body["tensors"].remove(_first_raw(body))


def _duplicate(body: dict) -> None:
    body["tensors"].append({**_first_raw(body), "name": "copy.weight"})


@pytest.mark.parametrize("edit", [_retype, _reshape, _rename, _drop, _duplicate])
def test_keyframe_header_must_match_the_manifest(two_versions, edit):
    stream = Stream(two_versions)
    manifest = stream.manifest(0)
    key_file = manifest.files[0].name
    _forge(two_versions, 0, edit)
    forged = Stream(two_versions).manifest(0)
    with pytest.raises(IntegrityError, match="safetensors header disagrees with the manifest") as info:
        Stream(two_versions).verify(0)
    assert info.value.version == 0 and info.value.file == data_path(0, key_file)
    assert info.value.tensor is not None
    name = forged.tensors[0].name
    for action in (lambda s: s.read_tensor(0, name), lambda s: dict(s.iter_tensors(0))):
        with pytest.raises(IntegrityError, match="safetensors header disagrees"):
            action(Stream(two_versions))


# ------------------------------------------------------------------------------------ chain consistency

@pytest.mark.parametrize("field,value", [("chain_length", 5), ("keyframe_version", 1)])
def test_chain_fields_must_agree_with_the_base(stream_url, field, value):
    state = random_state(1)
    with Publisher(stream_url) as publisher:
        for _ in range(3):
            publisher.publish(state).result()
            rl_like_step(state, fraction=0.05)
    assert Stream(stream_url).manifest(2).kind == "delta"
    _forge(stream_url, 2, lambda body: body.update({field: value}))
    for action in (lambda s: s.chain(2), lambda s: dict(s.iter_tensors(2)), lambda s: s.read_tensor(2, "steps"),
                   lambda s: s.verify(2)):
        with pytest.raises(IntegrityError, match="its base version 1 has keyframe 0 and chain length 1") as info:
            action(Stream(stream_url))
        assert info.value.version == 2 and info.value.file == manifest_path(2)


# ------------------------------------------------------------------------------ malformed sparse chunks

def _sparse_frame(count: int, n_big: int, gaps: bytes, big: list[int], values: bytes) -> bytes:
    """A zstd frame of a hand-made sparse payload (FORMAT.md, "Encodings")."""
    import struct

    import zstandard

    payload = struct.pack("<II", count, n_big) + gaps + struct.pack(f"<{len(big)}I", *big) + values
    return zstandard.ZstdCompressor(write_content_size=True).compress(payload)


@pytest.mark.parametrize("frame, problem", [
    (_sparse_frame(65, 0, bytes(65), [], bytes(130)), "claims 65 changes"),
    (_sparse_frame(1, 0, b"\xff", [], b"\x01\x00"), "escaped gaps do not match"),
    (_sparse_frame(1, 1, b"\xff", [3], b"\x01\x00"), "invalid long gap"),
    (_sparse_frame(1, 0, bytes([64]), [], b"\x01\x00"), "points past the end"),
    (_sparse_frame(1, 0, b"\x00", [], b"\x01"), "size does not match"),
], ids=["count", "escapes", "long-gap", "past-end", "size"])
def test_a_malformed_sparse_chunk_is_an_integrity_error_naming_it(stream_url, tmp_path, frame, problem):
    """A sparse chunk whose payload is malformed, behind a correctly sealed manifest and matching stored
    hashes, is refused by every decode path, naming version, file and tensor."""
    state = {"w": torch.arange(64, dtype=torch.float32).to(torch.bfloat16)}
    with Publisher(stream_url) as publisher:
        publisher.publish(state).result()
        state["w"].view(torch.int16)[5] += 1
        publisher.publish(state).result()
    entry = Stream(stream_url).manifest(1).tensor("w")
    assert [layout for _, _, layout in entry.chunks] == ["sparse"]
    _replace(stream_url, data_path(1, entry.file), frame)

    def edit(body: dict) -> None:
        body["files"] = [{"name": entry.file, "size": len(frame), "hash": content_hash(frame)}]
        (tensor,) = body["tensors"]
        tensor.update(offset=0, length=len(frame), stored_hash=content_hash(frame),
                      chunks=[[entry.nbytes, len(frame), "sparse"]])
    _forge(stream_url, 1, edit)
    stream = Stream(stream_url)
    changes = lambda: list(stream.changes_since(1, 0, lambda *found: found, max_tensor_bytes=1 << 20))  # noqa: E731
    for decode in (lambda: stream.read_tensor(1, "w"), lambda: stream.materialize(1, tmp_path / "out"), changes):
        with pytest.raises(IntegrityError, match=problem) as info:
            decode()
        assert (info.value.version, info.value.file, info.value.tensor) == (1, data_path(1, entry.file), "w")


def test_a_damaged_tensor_among_a_batch_read_as_one_range_is_named(stream_url, monkeypatch):
    """The sparse deltas of consecutive small tensors are read as one range (``DataFiles.read_batch``): each is still
    checked against its own stored hash, and a damaged one is named, not the first of the range."""
    generator = torch.Generator().manual_seed(0)
    state = {f"expert.{i}": torch.randn(256, generator=generator).to(torch.bfloat16) for i in range(3)}
    with Publisher(stream_url) as publisher:
        publisher.publish(state).result()
        for tensor in state.values():
            tensor.view(torch.int16)[7] += 1
        publisher.publish(state).result()
    manifest = Stream(stream_url).manifest(1)
    entries = [manifest.tensor(f"expert.{i}") for i in range(3)]
    assert {e.file for e in entries} == {entries[0].file}
    assert [e.offset for e in entries[1:]] == [e.offset + e.length for e in entries[:-1]]  # back to back
    stream = Stream(stream_url)
    found = {e.name: p.tolist() for e, p, _ in stream.changes_since(1, 0, lambda *f: f, max_tensor_bytes=1 << 20)}
    assert found == {f"expert.{i}": [7] for i in range(3)}
    reads: list[tuple[int, int]] = []  # (offset, bytes) of each read of the data file

    class Counted(WrapperStorage):
        def read_into(self, path: str, offset: int, buffer: memoryview) -> None:
            reads.append((offset, len(buffer)))
            super().read_into(path, offset, buffer)

    files = DataFiles(Counted(open_storage(stream_url)))
    batch = files.read_batch(manifest, entries[::-1])  # (any order: each comes back in its place)
    assert [bytes(b.numpy()) for b in batch] == [bytes(files.read(manifest, e).numpy()) for e in entries[::-1]]
    assert reads[0] == (entries[0].offset, sum(e.length for e in entries))  # one read for the three
    assert len(reads) == 1 + 3
    reads.clear()  # a range is at most RANGE_CHUNK_BYTES (what a later read of each, kept, finds whole)
    monkeypatch.setattr(files_module, "RANGE_CHUNK_BYTES", entries[0].length + entries[1].length)
    files.read_batch(manifest, entries)
    assert reads == [(entries[0].offset, entries[0].length + entries[1].length), (entries[2].offset, entries[2].length)]
    path = data_path(1, entries[1].file)
    data = bytearray(open_storage(stream_url).read(path))
    data[entries[1].offset + entries[1].length - 1] ^= 0xFF
    _replace(stream_url, path, bytes(data))
    with pytest.raises(IntegrityError, match="stored bytes hash mismatch") as info:
        list(Stream(stream_url).changes_since(1, 0, lambda *f: f, max_tensor_bytes=1 << 20))
    assert (info.value.version, info.value.file, info.value.tensor) == (1, path, "expert.1")


# ------------------------------------------------------------------------------------ damaged base copy

@pytest.mark.parametrize("damage", ["truncate", "header"])
def test_damaged_base_directory_is_an_integrity_error_naming_the_file(two_versions, tmp_path, damage):
    stream = Stream(two_versions)
    base = stream.materialize(0, tmp_path / "v0")
    shard = base / "model.safetensors"
    data = bytearray(shard.read_bytes())
    if damage == "truncate":
        del data[len(data) // 2:]
    else:
        data[12] = ord("{") if data[12] != ord("{") else ord("[")  # inside the JSON header
    shard.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="damaged") as info:
        stream.materialize(1, tmp_path / "v1", base_dir=base)
    assert info.value.file == str(shard) and info.value.exit_code == EXIT_INTEGRITY
    assert not (tmp_path / "v1").exists()
    with pytest.raises(IntegrityError):
        stream.check_materialized(base, 0)


@pytest.mark.parametrize("encoding", ["xor-zstd", "unchanged"])
@pytest.mark.parametrize("damage", ["value", "dtype"])
def test_a_differing_base_copy_is_refused_on_every_decode_path(two_versions, tmp_path, damage, encoding):
    """Directory writers read a base copy straight into reused buffers, checked only through the decoded
    tensor's hash; ``iter_tensors`` goes the same way without reuse. Both refuse the same damage with the
    same error, naming the base version and the tensor, and write nothing."""
    from safetensors.torch import save_file

    stream = Stream(two_versions)
    name = next(t.name for t in stream.manifest(1).tensors if t.encoding == encoding)
    base = stream.materialize(0, tmp_path / "v0")
    tensors = load_file(base / "model.safetensors")
    if damage == "value":
        tensors[name] = tensors[name].clone()
        tensors[name].view(torch.uint8).view(-1)[-1] ^= 1
    else:
        tensors[name] = tensors[name].view(torch.uint8)
    save_file(tensors, str(base / "model.safetensors"))
    expected = "base copy differs" if damage == "value" else "base copy has"

    def write_into() -> None:
        (tmp_path / "w").mkdir(exist_ok=True)
        stream.write_into(1, tmp_path / "w", base_dir=base)

    for decode in (lambda: stream.materialize(1, tmp_path / "v1", base_dir=base),
                   write_into, lambda: dict(stream.iter_tensors(1, base_dir=base))):
        with pytest.raises(IntegrityError, match=expected) as info:
            decode()
        assert info.value.version == 0 and info.value.tensor == name
    assert not (tmp_path / "v1").exists()


def test_buffer_pool_reuses_buffers_within_twice_their_size():
    from ckptstream.reader.decode import BufferPool

    pool = BufferPool(max_free_bytes=1 << 20)
    a = pool.take(1000)
    pointer = a.data_ptr()
    pool.give(a.view(torch.int16).view(10, 50))  # a view of it counts as it
    assert pool.take(400).data_ptr() != pointer  # less than half: a fresh buffer
    b = pool.take(600)
    assert b.data_ptr() == pointer and b.numel() == 600
    pool.give(torch.empty(10, dtype=torch.uint8))  # not one of its own: ignored
    pool.give(b)
    big = pool.take(2 << 20)
    pool.give(big)  # more than it keeps free: dropped
    assert pool.take(1000).data_ptr() == pointer


# ------------------------------------------------------------------------------- references and outputs

@pytest.mark.parametrize("ref", ["abc", "-1", -1, "1_0", " 1", "1.0", "", 10**12, True, None])
def test_bad_version_references_are_usage_errors(two_versions, ref):
    with pytest.raises(InvalidVersionError) as info:
        Stream(two_versions).resolve(ref)
    assert isinstance(info.value, ValueError) and info.value.exit_code == EXIT_USAGE
    assert "'latest'" in str(info.value)


def test_resolve_accepts_numbers_and_latest(two_versions):
    stream = Stream(two_versions)
    assert [stream.resolve(r) for r in ("0", 1, "latest", "000000000001")] == [0, 1, 1, 1]
    with pytest.raises(InvalidVersionError):
        stream.manifest(-1)


@pytest.mark.parametrize("overwrite", [False, True])
def test_materialize_onto_a_file_is_refused(two_versions, tmp_path, overwrite):
    tmp_path = tmp_path / "outputs"
    tmp_path.mkdir()
    target = tmp_path / "a-file"
    target.write_bytes(b"keep me")
    with pytest.raises(NotADirectoryOutputError, match="is not a directory") as info:
        Stream(two_versions).materialize(1, target, overwrite=overwrite)
    assert isinstance(info.value, NotADirectoryError) and info.value.exit_code == EXIT_USAGE
    assert target.read_bytes() == b"keep me" and sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_a_missing_tensor_is_a_not_found_error(two_versions):
    stream = Stream(two_versions)
    for action in (lambda: stream.read_tensor(1, "nope"),
                   lambda: dict(stream.iter_tensors(1, names=["nope", "steps"]))):
        with pytest.raises(TensorNotFoundError, match="version 1, tensor nope") as info:
            action()
        assert isinstance(info.value, KeyError) and info.value.exit_code == EXIT_NOT_FOUND
    assert list(dict(stream.iter_tensors(1, names=["steps"]))) == ["steps"]


def test_materialized_output_is_the_published_version(two_versions, tmp_path):
    stream = Stream(two_versions)
    tmp_path = tmp_path / "outputs"
    out = stream.materialize(1, tmp_path / "m")
    want = dict(stream.iter_tensors(1))
    got = load_file(out / "model.safetensors")
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert sorted(p.name for p in out.iterdir()) == ["ckptstream.json", "config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_a_delta_changing_more_than_its_count_says_is_refused_while_streaming(tmp_path, monkeypatch):
    """The decode plans a tensor's memory from its deltas' ``changed`` counts: one that changes more than
    its count says (forged) is refused naming the version and the tensor, not held. (Local storage: only
    there do tensors stream from a stored keyframe.)"""
    from ckptstream.reader import decode

    url = _publish_two_versions(str(tmp_path / "stream"))
    name = None

    def edit(body: dict) -> None:
        nonlocal name
        entry = max((t for t in body["tensors"] if t["encoding"] == "xor-zstd"
                     and all(c[2] == "sparse" for c in t["chunks"])), key=lambda t: t.get("changed") or 0)
        entry["changed"], name = 1, entry["name"]
        if "check" in entry:  # (forged alike: a check counting other than 'changed' is refused on reading)
            entry["check"]["count"] = 1
    _forge(url, 1, edit)
    monkeypatch.setattr(decode, "STREAM_MAX_CHANGES_BYTES", 1000)  # the count fits; the changes do not
    with pytest.raises(IntegrityError, match="more elements than their manifests count") as info:
        Stream(url).materialize(1, tmp_path / "m")
    assert (info.value.version, info.value.tensor) == (1, name)
    assert not (tmp_path / "m").exists()
