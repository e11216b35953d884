"""The format module: names, seals, schema validation."""

from __future__ import annotations

import pytest

from ckptstream import IncompatibleStreamError, IntegrityError, UnsafeManifestError
from ckptstream.format import (FileEntry, Manifest, TensorEntry, content_hash, is_safe_file_name, manifest_path,
                               parse_version_name, shard_groups, version_name)


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


def test_newer_format_version_is_refused():
    with pytest.raises(IncompatibleStreamError, match="format version 2 is not supported"):
        Manifest.from_bytes(_manifest(format_version=2).to_bytes(), version=3)


def test_shard_groups():
    assert shard_groups([5, 5, 5, 20, 1], 10) == [[0, 1], [2], [3], [4]]
    assert shard_groups([], 10) == []
