"""Leases, the reader's side (FORMAT.md "Leases"): a pull holds a lease for its whole length, renewed past
its TTL, released on success and on error; a retired version is refused after the lease is written; on
read-only storage no lease is taken. Local and S3 (moto)."""

from __future__ import annotations

import json
import time

import pytest
from safetensors.torch import load_file

from ckptstream import Publisher, Stream
from ckptstream.cli import main
from ckptstream.errors import EXIT_USAGE, MissingBaseError, StreamNotFoundError, VersionNotFoundError
from ckptstream.format import (LEASE_CLOCK_SKEW_SECONDS, LEASES_DIR, MAX_LEASE_RECORD_BYTES, MAX_LEASE_TTL,
                               manifest_path)
from ckptstream.reader.leases import LeaseRecord, hold_lease, read_leases
from ckptstream.storage import ReadOnlyStorage, open_storage
from ckptstream.testing.models import rl_like_step
from tests.helpers import HookedStorage, assert_same_tensors, random_state


@pytest.fixture
def two_versions(stream_url):
    """Version 0, a keyframe, and version 1, a delta on it."""
    states = [random_state(0), {k: v.clone() for k, v in random_state(0).items()}]
    rl_like_step(states[1], fraction=0.02)
    with Publisher(stream_url) as publisher:
        for state in states:
            publisher.publish(state).result()
    assert Stream(stream_url).manifest(1).kind == "delta"
    return stream_url, states


def _lease_files(storage) -> list[str]:
    return sorted(e.name for e in storage.list(LEASES_DIR))


def test_a_lease_is_written_checked_and_released(two_versions):
    url, states = two_versions
    stream = Stream(url)
    with stream.lease(1, holder="mirror") as chain:
        assert [m.version for m in chain] == [0, 1]
        (record,) = read_leases(stream.storage).records
        assert (record.holder, record.version) == ("mirror", 1) and record.is_live()
        assert record.expires == pytest.approx(record.heartbeat + stream.lease_ttl)
        assert record.path == f"{LEASES_DIR}/{_lease_files(stream.storage)[0]}"
        raw = json.loads(stream.storage.read(record.path))
        assert set(raw) == {"holder", "version", "heartbeat", "expires", "host", "pid"}
        assert_same_tensors(dict(stream.iter_tensors(1)), states[1])
    assert _lease_files(stream.storage) == []


def test_each_pull_holds_a_lease_while_it_runs(two_versions, tmp_path):
    url, _ = two_versions
    stream = Stream(url)
    seen: list[tuple[str, int]] = []

    def look(_: int) -> None:
        seen.extend((r.holder, r.version) for r in read_leases(stream.storage).records)

    stream.materialize(1, tmp_path / "out", progress=look)
    stream.verify(0, progress=look)
    stream.materialize("latest", tmp_path / "named", progress=look, holder="replay node3")
    assert set(seen) == {("materialize", 1), ("verify", 0), ("replay node3", 1)}
    incoming = tmp_path / "incoming"
    incoming.mkdir()
    storage = HookedStorage(open_storage(url), lambda op, path: look(0) if path.startswith("versions/") else None)
    seen.clear()
    Stream(url, storage=storage).write_into(1, incoming, holder="follower node7-8000")
    assert set(seen) == {("follower node7-8000", 1)}
    assert _lease_files(stream.storage) == []


def test_the_lease_is_released_when_the_pull_fails(two_versions):
    url, _ = two_versions
    stream = Stream(url)
    with pytest.raises(RuntimeError, match="pull failed"), stream.lease(1, holder="materialize"):
        assert len(_lease_files(stream.storage)) == 1
        raise RuntimeError("pull failed")
    assert _lease_files(stream.storage) == []


def test_renewal_keeps_a_long_pull_leased_past_its_ttl(two_versions):
    url, _ = two_versions
    stream = Stream(url, lease_ttl=0.6)
    with stream.lease(0, holder="slow") as _:
        (first,) = read_leases(stream.storage).records
        time.sleep(2.0)  # more than three TTLs: only renewals keep it from expiring
        (later,) = read_leases(stream.storage).records
        assert later.path == first.path and later.heartbeat > first.heartbeat + 1.0
        assert later.expires > time.time()  # not even within the clock-skew margin: truly renewed
    assert _lease_files(stream.storage) == []


def test_a_retired_version_is_refused_after_the_lease_is_written(two_versions):
    url, _ = two_versions
    stream = Stream(url)
    stream.chain(1)  # cached: the check must ask the storage again, after the lease is written
    storage = open_storage(url)
    storage.delete(manifest_path(0))
    with pytest.raises(MissingBaseError) as info, stream.lease(1, holder="follower a"):
        pass
    assert info.value.version == 0
    storage.delete(manifest_path(1))
    with pytest.raises(VersionNotFoundError) as info, stream.lease(1, holder="follower a"):
        pass
    assert info.value.version == 1 and not isinstance(info.value, MissingBaseError)
    assert _lease_files(storage) == []


def test_no_lease_is_written_where_there_is_no_stream(tmp_path):
    with pytest.raises(StreamNotFoundError):
        Stream(str(tmp_path / "typo")).materialize(0, tmp_path / "out")
    assert not (tmp_path / "typo").exists()


def test_read_only_storage_takes_no_lease(two_versions, tmp_path):
    url, states = two_versions
    inner = open_storage(url)
    stream = Stream(url, storage=ReadOnlyStorage(inner))
    seen: list[list[str]] = []
    out = stream.materialize(1, tmp_path / "out", progress=lambda _: seen.append(_lease_files(inner)))
    assert seen and all(s == [] for s in seen)
    assert_same_tensors(load_file(out / "model.safetensors"), states[1])
    with stream.lease(1, holder="x") as chain, hold_lease(stream.storage, 1, holder="x") as held:
        assert held is None and [m.version for m in chain] == [0, 1]


def test_credentials_that_may_only_read_pull_without_a_lease(two_versions, tmp_path, caplog):
    url, states = two_versions

    def deny(operation: str, path: str) -> None:
        # Read-only credentials cannot be made on this S3 server (moto does not enforce IAM), nor a read-only
        # directory for root: the refusal is injected.
        if operation == "put" and path.startswith(LEASES_DIR):
            raise PermissionError(13, "Access Denied", path)

    stream = Stream(url, storage=HookedStorage(open_storage(url), deny))
    out = stream.materialize(1, tmp_path / "out")
    assert_same_tensors(load_file(out / "model.safetensors"), states[1])
    assert "pulling it without one, so gc may retire it" in caplog.text
    assert _lease_files(open_storage(url)) == []


def test_read_leases_skips_malformed_and_keeps_expired_apart(two_versions):
    url, _ = two_versions
    storage = open_storage(url)
    now = time.time()
    expired = LeaseRecord("dead", 0, now - 100, now - 60, "h", 1)
    storage.put(f"{LEASES_DIR}/000000000000-dead.json", expired.to_bytes())
    bad = {"not-json.json": b"{", "list.json": b"[]", "wrong-type.json": b'{"holder": "x", "version": "1", '
           b'"heartbeat": 1, "expires": 2}', "nan.json": b'{"holder": "x", "version": 1, "heartbeat": NaN, '
           b'"expires": 2}', "big.json": b" " * (MAX_LEASE_RECORD_BYTES + 1), "no-suffix": b"{}"}
    for name, raw in bad.items():
        storage.put(f"{LEASES_DIR}/{name}", raw)
    listing = read_leases(storage)
    # Expired by its writer's clock, and once its TTL has passed since it was stored (a minute on).
    assert [r.holder for r in listing.records] == ["dead"] and listing.live_versions(time.time() + 60) == set()
    assert sorted(p.rsplit("/", 1)[1] for p, _ in listing.malformed) == sorted(bad)


def test_a_holder_whose_clock_is_behind_keeps_its_lease_by_the_storage_time(two_versions):
    """A holder 10 minutes slow writes an ``expires`` already past by the collector's clock: the lease lives
    its TTL from when the storage stored the record (its modification time), and no longer."""
    url, _ = two_versions
    storage = open_storage(url)
    slow = time.time() - 600
    storage.put(f"{LEASES_DIR}/000000000001-slow.json", LeaseRecord("slow clock", 1, slow, slow + 120).to_bytes())
    listing = read_leases(storage)
    (record,) = listing.records
    assert record.stored == pytest.approx(time.time(), abs=30) and record.is_live()
    assert listing.live_versions() == {1} and listing.live_versions(time.time() + 60) == {1}
    assert listing.live_versions(time.time() + 120 + LEASE_CLOCK_SKEW_SECONDS + 30) == set()


@pytest.mark.parametrize("heartbeat, expires", [
    (0.0, "1e999"),  # infinity to Python's json: a lease for ever
    ("-1e999", 0.0),
    (0.0, 2 * MAX_LEASE_TTL),  # a TTL of two days
    (10**12, 10**12 + 60),  # a 60 s TTL, but by a clock 30 000 years ahead of the storage's
    (0, 10**400),  # an integer no float can hold
], ids=["infinite-expiry", "infinite-heartbeat", "two-day-ttl", "clock-far-ahead", "huge-integer"])
def test_endless_leases_are_malformed(two_versions, caplog, heartbeat, expires):
    url, _ = two_versions
    storage = open_storage(url)
    now = time.time()
    heartbeat, expires = (now + v if isinstance(v, float) else v for v in (heartbeat, expires))
    raw = f'{{"holder": "x", "version": 1, "heartbeat": {heartbeat}, "expires": {expires}}}'.encode()
    storage.put(f"{LEASES_DIR}/000000000001-endless.json", raw)
    listing = read_leases(storage)
    assert listing.records == [] and [p for p, _ in listing.malformed] == [f"{LEASES_DIR}/000000000001-endless.json"]
    assert listing.live_versions() == set() and "ignoring malformed lease record" in caplog.text


def test_a_holder_cannot_take_a_lease_longer_than_the_maximum(two_versions):
    with pytest.raises(ValueError, match="at most 86400"):
        Stream(two_versions[0], lease_ttl=MAX_LEASE_TTL + 1)
    with pytest.raises(ValueError, match="at most 86400"), hold_lease(open_storage(two_versions[0]), 1, holder="x",
                                                                        ttl=float("inf")):
        pass


def test_the_command_line_refuses_a_lease_longer_than_the_maximum(local_url, tmp_path, capsys):
    assert main(["materialize", local_url, "0", str(tmp_path / "out"), "--lease-ttl", "90000"]) == EXIT_USAGE
    assert "--lease-ttl: a lease's ttl must be positive and at most 86400 seconds" in capsys.readouterr().err


def test_an_unreadable_lease_is_an_error_not_no_lease(two_versions):
    url, _ = two_versions
    inner = open_storage(url)
    with hold_lease(inner, 1, holder="x"):

        def deny(operation: str, path: str) -> None:
            # Tests run as root here, so a real permission error cannot be caused: injected.
            if path.startswith(LEASES_DIR):
                raise PermissionError(13, "Permission denied", path)

        with pytest.raises(PermissionError):
            read_leases(HookedStorage(inner, deny))
