"""Air-gapped bundles: export/import round trips (full and incremental, local and S3 destinations),
determinism, refusal of truncated, tampered, reordered, compressed and malicious bundles (the destination
unchanged: no data file left behind, nothing read past what a member declares or stream.json lists), an
import SIGKILLed part-way and run again, and bounded memory (assets held on disk)."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shlex
import signal
import subprocess
import sys
import tarfile
import time
import tracemalloc
from pathlib import Path
from typing import IO

import pytest
import torch

from ckptstream import Publisher, Stream
from ckptstream.bundle import export_bundle, import_bundle
from ckptstream.cli import main
from ckptstream.errors import (EXIT_CONFLICT, EXIT_INCOMPATIBLE, EXIT_INTEGRITY, EXIT_NOT_FOUND, EXIT_OK,
                               ForeignStreamError, IncompatibleStreamError, IntegrityError, MissingBaseError,
                               VersionConflictError)
from ckptstream.format import (BUNDLE_INDEX_FILE, MANIFESTS_DIR, MAX_ASSET_BYTES, STREAM_FILE, VERSIONS_DIR,
                               BundleIndex, FileEntry, StreamInfo, content_hash, data_path, manifest_path)
from ckptstream.reader import read_leases
from ckptstream.storage import RANGE_CHUNK_BYTES, open_storage
from ckptstream.writer import collect_garbage
from tests.helpers import (HookedStorage, assert_same_tensors, backdate, gc_finishing_before_put, new_bucket,
                           once_before, random_state, reseal)

ASSETS = {"config.json": b'{"model_type": "tiny"}', "tokenizer.json": b'{"vocab": {}}'}


def publish_versions(url: str, count: int, *, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Versions 0..count-1 at ``url``: a keyframe, then deltas (a few elements change per step)."""
    state, states = random_state(seed), []
    with Publisher(url, assets=ASSETS, keyframe_every=10) as publisher:
        for step in range(count):
            if step:
                state["steps"] += 1
                state["layer.0.b"][step] += 1.0
                state["embed.weight"][step, :5] *= 2
            publisher.publish(state, step=step).result()
            states.append({k: v.clone() for k, v in state.items()})
    return states


@pytest.fixture
def source(tmp_path: Path) -> tuple[Stream, list[dict[str, torch.Tensor]]]:
    states = publish_versions(str(tmp_path / "src"), 4)
    return Stream(str(tmp_path / "src")), states


def assert_same_stream(src: Stream, dst_url: str, versions: list[int] | None = None) -> None:
    """DST holds ``versions`` of SRC bit for bit: same stream.json and manifest bytes, verified, same tensors."""
    dst = Stream(dst_url)
    versions = src.versions() if versions is None else versions
    assert dst.versions() == versions
    assert dst.storage.read(STREAM_FILE) == src.storage.read(STREAM_FILE)
    assert dst.info().stream_id == src.info().stream_id
    for version in versions:
        assert dst.storage.read(manifest_path(version)) == src.storage.read(manifest_path(version))
        dst.verify(version)
        assert_same_tensors(dict(dst.iter_tensors(version)), dict(src.iter_tensors(version)))


def members_of(bundle: Path) -> list[tuple[tarfile.TarInfo, bytes]]:
    with tarfile.open(bundle) as tar:
        return [(m, tar.extractfile(m).read() if m.isreg() else b"") for m in tar.getmembers()]


def write_tar(path: Path, members: list[tuple[tarfile.TarInfo, bytes]]) -> Path:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return path


def regular(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def untouched(url: str) -> bool:
    """Nothing visible was created at ``url``: no stream.json, no manifest."""
    storage = open_storage(url)
    return not storage.exists(STREAM_FILE) and not storage.list(MANIFESTS_DIR)


# --------------------------------------------------------------------------------------------- round trips

def test_round_trip_is_bit_exact(source, stream_url, tmp_path):
    """Local source → bundle → a local directory and a bucket on the S3 server: the same stream."""
    src, states = source
    report = export_bundle(src, tmp_path / "full.tar")
    assert report.versions == (0, 1, 2, 3) and report.since is None
    assert (tmp_path / "full.tar").stat().st_size == report.bundle_bytes
    imported = import_bundle(tmp_path / "full.tar", open_storage(stream_url))
    assert imported.versions == (0, 1, 2, 3) and imported.skipped == ()
    assert imported.bytes_written == sum(src.manifest(v).stored_bytes for v in src.versions())
    assert_same_stream(src, stream_url)
    assert_same_tensors(dict(Stream(stream_url).iter_tensors(3)), states[3])
    again = import_bundle(tmp_path / "full.tar", open_storage(stream_url))  # idempotent
    assert again.versions == () and again.skipped == (0, 1, 2, 3) and again.bytes_written == 0


def test_export_from_an_s3_stream(s3_endpoint, tmp_path):
    url = f"s3://{new_bucket(s3_endpoint)}/run"
    publish_versions(url, 2)
    export_bundle(Stream(url), tmp_path / "s3.tar")
    import_bundle(tmp_path / "s3.tar", open_storage(str(tmp_path / "dst")))
    assert_same_stream(Stream(url), str(tmp_path / "dst"))


def test_bundle_layout_and_metadata_are_fixed(source, tmp_path):
    src, _ = source
    export_bundle(src, tmp_path / "a.tar")
    with tarfile.open(tmp_path / "a.tar") as tar:
        members = tar.getmembers()
        index = BundleIndex.from_bytes(tar.extractfile(members[0]).read())
    assert members[0].name == BUNDLE_INDEX_FILE
    assert [m.name for m in members[1:]] == [e.name for e in index.members]
    assert [m.name for m in members[1:4]] == [STREAM_FILE, "assets/config.json", "assets/tokenizer.json"]
    assert members[-1].name == manifest_path(3)
    assert all((m.mtime, m.uid, m.gid, m.uname, m.gname, m.mode, m.type) == (0, 0, 0, "", "", 0o644, tarfile.REGTYPE)
               for m in members)
    assert all(not m.pax_headers for m in members)


def test_same_stream_and_versions_give_the_same_bytes(source, tmp_path):
    src, _ = source
    export_bundle(src, tmp_path / "a.tar", versions=[1, 3])
    export_bundle(Stream(src.url), tmp_path / "b.tar", versions=[1, 3])
    digest = [hashlib.sha256((tmp_path / n).read_bytes()).hexdigest() for n in ("a.tar", "b.tar")]
    assert digest[0] == digest[1]
    sink = io.BytesIO()
    export_bundle(src, sink, versions=[1, 3])  # a file object (a pipe) gets the same bytes
    assert hashlib.sha256(sink.getvalue()).hexdigest() == digest[0]


def test_versions_bring_their_bases(source, tmp_path):
    src, _ = source
    report = export_bundle(src, tmp_path / "v2.tar", versions=[2])
    assert report.versions == (0, 1, 2)  # the chain down to the keyframe
    import_bundle(tmp_path / "v2.tar", open_storage(str(tmp_path / "dst")))
    assert_same_stream(src, str(tmp_path / "dst"), [0, 1, 2])


def test_incremental_bundle_carries_only_the_new_versions(source, tmp_path):
    src, _ = source
    dst = str(tmp_path / "dst")
    export_bundle(src, tmp_path / "week1.tar", versions=[0, 1])
    import_bundle(tmp_path / "week1.tar", open_storage(dst))
    report = export_bundle(src, tmp_path / "week2.tar", since=1)
    assert report.versions == (2, 3) and report.since == 1
    index = BundleIndex.from_bytes(members_of(tmp_path / "week2.tar")[0][1])
    assert index.requires == tuple((v, index.requires[v][1]) for v in (0, 1))
    data = [m for m in index.members if m.name.startswith("versions/")]
    assert {m.name.split("/")[1] for m in data} == {"000000000002", "000000000003"}
    assert sum(m.size for m in data) == src.manifest(2).stored_bytes + src.manifest(3).stored_bytes
    imported = import_bundle(tmp_path / "week2.tar", open_storage(dst))
    assert imported.versions == (2, 3)
    assert_same_stream(src, dst)


def test_cli_export_and_import_with_json(source, tmp_path, capsys):
    src, _ = source
    dst = str(tmp_path / "dst")
    assert main(["export", src.url, str(tmp_path / "a.tar"), "--versions", "1:2", "--json"]) == 0
    exported = json.loads(capsys.readouterr().out)
    assert exported["versions"] == [0, 1, 2] and exported["bytes"] == (tmp_path / "a.tar").stat().st_size
    assert exported["seconds"] >= 0
    assert main(["import", str(tmp_path / "a.tar"), dst, "--json"]) == 0
    imported = json.loads(capsys.readouterr().out)
    assert imported["versions"] == [0, 1, 2] and imported["skipped"] == [] and imported["bytes"] > 0
    assert main(["export", src.url, str(tmp_path / "b.tar"), "--since", "2"]) == 0
    assert "exported 1 version(s) (3, since 2)" in capsys.readouterr().out
    assert main(["import", str(tmp_path / "b.tar"), dst]) == 0
    assert "imported 1 version(s)" in capsys.readouterr().out
    assert_same_stream(src, dst)
    assert main(["export", src.url, str(tmp_path / "c.tar"), "--since", "3"]) == EXIT_NOT_FOUND
    assert "no version to export after version 3" in capsys.readouterr().err
    assert not (tmp_path / "c.tar").exists()


def test_incremental_bundle_is_refused_where_the_chain_is_missing(source, tmp_path, capsys):
    src, _ = source
    export_bundle(src, tmp_path / "inc.tar", since=2)
    empty = str(tmp_path / "empty")
    with pytest.raises(MissingBaseError, match="version 0") as caught:
        import_bundle(tmp_path / "inc.tar", open_storage(empty))
    assert caught.value.version == 0
    assert untouched(empty) and not os.path.exists(empty)
    assert main(["import", str(tmp_path / "inc.tar"), empty]) == EXIT_NOT_FOUND
    assert "version 0" in capsys.readouterr().err
    partial = str(tmp_path / "partial")  # holds 0 and 1 but not 2, the `since` version
    export_bundle(src, tmp_path / "01.tar", versions=[0, 1])
    import_bundle(tmp_path / "01.tar", open_storage(partial))
    with pytest.raises(MissingBaseError, match="version 2"):
        import_bundle(tmp_path / "inc.tar", open_storage(partial))
    assert Stream(partial).versions() == [0, 1]


def test_a_delta_without_its_base_is_refused(bundle, tmp_path):
    """A bundle made by hand that carries delta 3 alone: committing it would leave an undecodable version."""
    good = members_of(bundle)
    index = BundleIndex.from_bytes(good[0][1])
    kept = [(m, d) for m, d in good[1:] if not m.name.startswith(("versions/", "manifests/"))
            or "000000000003" in m.name]
    alone = BundleIndex(stream_id=index.stream_id, versions=(3,),
                        members=tuple(e for e in index.members if e.name in {m.name for m, _ in kept}))
    write_tar(tmp_path / "alone.tar", [regular(BUNDLE_INDEX_FILE, alone.to_bytes()), *kept])
    with pytest.raises(MissingBaseError, match="without this base") as caught:
        import_bundle(tmp_path / "alone.tar", open_storage(str(tmp_path / "dst")))
    assert caught.value.version == 2
    assert untouched(str(tmp_path / "dst"))


def test_destination_of_another_stream_is_refused(source, tmp_path, capsys):
    src, _ = source
    export_bundle(src, tmp_path / "full.tar")
    other = str(tmp_path / "other")
    publish_versions(other, 1, seed=1)
    with pytest.raises(ForeignStreamError):
        import_bundle(tmp_path / "full.tar", open_storage(other))
    assert main(["import", str(tmp_path / "full.tar"), other]) == EXIT_CONFLICT
    assert Stream(other).versions() == [0]


def test_destination_with_a_diverged_version_is_refused(source, tmp_path):
    """Same stream_id, another version 1 at DST: a conflict naming the version, nothing committed."""
    src, _ = source
    export_bundle(src, tmp_path / "full.tar")
    diverged = tmp_path / "diverged"
    export_bundle(src, tmp_path / "v0.tar", versions=[0])
    import_bundle(tmp_path / "v0.tar", open_storage(str(diverged)))
    with Publisher(str(diverged), assets=ASSETS) as publisher:  # the same stream_id, another history
        publisher.publish(random_state(7)).result()
    with pytest.raises(VersionConflictError, match="version 1"):
        import_bundle(tmp_path / "full.tar", open_storage(str(diverged)))
    assert Stream(str(diverged)).versions() == [0, 1]


# ------------------------------------------------------------------------------------- refused bundles

@pytest.fixture
def bundle(source, tmp_path) -> Path:
    src, _ = source
    export_bundle(src, tmp_path / "good.tar")
    return tmp_path / "good.tar"


def refused(path: Path, dst: str, *, member: str | None = "any") -> IntegrityError:
    with pytest.raises(IntegrityError) as caught:
        import_bundle(path, open_storage(dst))
    if member != "any":
        assert caught.value.file == member, str(caught.value)
        if member is not None:
            assert member in str(caught.value)
    assert untouched(dst)
    return caught.value


def test_truncated_bundles_are_refused_naming_the_member(bundle, tmp_path):
    raw = bundle.read_bytes()
    with tarfile.open(bundle) as tar:
        members = tar.getmembers()
    data = next(m for m in members if m.name.startswith("versions/"))
    last = members[-1]
    cuts = {
        "inside the index": (members[0].offset_data + 10, BUNDLE_INDEX_FILE),
        "at a header boundary": (data.offset, data.name),
        "inside a header": (data.offset + 100, data.name),
        "inside a data file": (data.offset_data + data.size // 2, data.name),
        "inside the last manifest": (last.offset_data + last.size - 1, last.name),
        "before the end marker": (last.offset_data + (-(-last.size // 512)) * 512, None),
        "inside the end marker": (last.offset_data + (-(-last.size // 512)) * 512 + 700, None),
    }
    for what, (offset, member) in cuts.items():
        cut = tmp_path / "cut.tar"
        cut.write_bytes(raw[:offset])
        error = refused(cut, str(tmp_path / "dst"), member=member)
        assert "truncated" in str(error).partition("nothing was committed")[0], what


def test_a_flipped_byte_is_refused_naming_the_member(bundle, tmp_path):
    raw = bundle.read_bytes()
    with tarfile.open(bundle) as tar:
        members = tar.getmembers()
    data = next(m for m in members if m.name.startswith("versions/"))
    manifest = next(m for m in members if m.name.startswith("manifests/"))
    dst = tmp_path / "dst"
    for member in (data, manifest):
        tampered = bytearray(raw)
        tampered[member.offset_data + member.size // 2] ^= 0x01
        (tmp_path / "bad.tar").write_bytes(tampered)
        error = refused(tmp_path / "bad.tar", str(dst), member=member.name)
        assert "does not match the index" in str(error)
        if member is data:  # the corrupt file never appeared under its name
            assert not (dst / data.name).exists()
    index = members[0]
    for position in range(index.offset_data, index.offset_data + index.size, max(1, index.size // 40)):
        tampered = bytearray(raw)
        tampered[position] ^= 0x01
        (tmp_path / "bad.tar").write_bytes(tampered)
        refused(tmp_path / "bad.tar", str(tmp_path / "dst"))


def test_a_reindexed_forgery_is_refused_and_never_overwrites_a_committed_file(source, bundle, tmp_path):
    """Data changed and the index rehashed to match: the (sealed) manifest disagrees, so nothing is committed,
    and a destination that holds the version keeps its file untouched."""
    src, _ = source
    good = members_of(bundle)
    index = BundleIndex.from_bytes(good[0][1])
    position = next(i for i, (m, _) in enumerate(good) if m.name.startswith("versions/"))
    info, data = good[position]
    forged = bytes([data[0] ^ 0x01]) + data[1:]
    entries = tuple(FileEntry(e.name, e.size, content_hash(forged)) if e.name == info.name else e
                    for e in index.members)
    reindexed = BundleIndex(index.stream_id, index.versions, entries)
    members = [regular(BUNDLE_INDEX_FILE, reindexed.to_bytes()), *good[1:position], regular(info.name, forged),
               *good[position + 1:]]
    write_tar(tmp_path / "forged.tar", members)
    refused(tmp_path / "forged.tar", str(tmp_path / "empty"), member=manifest_path(0))
    dst = str(tmp_path / "dst")
    import_bundle(bundle, open_storage(dst))
    before = (Path(dst) / info.name).stat()
    with pytest.raises(VersionConflictError, match="version 0"):
        import_bundle(tmp_path / "forged.tar", open_storage(dst))
    assert (Path(dst) / info.name).stat().st_ino == before.st_ino
    assert_same_stream(src, dst)


def test_reordered_extra_and_malicious_members_are_refused(bundle, tmp_path):
    good = members_of(bundle)
    names = [m.name for m, _ in good]
    first_data = next(i for i, n in enumerate(names) if n.startswith("versions/"))
    dst = str(tmp_path / "dst")

    swapped = list(good)  # version 0's manifest before its data file
    swapped[first_data], swapped[first_data + 1] = swapped[first_data + 1], swapped[first_data]
    refused(write_tar(tmp_path / "reordered.tar", swapped), dst, member=names[first_data + 1])

    extra_name = data_path(0, "extra.bin")
    extra = good[:first_data + 1] + [regular(extra_name, b"x" * 10)] + good[first_data + 1:]
    refused(write_tar(tmp_path / "extra.tar", extra), dst, member=extra_name)

    trailing = good + [regular(data_path(3, "late.bin"), b"late")]
    error = refused(write_tar(tmp_path / "trailing.tar", trailing), dst)
    assert "late.bin" in str(error)

    missing = good[:first_data] + good[first_data + 1:]
    refused(write_tar(tmp_path / "missing.tar", missing), dst, member=names[first_data + 1])

    link = tarfile.TarInfo(names[first_data])
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
    symlinked = good[:first_data] + [(link, b"")] + good[first_data + 1:]
    refused(write_tar(tmp_path / "symlink.tar", symlinked), dst, member=names[first_data])

    escaping = good[:2] + [regular("../evil", b"evil")] + good[2:]
    refused(write_tar(tmp_path / "dotdot.tar", escaping), dst, member="../evil")
    assert not (tmp_path / "evil").exists()

    no_index = good[1:]
    refused(write_tar(tmp_path / "no-index.tar", no_index), dst, member=STREAM_FILE)

    (tmp_path / "not.tar").write_bytes(b"this is not a tar file" * 100)
    refused(tmp_path / "not.tar", dst, member=BUNDLE_INDEX_FILE)


def test_foreign_and_newer_indexes_are_refused(bundle, tmp_path, capsys):
    good = members_of(bundle)
    dst = str(tmp_path / "dst")
    foreign = [regular(BUNDLE_INDEX_FILE, b'{"format": "something-else", "members": []}')] + good[1:]
    refused(write_tar(tmp_path / "foreign.tar", foreign), dst, member=BUNDLE_INDEX_FILE)
    body = json.loads(good[0][1])
    body["bundle_format_version"] = 2
    newer = [regular(BUNDLE_INDEX_FILE, json.dumps(body).encode())] + good[1:]
    with pytest.raises(IncompatibleStreamError, match="bundle format version 2"):
        import_bundle(write_tar(tmp_path / "newer.tar", newer), open_storage(dst))
    assert main(["import", str(tmp_path / "newer.tar"), dst]) == EXIT_INCOMPATIBLE
    assert "Upgrade ckptstream" in capsys.readouterr().err
    assert untouched(dst)


class Zeros(io.RawIOBase):
    """``size`` zero bytes, read in pieces: a large member of a hostile bundle without holding it."""

    def __init__(self, size: int):
        super().__init__()
        self.left = size

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = min(len(buffer), self.left)
        buffer[:n] = bytes(n)
        self.left -= n
        return n


class Counted(io.RawIOBase):
    """A bundle read through a file object that counts the bytes the importer took from it."""

    def __init__(self, path: Path):
        super().__init__()
        self.file, self.count = open(path, "rb"), 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = self.file.readinto(buffer)
        self.count += n
        return n

    def fileno(self) -> int:
        return self.file.fileno()

    def tell(self) -> int:
        return self.file.tell()

    def close(self) -> None:
        self.file.close()
        super().close()


def add_member(tar: tarfile.TarFile, name: str, source: bytes | IO[bytes], size: int | None = None) -> None:
    """Add a regular member of ``source``'s bytes (or ``size`` bytes read from a file object)."""
    info = tarfile.TarInfo(name)
    info.size = len(source) if isinstance(source, bytes) else size
    tar.addfile(info, io.BytesIO(source) if isinstance(source, bytes) else source)


def stream_members(good: Path) -> list[tuple[tarfile.TarInfo, bytes]]:
    """stream.json and the assets of a bundle (the members before its first version)."""
    return [(m, d) for m, d in members_of(good)[1:] if not m.name.startswith(("versions/", "manifests/"))]


def hostile_version(good: Path, path: Path, *, data_bytes: int, version: int = 0) -> Path:
    """A bundle of the good one's stream.json and assets, then ``version`` with one data file of
    ``data_bytes`` zeros and a manifest that is not one, the index listing every member with its true size
    and hash (as an attacker writes it)."""
    head = stream_members(good)
    data_name = data_path(version, "model-0123456789ab-00001-of-00001.safetensors")
    manifest = b"not a manifest"
    index = BundleIndex(BundleIndex.from_bytes(members_of(good)[0][1]).stream_id, (version,), (
        *(FileEntry(m.name, len(d), content_hash(d)) for m, d in head),
        FileEntry(data_name, data_bytes, content_hash(bytes(data_bytes))),
        FileEntry(manifest_path(version), len(manifest), content_hash(manifest))))
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        add_member(tar, BUNDLE_INDEX_FILE, index.to_bytes())
        for info, data in head:
            add_member(tar, info.name, data)
        add_member(tar, data_name, Zeros(data_bytes), data_bytes)
        add_member(tar, manifest_path(version), manifest)
    return path


def files_under(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (a local stream) with its bytes: what an import may have left there."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_refused_bundle_leaves_the_destination_as_it_was(source, bundle, tmp_path, capsys):
    """An invalid manifest after a data file that verified against the index: refused (exit 3), and the data
    file the import wrote is gone again, at an empty destination and at one holding the stream."""
    src, _ = source
    hostile = hostile_version(bundle, tmp_path / "hostile.tar", data_bytes=4 << 20)
    empty = tmp_path / "empty"
    refused(hostile, str(empty), member=manifest_path(0))
    assert files_under(empty) == {}
    assert main(["import", str(hostile), str(empty)]) == EXIT_INTEGRITY
    assert "the manifest is invalid" in capsys.readouterr().err and files_under(empty) == {}
    held = tmp_path / "held"
    export_bundle(src, tmp_path / "01.tar", versions=[0, 1])
    import_bundle(tmp_path / "01.tar", open_storage(str(held)))
    before = files_under(held)
    hostile = hostile_version(bundle, tmp_path / "hostile2.tar", data_bytes=1 << 20, version=2)
    with pytest.raises(IntegrityError, match="the manifest is invalid"):
        import_bundle(hostile, open_storage(str(held)))
    assert files_under(held) == before


@pytest.mark.parametrize("compression", ["gzip", "bzip2", "xz"])
def test_a_compressed_bundle_is_refused_before_it_is_expanded(bundle, tmp_path, compression, capsys):
    """A bundle is a plain tar (FORMAT.md): a few KB of gzip can stand for any number of bytes. A gzipped
    bundle declaring 64 MiB of zeros is refused at its first bytes, naming the compression; nothing is written."""
    import bz2
    import lzma

    opener = {"gzip": lambda f: gzip.GzipFile(fileobj=f, mode="wb", compresslevel=1),
              "bzip2": lambda f: bz2.BZ2File(f, "wb", compresslevel=1),
              "xz": lambda f: lzma.LZMAFile(f, "wb", preset=0)}[compression]
    plain = hostile_version(bundle, tmp_path / "plain.tar", data_bytes=64 << 20)
    packed = tmp_path / "packed.tar.z"
    with open(plain, "rb") as raw, open(packed, "wb") as out, opener(out) as compressed:
        while chunk := raw.read(1 << 20):
            compressed.write(chunk)
    assert packed.stat().st_size < (1 << 20) < plain.stat().st_size
    dst = tmp_path / "dst"
    counted = Counted(packed)
    with pytest.raises(IntegrityError, match=f"compressed \\({compression}\\)") as caught:
        import_bundle(counted, open_storage(str(dst)))
    assert counted.count <= packed.stat().st_size and "decompress" in str(caught.value).lower()
    assert not dst.exists() or files_under(dst) == {}
    assert main(["import", str(packed), str(dst)]) == EXIT_INTEGRITY
    assert f"compressed ({compression})" in capsys.readouterr().err


def test_a_member_declaring_more_bytes_than_the_bundle_holds_is_refused_at_its_header(bundle, tmp_path):
    """A data member declared at 2^40 bytes in a bundle of a few KB: refused at its header, before any of its
    bytes is read or written."""
    head = stream_members(bundle)
    data_name = data_path(0, "model-0123456789ab-00001-of-00001.safetensors")
    index = BundleIndex(BundleIndex.from_bytes(members_of(bundle)[0][1]).stream_id, (0,), (
        *(FileEntry(m.name, len(d), content_hash(d)) for m, d in head),
        FileEntry(data_name, 1 << 40, content_hash(b"")), FileEntry(manifest_path(0), 2, content_hash(b"{}"))))
    hostile = tmp_path / "tib.tar"
    with open(hostile, "wb") as out:
        with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
            add_member(tar, BUNDLE_INDEX_FILE, index.to_bytes())
            for info, data in head:
                add_member(tar, info.name, data)
            info = tarfile.TarInfo(data_name)
            info.size = 1 << 40
            out.write(info.tobuf(tarfile.PAX_FORMAT, tar.encoding, tar.errors) + bytes(4 << 20))  # then it ends
            tar.closed = True  # no end marker either
    dst = tmp_path / "dst"
    counted = Counted(hostile)
    with pytest.raises(IntegrityError, match="truncated inside this member: it declares 1099511627776 bytes") as caught:
        import_bundle(counted, open_storage(str(dst)))
    assert caught.value.file == data_name and counted.count < 2 << 20 < hostile.stat().st_size
    assert not dst.exists() or files_under(dst) == {}


def test_an_asset_stream_json_does_not_list_is_refused_before_it_is_read(bundle, tmp_path):
    """An asset member of 32 MiB that stream.json does not list (it would be read, held and dropped): refused
    at stream.json, having read little more of the bundle than the index and stream.json."""
    good = members_of(bundle)
    index = BundleIndex.from_bytes(good[0][1])
    extra = FileEntry("assets/zzz-extra.dat", 32 << 20, content_hash(bytes(32 << 20)))
    position = next(i for i, e in enumerate(index.members) if e.name.startswith("versions/"))
    forged = BundleIndex(index.stream_id, index.versions, (*index.members[:position], extra,
                                                            *index.members[position:]))
    path = tmp_path / "extra.tar"
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        add_member(tar, BUNDLE_INDEX_FILE, forged.to_bytes())
        for i, (info, data) in enumerate(good[1:]):
            if i == position:
                add_member(tar, extra.name, Zeros(extra.size), extra.size)
            add_member(tar, info.name, data)
    dst = tmp_path / "dst"
    counted = Counted(path)
    with pytest.raises(IntegrityError, match="not listed in stream.json") as caught:
        import_bundle(counted, open_storage(str(dst)))
    assert caught.value.file == extra.name
    assert counted.count < 4 << 20 < path.stat().st_size
    assert untouched(str(dst))


def test_an_asset_over_the_limit_is_refused_before_it_is_read(source, tmp_path):
    """stream.json listing an asset one byte over MAX_ASSET_BYTES: refused at stream.json, the asset unread."""
    src, _ = source
    body = json.loads(src.storage.read(STREAM_FILE))
    body["assets"].append({"name": "zz-big.dat", "size": MAX_ASSET_BYTES + 1, "hash": content_hash(b"")})
    raw_info = json.dumps(body).encode()
    with pytest.raises(IntegrityError, match="over the"):
        StreamInfo.from_bytes(raw_info)
    manifest = src.storage.read(manifest_path(0))
    data = {f.name: src.storage.read(data_path(0, f.name)) for f in src.manifest(0).files}
    index = BundleIndex(src.info().stream_id, (0,), (
        FileEntry(STREAM_FILE, len(raw_info), content_hash(raw_info)),
        *(FileEntry(f"assets/{a['name']}", a["size"], a["hash"]) for a in body["assets"]),
        *(FileEntry(data_path(0, n), len(d), content_hash(d)) for n, d in sorted(data.items())),
        FileEntry(manifest_path(0), len(manifest), content_hash(manifest))))
    path = tmp_path / "big-asset.tar"
    with open(path, "wb") as out:
        with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
            add_member(tar, BUNDLE_INDEX_FILE, index.to_bytes())
            add_member(tar, STREAM_FILE, raw_info)
            for asset in body["assets"][:-1]:
                add_member(tar, f"assets/{asset['name']}", src.storage.read(f"assets/{asset['name']}"))
            info = tarfile.TarInfo("assets/zz-big.dat")
            info.size = MAX_ASSET_BYTES + 1
            out.write(info.tobuf(tarfile.PAX_FORMAT, tar.encoding, tar.errors))  # its bytes never come
            tar.closed = True
    error = refused(path, str(tmp_path / "dst"), member=STREAM_FILE)
    assert "zz-big.dat" in str(error)


def test_assets_are_held_on_disk_not_in_memory(tmp_path):
    """Eight assets of 8 MiB: the import's memory peak stays well under their total (they wait for the commit
    in a local temporary file, not in memory)."""
    assets = {f"asset-{i}.dat": os.urandom(8 << 20) for i in range(8)}
    with Publisher(str(tmp_path / "src"), assets=assets) as publisher:
        publisher.publish(random_state(0)).result()
    total = sum(len(a) for a in assets.values())
    del assets
    export_bundle(Stream(str(tmp_path / "src")), tmp_path / "assets.tar")
    tracemalloc.start()
    try:
        import_bundle(tmp_path / "assets.tar", open_storage(str(tmp_path / "dst")))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    print(f"tracemalloc peak importing {total} B of assets: {peak} B")
    assert peak < total / 3, peak
    assert_same_stream(Stream(str(tmp_path / "src")), str(tmp_path / "dst"))


def test_import_cli_reports_a_tampered_bundle_with_exit_3(bundle, tmp_path, capsys):
    raw = bytearray(bundle.read_bytes())
    with tarfile.open(bundle) as tar:
        data = next(m for m in tar.getmembers() if m.name.startswith("versions/"))
    raw[data.offset_data] ^= 0xFF
    (tmp_path / "bad.tar").write_bytes(raw)
    assert main(["import", str(tmp_path / "bad.tar"), str(tmp_path / "dst")]) == EXIT_INTEGRITY
    err = capsys.readouterr().err
    assert err.startswith("Error: ") and data.name in err and "nothing was committed" in err


def test_export_of_a_corrupt_source_leaves_no_bundle(source, tmp_path, capsys):
    src, _ = source
    entry = src.manifest(2).files[0]
    path = tmp_path / "src" / data_path(2, entry.name)
    corrupt = bytearray(path.read_bytes())
    corrupt[len(corrupt) // 2] ^= 0x01
    path.write_bytes(corrupt)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(IntegrityError, match=entry.name) as caught:
        export_bundle(src, out / "b.tar")
    assert caught.value.version == 2
    assert list(out.iterdir()) == []  # neither the bundle nor its temporary file
    assert main(["export", src.url, str(out / "b.tar")]) == EXIT_INTEGRITY
    assert entry.name in capsys.readouterr().err and list(out.iterdir()) == []


def with_chain_length(bundle: Path, path: Path, version: int, chain_length: int) -> Path:
    """The bundle with ``version``'s manifest claiming ``chain_length``, resealed and reindexed (as a forger
    who knows the format writes it): every seal and hash holds, only the chain contradicts its base."""
    good = members_of(bundle)
    name = manifest_path(version)
    raw = next(d for m, d in good if m.name == name)
    body = json.loads(raw)
    forged = reseal(raw.replace(f'"chain_length": {body["chain_length"]},'.encode(),
                                f'"chain_length": {chain_length},'.encode()))
    assert forged != raw and json.loads(forged)["chain_length"] == chain_length
    index = BundleIndex.from_bytes(good[0][1])
    entries = tuple(FileEntry(e.name, len(forged), content_hash(forged)) if e.name == name else e
                    for e in index.members)
    reindexed = BundleIndex(index.stream_id, index.versions, entries, index.since, index.requires)
    return write_tar(path, [regular(BUNDLE_INDEX_FILE, reindexed.to_bytes()),
                            *[regular(m.name, forged) if m.name == name else (m, d) for m, d in good[1:]]])


def test_a_delta_whose_chain_contradicts_its_base_is_refused(source, tmp_path, capsys):
    """Delta 1 resealed with chain_length 7 on keyframe 0 (chain 0): refused before anything is committed
    (exit 3, naming version 1), whether its base comes in the bundle or is at the destination already."""
    src, _ = source
    export_bundle(src, tmp_path / "01.tar", versions=[0, 1])
    forged = with_chain_length(tmp_path / "01.tar", tmp_path / "forged.tar", 1, 7)
    dst = tmp_path / "dst"
    error = refused(forged, str(dst), member=manifest_path(1))
    assert error.version == 1 and "chain length 7" in str(error)
    assert not dst.exists() or files_under(dst) == {}
    assert main(["import", str(forged), str(dst)]) == EXIT_INTEGRITY
    assert "version 1" in capsys.readouterr().err
    export_bundle(src, tmp_path / "0.tar", versions=[0])  # the base at the destination, the delta in a bundle
    import_bundle(tmp_path / "0.tar", open_storage(str(dst)))
    before = files_under(dst)
    export_bundle(src, tmp_path / "since0.tar", since=0, versions=[1])
    incremental = with_chain_length(tmp_path / "since0.tar", tmp_path / "forged-since0.tar", 1, 7)
    with pytest.raises(IntegrityError, match="chain length 7") as caught:
        import_bundle(incremental, open_storage(str(dst)))
    assert caught.value.version == 1 and files_under(dst) == before
    assert Stream(str(dst)).versions() == [0]


# ------------------------------------------------------------------------------- pipes, kills, memory

def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "ckptstream.cli", *args]


def test_export_to_stdout_piped_into_import_from_stdin(source, tmp_path):
    """`ckptstream export URL - | ckptstream import - DST`, both running at once: the bundle alone on the
    pipe (the same bytes as a file export), the export's result on stderr."""
    src, _ = source
    export_bundle(src, tmp_path / "file.tar")
    dst = tmp_path / "dst"
    command = (f"{shlex.join(cli('export', src.url, '-', '--json'))} 2>{tmp_path / 'export.err'} "
               f"| tee {tmp_path / 'piped.tar'} | {shlex.join(cli('import', '-', str(dst), '--json'))}")
    piped = subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True)
    assert piped.returncode == 0, piped.stderr
    assert (tmp_path / "piped.tar").read_bytes() == (tmp_path / "file.tar").read_bytes()
    assert '"bundle_bytes"' in (tmp_path / "export.err").read_text()
    assert json.loads(piped.stdout)["versions"] == [0, 1, 2, 3]
    assert_same_stream(src, str(dst))


def test_import_killed_part_way_completes_when_run_again(source, tmp_path):
    """An import reading a slow pipe is SIGKILLed after some data files landed: nothing is visible at DST;
    run again, it keeps those files, commits everything, and DST is bit-exact."""
    src, _ = source
    bundle = tmp_path / "full.tar"
    export_bundle(src, bundle)
    raw = bundle.read_bytes()
    with tarfile.open(bundle) as tar:
        members = tar.getmembers()
    landed = [m for m in members if m.name.startswith("versions/")][:2]
    prefix = landed[-1].offset_data + landed[-1].size + 1  # the second data file read whole, then a pause
    dst = tmp_path / "dst"
    with open(tmp_path / "stderr", "wb") as stderr:
        process = subprocess.Popen(cli("import", "-", str(dst)), stdin=subprocess.PIPE, stderr=stderr)
    try:
        process.stdin.write(raw[:prefix])
        process.stdin.flush()
        deadline = time.monotonic() + 30
        while not all((dst / m.name).exists() for m in landed):
            assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "stderr").read_text()
            time.sleep(0.05)
        assert untouched(str(dst))  # data files only: invisible without their manifests
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    assert untouched(str(dst))
    report = import_bundle(bundle, open_storage(str(dst)))
    assert report.versions == (0, 1, 2, 3)
    total = sum(src.manifest(v).stored_bytes for v in src.versions())
    assert report.bytes_written == total - sum(m.size for m in landed)  # the landed files were kept
    assert_same_stream(src, str(dst))


def test_memory_stays_bounded_for_a_file_much_larger_than_a_chunk(tmp_path):
    size = 8 * RANGE_CHUNK_BYTES  # one data file of 64 MiB
    big = {"big.weight": torch.randn(size // 4, generator=torch.Generator().manual_seed(0))}
    with Publisher(str(tmp_path / "src")) as publisher:
        publisher.publish(big).result()
    src = Stream(str(tmp_path / "src"))
    assert src.manifest(0).files[0].size > size
    del big
    tracemalloc.start()
    try:
        export_bundle(src, tmp_path / "big.tar")
        _, export_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        import_bundle(tmp_path / "big.tar", open_storage(str(tmp_path / "dst")))
        _, import_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    print(f"tracemalloc peaks for a {size} B file: export {export_peak} B, import {import_peak} B")
    assert export_peak < size / 3 and import_peak < size / 3, (export_peak, import_peak)
    Stream(str(tmp_path / "dst")).verify(0)


# --------------------------------------------------------------------------- gc at the destination

@pytest.mark.parametrize("at", [0, 3])
def test_gc_just_before_a_commit_keeps_what_the_import_wrote(bundle, tmp_path, at):
    """gc at the destination without grace, run for real at the moment the import commits version ``at``
    (the import's storage calls it just before that manifest's put): the import holds a lease there on every
    version it carries, so gc keeps their data, and every version imported verifies."""
    dst = str(tmp_path / "dst")
    reports = []
    collect = lambda: reports.append(collect_garbage(Stream(dst), keep_last=1, grace_seconds=0))  # noqa: E731
    imported = import_bundle(bundle, HookedStorage(open_storage(dst), once_before("put", manifest_path(at), collect)))
    assert reports and imported.versions == (0, 1, 2, 3)
    assert not [path for path in reports[0].debris if path.startswith(VERSIONS_DIR)]
    assert main(["verify", dst]) == EXIT_OK
    assert read_leases(open_storage(dst)).records == []  # released at the end


def test_a_resumed_import_refreshes_the_files_it_reuses(bundle, tmp_path):
    """Run again after an interruption hours ago, the import reuses the data files it wrote then. A gc that
    read the leases before the import began and reaches those files while the import commits keeps them:
    reused, they count as written now (their modification time is refreshed)."""
    dst = tmp_path / "dst"
    import_bundle(bundle, open_storage(str(dst)))
    for version in (2, 3):  # as if killed before these two commits
        (dst / manifest_path(version)).unlink()
    backdate(dst / VERSIONS_DIR, 7200)
    hooked, reports = gc_finishing_before_put(str(dst), manifest_path(2))
    again = import_bundle(bundle, hooked)
    assert reports and not [path for path in reports[0].debris if path.startswith(VERSIONS_DIR)]
    assert again.versions == (2, 3) and again.bytes_written == 0
    assert main(["verify", str(dst)]) == EXIT_OK


def test_help_has_examples_and_imports_no_torch():
    check = ("import contextlib, io, sys\n"
             "from ckptstream.cli import main\n"
             "for command in ('export', 'import'):\n"
             "    with contextlib.redirect_stdout(io.StringIO()) as out:\n"
             "        assert main([command, '--help']) == 0\n"
             "    assert 'examples:' in out.getvalue() and 'exit codes:' in out.getvalue(), command\n"
             "assert 'torch' not in sys.modules, 'torch imported'\n")
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_export_holds_a_lease_on_what_it_carries(source, tmp_path):
    """While the bundle is written, gc sees a live lease on the newest carried version (and so keeps its
    chain); none is left afterwards."""
    src, _ = source
    seen: list[set[int]] = []
    export_bundle(src, tmp_path / "b.tar", versions=[2],
                  progress=lambda n: seen.append(read_leases(src.storage).live_versions()))
    assert seen and all(live == {2} for live in seen)
    assert read_leases(src.storage).live_versions() == set()
