"""gc honours leases (FORMAT.md "Leases", G1-G4): a leased version and its chain stay; expired and
malformed leases protect nothing; a lease written while gc runs, before it deletes a manifest, is
honoured (the race between discovery and fetch, driven step by step); local and S3 (moto)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from ckptstream import Publisher, Stream
from ckptstream.cli import main
from ckptstream.errors import CkptStreamError, VersionNotFoundError
from ckptstream.format import LEASES_DIR, MANIFESTS_DIR, manifest_path
from ckptstream.reader.leases import LeaseRecord, hold_lease
from ckptstream.storage import open_storage
from ckptstream.testing.models import rl_like_step
from ckptstream.writer import collect_garbage
from tests.helpers import HookedStorage, assert_same_tensors, random_state


@pytest.fixture
def five_versions(stream_url):
    """Keyframe 0, deltas 1 and 2 (chain 0-1-2), keyframe 3, delta 4 (chain 3-4)."""
    state = random_state(0)
    states = []
    with Publisher(stream_url, keyframe_every=3) as publisher:
        for _ in range(5):
            states.append({k: v.clone() for k, v in state.items()})
            publisher.publish(state).result()
            rl_like_step(state, fraction=0.02)
    stream = Stream(stream_url)
    assert [stream.manifest(v).kind for v in range(5)] == ["keyframe", "delta", "delta", "keyframe", "delta"]
    return stream_url, states


def _put_lease(storage, version: int, *, expires_in: float, name: str) -> None:
    now = time.time()
    storage.put(f"{LEASES_DIR}/{name}.json", LeaseRecord("test", version, now, now + expires_in).to_bytes())


def test_a_leased_version_and_its_chain_are_kept(five_versions):
    url, states = five_versions
    stream = Stream(url)
    with stream.lease(1, holder="materialize"):
        report = collect_garbage(Stream(url), keep_last=1, grace_seconds=0)
        assert report.kept_for_leases == [0, 1] and report.kept == [0, 1, 3, 4]
        assert report.deleted_versions == [2]
        assert_same_tensors(dict(stream.iter_tensors(1)), states[1])
    report = collect_garbage(Stream(url), keep_last=1, grace_seconds=0)
    assert report.deleted_versions == [0, 1] and report.kept_for_leases == []
    assert Stream(url).versions() == [3, 4]


def test_expired_and_malformed_leases_protect_nothing(five_versions):
    url, _ = five_versions
    storage = open_storage(url)
    _put_lease(storage, 0, expires_in=-60, name="000000000000-expired")  # past the clock-skew margin
    _put_lease(storage, 1, expires_in=-1, name="000000000001-within-skew")  # within it: still live
    storage.put(f"{LEASES_DIR}/000000000002-garbage.json", b'{"holder": "x", "version": 2')
    dry = collect_garbage(Stream(url), keep_last=1, grace_seconds=3600, dry_run=True)
    assert dry.kept_for_leases == [0, 1] and dry.deleted_versions == [2]
    report = collect_garbage(Stream(url), keep_last=1, grace_seconds=0)
    assert report.deleted_versions == [2] and report.kept_for_leases == [0, 1]
    # Debris: the record expired longer ago than the grace period and the malformed one (the live one stays).
    assert sorted(p for p in report.debris if p.startswith(LEASES_DIR)) == [
        f"{LEASES_DIR}/000000000000-expired.json", f"{LEASES_DIR}/000000000002-garbage.json"]
    assert [e.name for e in storage.list(LEASES_DIR)] == ["000000000001-within-skew.json"]


@pytest.mark.timeout(120)  # before the fix, gc blocked for ever opening the FIFO
def test_leases_that_are_not_regular_files_are_malformed_not_read(local_url, capsys):
    """A FIFO (whose open blocks until a writer comes) and a link to /dev/zero (endless) planted in leases/:
    gc reads neither, counts both as malformed (protecting nothing) and removes them as debris."""
    with Publisher(local_url) as publisher:
        for seed in range(2):
            publisher.publish(random_state(seed)).result()
    leases = Path(local_url) / LEASES_DIR
    leases.mkdir()
    os.mkfifo(leases / "000000000000-fifo.json")
    (leases / "000000000000-zero.json").symlink_to("/dev/zero")
    planted = [f"{LEASES_DIR}/000000000000-fifo.json", f"{LEASES_DIR}/000000000000-zero.json"]
    assert main(["gc", local_url, "--keep-last", "1", "--grace", "0", "--dry-run", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["deleted_versions"] == [0] and report["kept_for_leases"] == []
    assert sorted(p for p in report["debris"] if p.startswith(LEASES_DIR)) == planted
    assert main(["gc", local_url, "--keep-last", "1", "--grace", "0"]) == 0
    assert Stream(local_url).versions() == [1] and list(leases.iterdir()) == []
    assert Path("/dev/zero").exists()  # the link was removed, not what it points to


@pytest.mark.parametrize("leased", [1, 2])
def test_a_lease_taken_before_gc_deletes_a_manifest_is_honoured(five_versions, leased):
    url, states = five_versions
    reader = Stream(url)
    before = {v: open_storage(url).read(manifest_path(v)) for v in range(leased + 1)}
    held: list = []

    def reader_steps(operation: str, path: str) -> None:
        # At gc's first manifest delete (after it read the leases, G1), a reader takes its lease and
        # checks the chain (R1, R2): everything still exists, so it goes on to pull.
        if operation == "delete" and path.startswith(MANIFESTS_DIR) and not held:
            lease = reader.lease(leased, holder="follower late")
            held.append((lease, lease.__enter__()))

    gc_stream = Stream(url, storage=HookedStorage(open_storage(url), reader_steps))
    report = collect_garbage(gc_stream, keep_last=1, grace_seconds=0)
    (lease, chain), = held
    try:
        assert [m.version for m in chain] == list(range(leased + 1))
        assert report.kept_for_leases == list(range(leased + 1)) and report.deleted_versions == ([2] if leased == 1
                                                                                                 else [])
        after = Stream(url)  # the manifests are back, byte for byte, and every version of the chain decodes
        assert after.versions() == sorted({*range(leased + 1), 3, 4})
        assert {v: after.storage.read(manifest_path(v)) for v in before} == before
        for v in range(leased + 1):
            assert_same_tensors(dict(after.iter_tensors(v)), states[v])
            after.verify(v)
        assert_same_tensors(dict(reader.iter_tensors(leased)), states[leased])
    finally:
        lease.__exit__(None, None, None)


def test_a_lease_taken_after_gc_deleted_a_manifest_finds_the_version_gone(five_versions):
    url, _ = five_versions
    reader = Stream(url)
    reader.chain(2)  # discovered before gc ran: the manifests are cached
    refused: list[Exception] = []
    deletes: list[str] = []

    def reader_steps(operation: str, path: str) -> None:
        if operation == "delete" and path.startswith(MANIFESTS_DIR):
            deletes.append(path)
            if len(deletes) == 2:  # manifest 0 is gone: the reader's check (R2) must see it
                try:
                    with reader.lease(2, holder="follower late"):
                        pass
                except VersionNotFoundError as exc:
                    refused.append(exc)

    report = collect_garbage(Stream(url, storage=HookedStorage(open_storage(url), reader_steps)), keep_last=1,
                             grace_seconds=0)
    assert len(refused) == 1 and refused[0].version == 0  # the base it needs is gone: MissingBaseError
    assert report.deleted_versions == [0, 1, 2] and report.kept_for_leases == []
    assert Stream(url).versions() == [3, 4] and [e.name for e in open_storage(url).list(LEASES_DIR)] == []


@pytest.mark.parametrize("failing_listing", [1, 2])
def test_leases_gc_cannot_read_stop_it_and_retire_nothing(five_versions, failing_listing):
    """Unknown leases are not "no leases": when gc cannot list them before (G1) or after (G3) it deleted
    manifests, it retires nothing (the manifests it deleted are back) and says why."""
    url, states = five_versions
    listings = []

    def deny(operation: str, path: str) -> None:
        # Tests run as root here, so a real permission error cannot be caused: injected.
        if operation == "list" and path == LEASES_DIR:
            listings.append(path)
            if len(listings) == failing_listing:
                raise PermissionError(13, "Permission denied", path)

    with pytest.raises(CkptStreamError, match="cannot read the stream's leases") as info:
        collect_garbage(Stream(url, storage=HookedStorage(open_storage(url), deny)), keep_last=1, grace_seconds=0)
    assert info.value.file == LEASES_DIR and isinstance(info.value.__cause__, PermissionError)
    after = Stream(url)
    assert after.versions() == [0, 1, 2, 3, 4]
    assert_same_tensors(dict(after.iter_tensors(2)), states[2])


def test_gc_command_reports_the_versions_kept_for_leases(five_versions, capsys):
    url, _ = five_versions
    with hold_lease(open_storage(url), 2, holder="mirror"):
        assert main(["gc", url, "--keep-last", "1", "--dry-run", "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["kept_for_leases"] == [0, 1, 2] and report["deleted_versions"] == []
        assert main(["gc", url, "--keep-last", "1"]) == 0
        out = capsys.readouterr().out
        assert "deleted 0 version(s)" in out
        assert "kept for leases (a reader is pulling them or their chain): 0, 1, 2" in out
    assert Stream(url).versions() == [0, 1, 2, 3, 4]



def test_a_delete_that_fails_half_way_puts_the_deleted_manifests_back(five_versions):
    url, states = five_versions
    deletes = []

    def fail_second(operation: str, path: str) -> None:
        # A storage error in the middle of G2 (a lost connection) cannot be timed for real: injected.
        if operation == "delete" and path.startswith(MANIFESTS_DIR):
            deletes.append(path)
            if len(deletes) == 2:
                raise ConnectionError("connection reset")

    with pytest.raises(ConnectionError):
        collect_garbage(Stream(url, storage=HookedStorage(open_storage(url), fail_second)), keep_last=1,
                        grace_seconds=0)
    after = Stream(url)
    assert after.versions() == [0, 1, 2, 3, 4]
    assert_same_tensors(dict(after.iter_tensors(2)), states[2])
