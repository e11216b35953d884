"""Air-gapped bundles: export/import round trips (full and incremental, local and S3 destinations),
determinism, refusal of truncated, tampered, reordered and malicious bundles (the destination unchanged),
an import SIGKILLed part-way and run again, and bounded memory."""

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

import pytest
import torch

from ckptstream import Publisher, Stream
from ckptstream.bundle import export_bundle, import_bundle
from ckptstream.cli import main
from ckptstream.errors import (EXIT_CONFLICT, EXIT_INCOMPATIBLE, EXIT_INTEGRITY, EXIT_NOT_FOUND, ForeignStreamError,
                               IncompatibleStreamError, IntegrityError, MissingBaseError, VersionConflictError)
from ckptstream.format import (BUNDLE_INDEX_FILE, MANIFESTS_DIR, STREAM_FILE, BundleIndex, FileEntry, content_hash,
                               data_path, manifest_path)
from ckptstream.reader import read_leases
from ckptstream.storage import RANGE_CHUNK_BYTES, open_storage
from tests.helpers import assert_same_tensors, new_bucket, random_state

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


def test_a_compressed_bundle_imports(source, bundle, tmp_path):
    """`gzip run1.tar` on the way: tarfile's stream reader decompresses as it reads."""
    src, _ = source
    (tmp_path / "b.tar.gz").write_bytes(gzip.compress(bundle.read_bytes()))
    import_bundle(tmp_path / "b.tar.gz", open_storage(str(tmp_path / "dst")))
    assert_same_stream(src, str(tmp_path / "dst"))


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
