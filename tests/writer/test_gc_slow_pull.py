"""gc beside a real, slow puller: a ``ckptstream materialize --bwlimit`` subprocess holds a lease on an old
version, renewed past its TTL, so gc leaves the version intact and the materialize ends bit-exact; a second
one SIGKILLed leaves its lease behind, which protects the version only until it expires. Local and S3
(the child reaches moto through AWS_ENDPOINT_URL)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from ckptstream import Publisher, Stream
from ckptstream.format import LEASE_CLOCK_SKEW_SECONDS
from ckptstream.reader.leases import LeaseRecord, read_leases
from ckptstream.writer import collect_garbage
from tests.helpers import assert_same_tensors, random_state

TTL = 1.0
RATE = 160 << 10  # bytes/s: version 0 (1.6 MB) takes ~10 s, longer than TTL + the clock-skew margin


@pytest.fixture
def two_keyframes(stream_url):
    states = [random_state(0, scale=100), random_state(1, scale=100)]
    with Publisher(stream_url, keyframe_every=1) as publisher:
        for state in states:
            publisher.publish(state).result()
    assert Stream(stream_url).manifest(0).stored_bytes / RATE > TTL + LEASE_CLOCK_SKEW_SECONDS + 2
    return stream_url, states


def _materialize(url: str, out: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ckptstream.cli", "materialize", url, "0", str(out),
                             "--bwlimit", str(RATE), "--lease-ttl", str(TTL), "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _wait_for_lease(stream: Stream, child: subprocess.Popen, timeout: float = 60) -> LeaseRecord:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        records = [r for r in read_leases(stream.storage).records if r.pid == child.pid]
        if records:
            return records[0]
        assert child.poll() is None, child.communicate()
        time.sleep(0.05)
    raise AssertionError("the materialize took no lease")


def test_gc_keeps_a_version_a_slow_materialize_holds_until_its_lease_expires(two_keyframes, tmp_path):
    url, states = two_keyframes
    stream = Stream(url)
    child = _materialize(url, tmp_path / "v0")
    try:
        first = _wait_for_lease(stream, child)
        assert (first.holder, first.version) == ("materialize", 0)
        report = collect_garbage(Stream(url), keep_last=1, grace_seconds=0)
        assert report.kept_for_leases == [0] and report.deleted_versions == []
        # Past the first lease's expiry (and the clock-skew margin), the pull is still going: only the
        # child's renewals keep the version.
        time.sleep(max(0.0, first.expires + LEASE_CLOCK_SKEW_SECONDS + 0.5 - time.time()))
        assert child.poll() is None, "the pull ended too early to show renewal"
        report = collect_garbage(Stream(url), keep_last=1, grace_seconds=0)
        assert report.kept_for_leases == [0] and report.deleted_versions == []
        out, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0, err
    assert_same_tensors(load_file(tmp_path / "v0" / "model.safetensors"), states[0])
    assert read_leases(stream.storage).records == []  # released at the end
    assert Stream(url).versions() == [0, 1]

    killed = _materialize(url, tmp_path / "again")
    try:
        lease = _wait_for_lease(stream, killed)
    finally:
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait(timeout=60)
    (left,) = read_leases(stream.storage).records  # the dead holder's lease stays until it expires
    assert left.path == lease.path
    report = collect_garbage(Stream(url), keep_last=1, grace_seconds=3600)
    if left.is_live():
        assert report.kept_for_leases == [0] and Stream(url).versions() == [0, 1]
    time.sleep(max(0.0, left.expires + LEASE_CLOCK_SKEW_SECONDS + 0.2 - time.time()))
    report = collect_garbage(Stream(url), keep_last=1, grace_seconds=3600)
    assert report.deleted_versions == [0] and report.kept_for_leases == []
    assert Stream(url).versions() == [1]
    # The expired record is debris once older than the grace period.
    report = collect_garbage(Stream(url), keep_last=1, grace_seconds=0)
    assert left.path in report.debris and read_leases(stream.storage).records == []
