"""Bad input is refused, naming the version, file and tensor: flipped bytes, truncation, missing files,
unsafe manifests, missing bases."""

from __future__ import annotations

import json

import pytest
import torch
import xxhash

from ckptstream import (IntegrityError, MissingBaseError, Publisher, Stream, UnsafeManifestError,
                        VersionNotFoundError)
from ckptstream.format import Manifest, data_path, manifest_path
from ckptstream.storage import open_storage
from ckptstream.testing.models import rl_like_step
from ckptstream.writer import collect_garbage
from tests.helpers import random_state


@pytest.fixture
def three_versions(stream_url):
    """Versions 0 (keyframe), 1 and 2 (deltas)."""
    state = random_state(0, scale=4)
    with Publisher(stream_url, chunk_bytes=2048) as publisher:
        for step in range(3):
            if step:
                rl_like_step(state, fraction=0.05)
            publisher.publish(state).result()
    return stream_url


def _rewrite(url: str, path: str, change) -> None:
    storage = open_storage(url)
    data = bytearray(storage.read(path))
    storage.delete(path)
    storage.put(path, bytes(change(data)))


def _flip(position_fraction: float):
    def change(data: bytearray) -> bytearray:
        data[int(len(data) * position_fraction)] ^= 0x01
        return data
    return change


def _stored_tensor_at(manifest: Manifest, file: str, fraction: float) -> tuple[int, str]:
    """A byte position inside some tensor's stored range of ``file``, and that tensor."""
    entries = [t for t in manifest.tensors if t.file == file and t.length]
    entry = entries[int(fraction * (len(entries) - 1))]
    return entry.offset + entry.length // 2, entry.name


@pytest.mark.parametrize("version", [0, 1, 2])
def test_flipped_byte_in_a_data_file_is_refused_naming_it(three_versions, version):
    stream = Stream(three_versions)
    manifest = stream.manifest(version)
    file = manifest.files[0].name
    position, tensor = _stored_tensor_at(manifest, file, 0.5)

    def change(data: bytearray) -> bytearray:
        data[position] ^= 0x10
        return data

    _rewrite(three_versions, data_path(version, file), change)
    for action in (lambda s: s.verify(version), lambda s: dict(s.iter_tensors(version)),
                   lambda s: s.read_tensor(version, tensor)):
        with pytest.raises(IntegrityError) as info:
            action(Stream(three_versions))
        assert info.value.version == version and info.value.tensor == tensor
        assert file in str(info.value) and "hash mismatch" in str(info.value)
    if version < 2:  # later versions of the chain are refused too, naming the damaged version
        with pytest.raises(IntegrityError) as info:
            Stream(three_versions).verify(2)
        assert info.value.version == version


def test_flipped_byte_in_a_keyframe_header_is_refused(three_versions):
    file = Stream(three_versions).manifest(0).files[0].name
    _rewrite(three_versions, data_path(0, file), _flip(0.0001))  # inside the safetensors header
    with pytest.raises(IntegrityError, match=f"file versions/000000000000/{file}: data file hash mismatch"):
        Stream(three_versions).verify(0)


@pytest.mark.parametrize("fraction", [0.02, 0.3, 0.6, 0.97])
def test_flipped_byte_in_a_manifest_is_refused(three_versions, fraction):
    _rewrite(three_versions, manifest_path(1), _flip(fraction))
    for action in (lambda s: s.verify(1), lambda s: s.manifest(1), lambda s: dict(s.iter_tensors(2))):
        with pytest.raises(IntegrityError) as info:
            action(Stream(three_versions))
        assert info.value.version == 1 and info.value.file == manifest_path(1)


def test_truncated_and_missing_files_are_refused(three_versions):
    stream = Stream(three_versions)
    delta_file = stream.manifest(1).files[0].name
    _rewrite(three_versions, data_path(1, delta_file), lambda data: data[: len(data) // 2])
    with pytest.raises(IntegrityError, match="truncated"):
        Stream(three_versions).verify(1)
    key_file = stream.manifest(0).files[0].name
    open_storage(three_versions).delete(data_path(0, key_file))
    with pytest.raises(IntegrityError, match="data file is missing") as info:
        Stream(three_versions).read_tensor(0, "embed.weight")
    assert info.value.file == data_path(0, key_file) and info.value.tensor == "embed.weight"
    _rewrite(three_versions, manifest_path(2), lambda data: data[:-40])
    with pytest.raises(IntegrityError, match="seal|hash"):
        Stream(three_versions).manifest(2)


def _forge(url: str, version: int, edit) -> None:
    """Rewrite a manifest with a change and seal it again, as a malicious or buggy writer would."""
    storage = open_storage(url)
    body = json.loads(storage.read(manifest_path(version)))
    edit(body)
    body["manifest_hash"] = "xxh3-128:" + "0" * 32
    raw = json.dumps(body, indent=1).encode()
    start = raw.rfind(b'"manifest_hash": "xxh3-128:') + len(b'"manifest_hash": "xxh3-128:')
    raw = raw[:start] + xxhash.xxh3_128_hexdigest(raw).encode() + raw[start + 32:]
    storage.delete(manifest_path(version))
    storage.put(manifest_path(version), raw)


@pytest.mark.parametrize("bad_name", ["../../stream.json", "/etc/passwd", "sub/dir.bin", "..", ".hidden"])
def test_manifest_naming_a_file_outside_its_version_directory_is_refused(three_versions, bad_name):
    def edit(body):
        body["files"][0]["name"] = bad_name
        for t in body["tensors"]:
            if "file" in t:
                t["file"] = bad_name
    _forge(three_versions, 1, edit)
    with pytest.raises(UnsafeManifestError, match="not a plain name inside the version directory") as info:
        Stream(three_versions).verify(1)
    assert info.value.version == 1


def test_manifest_with_inconsistent_sizes_is_refused(three_versions):
    def edit(body):
        tensor = next(t for t in body["tensors"] if t["encoding"] == "raw")
        tensor["length"] += 8
    _forge(three_versions, 0, edit)
    with pytest.raises(UnsafeManifestError) as info:
        Stream(three_versions).manifest(0)
    assert info.value.tensor is not None


def test_manifest_of_another_stream_is_refused(three_versions, tmp_path):
    other = str(tmp_path / "other")
    with Publisher(other) as publisher:
        publisher.publish(random_state(3)).result()
    storage = open_storage(three_versions)
    storage.delete(manifest_path(2))
    storage.put(manifest_path(2), open_storage(other).read(manifest_path(0)).replace(b'"version": 0', b'"version": 2'))
    with pytest.raises(IntegrityError):
        Stream(three_versions).manifest(2)


def test_missing_base_is_a_clear_error(three_versions):
    open_storage(three_versions).delete(manifest_path(1))
    stream = Stream(three_versions)
    with pytest.raises(MissingBaseError, match="base of a delta is gone") as info:
        dict(stream.iter_tensors(2))
    assert info.value.version == 1
    with pytest.raises(VersionNotFoundError):
        stream.verify(1)


def test_gc_never_leaves_a_delta_without_its_base(three_versions):
    stream = Stream(three_versions)
    report = collect_garbage(stream, keep_last=1, grace_seconds=0)
    assert report.deleted_versions == [] and report.kept == [0, 1, 2]
    want = dict(stream.iter_tensors(2))
    with Publisher(three_versions, keyframe_every=1) as publisher:
        publisher.publish(want).result()  # version 3, a keyframe
    report = collect_garbage(Stream(three_versions), keep_last=1, grace_seconds=0)
    assert report.deleted_versions == [0, 1, 2] and report.kept == [3]
    after = Stream(three_versions)
    assert after.versions() == [3]
    got = dict(after.iter_tensors(3))
    assert all(torch.equal(got[k], want[k]) for k in want)
