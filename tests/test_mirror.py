"""``mirror``: byte-for-byte copies between stores (local ↔ S3 on moto), resumable, refusing what is wrong."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
import threading
import time

import pytest
import torch

from ckptstream.errors import ForeignStreamError, IntegrityError, VersionConflictError
from ckptstream.format import VERSIONS_DIR, data_path, manifest_path, version_dir
from ckptstream.mirror import Mirror, MirrorConfig
from ckptstream.reader import Stream, read_leases
from ckptstream.storage import PosixStorage, open_storage, register_backend
from ckptstream.writer import Publisher, collect_garbage
from tests.helpers import (HookedStorage, assert_same_tensors, backdate, gc_finishing_before_put, new_bucket,
                           once_before, random_state, reseal)

CLI = [sys.executable, "-m", "ckptstream.cli"]


def publish_versions(url: str, count: int, *, keyframe_every: int = 4, start: int = 0, seed: int = 0,
                     scale: int = 8) -> dict[int, dict[str, torch.Tensor]]:
    """Publish ``count`` versions of a drifting state; returns each version's tensors."""
    state = random_state(seed, scale=scale)
    published = {}
    with Publisher(url, keyframe_every=keyframe_every) as publisher:
        for version in range(start, start + count):
            state["layer.0.b"][version % 50] += 1.0
            state["embed.weight"][version % 64, :8] += 0.5
            publisher.publish(state, version=version).result()
            published[version] = {k: v.clone() for k, v in state.items()}
    return published


def stored_files(url: str, options: dict | None = None) -> dict[str, bytes]:
    """Every committed file of a stream (stream.json, assets, manifests, data), by path."""
    stream = Stream(url, storage_options=options)
    files = {"stream.json": stream.storage.read("stream.json")}
    for asset in stream.info().assets:
        files[f"assets/{asset.name}"] = stream.asset(asset)
    for version in stream.versions():
        files[manifest_path(version)] = stream.storage.read(manifest_path(version))
        for entry in stream.manifest(version).files:
            files[data_path(version, entry.name)] = stream.storage.read(data_path(version, entry.name))
    return files


def run_cli(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120, **kwargs)


@pytest.mark.parametrize("direction", ["local-to-s3", "s3-to-local"])
def test_mirror_copies_byte_for_byte_and_moves_only_stored_bytes(direction, s3_endpoint, tmp_path):
    s3_url = f"s3://{new_bucket(s3_endpoint)}/run"
    src, dst = (str(tmp_path / "src"), s3_url) if direction == "local-to-s3" else (s3_url, str(tmp_path / "dst"))
    published = publish_versions(src, 6)
    done = run_cli("mirror", src, dst, "--json")
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [line["version"] for line in lines] == list(range(6))
    source = Stream(src)
    for line in lines:  # a delta moves exactly its stored bytes, no re-encoding
        assert line["status"] == "copied"
        assert line["copied_bytes"] == line["stored_bytes"] == source.manifest(line["version"]).stored_bytes
        assert line["seconds"] >= 0 and line["throughput_bytes_per_s"] > 0
    assert stored_files(dst) == stored_files(src)
    copy = Stream(dst)
    assert copy.info().stream_id == source.info().stream_id
    for version, tensors in published.items():
        assert_same_tensors(dict(copy.iter_tensors(version)), tensors)
    again = run_cli("mirror", src, dst, "--json")  # idempotent: nothing left to move
    assert again.returncode == 0, again.stderr
    assert again.stdout == ""


def test_a_version_range_brings_the_chain_it_needs(tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    publish_versions(src, 8, keyframe_every=4)  # keyframes 0 and 4
    results = Mirror(Stream(src), open_storage(dst), MirrorConfig(versions="6:7")).run_once()
    assert [r.version for r in results] == [4, 5, 6, 7]
    assert Stream(dst).versions() == [4, 5, 6, 7]
    Stream(dst).verify(7)
    more = Mirror(Stream(src), open_storage(dst), MirrorConfig(versions="2:latest")).run_once()
    assert [r.version for r in more] == [0, 1, 2, 3]
    assert stored_files(dst) == stored_files(src)


def test_an_interrupted_copy_resumes_checking_what_is_there(tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    publish_versions(src, 3, keyframe_every=10)
    Mirror(Stream(src), open_storage(dst)).run_once()
    # As if killed between the data files and the commit: the data is there, the manifest not; and one
    # file of another version is damaged (a full disk, a bad copy).
    dst_storage = open_storage(dst)
    dst_storage.delete(manifest_path(2))
    dst_storage.delete(manifest_path(1))
    damaged = data_path(1, Stream(src).manifest(1).files[0].name)
    dst_storage.put(damaged, b"not the data")
    results = {r.version: r for r in Mirror(Stream(src), open_storage(dst)).run_once()}
    assert results[2].status == "present" and results[2].copied_bytes == 0
    assert results[2].present_bytes == Stream(src).manifest(2).stored_bytes
    assert results[1].status == "copied" and results[1].copied_bytes == Stream(src).manifest(1).stored_bytes
    assert stored_files(dst) == stored_files(src)


def test_a_destination_holding_another_stream_or_version_is_refused(tmp_path):
    src, other, diverged = str(tmp_path / "src"), str(tmp_path / "other"), str(tmp_path / "diverged")
    publish_versions(src, 2)
    publish_versions(other, 1, seed=1)
    before = stored_files(other)
    with pytest.raises(ForeignStreamError, match="holds stream"):
        Mirror(Stream(src), open_storage(other)).run_once()
    done = run_cli("mirror", src, other)
    assert done.returncode == 5 and "holds stream" in done.stderr
    assert stored_files(other) == before
    # The same stream, but its version 1 is not the source's (a second trainer wrote to the copy).
    Mirror(Stream(src), open_storage(diverged), MirrorConfig(versions="0:0")).run_once()
    with Publisher(diverged) as publisher:
        publisher.publish(random_state(7, scale=8), version=1).result()
    done = run_cli("mirror", src, diverged)
    assert done.returncode == 5 and "version 1" in done.stderr, done.stderr
    with pytest.raises(VersionConflictError):
        Mirror(Stream(src), open_storage(diverged)).run_once()


def test_a_corrupt_source_version_is_refused_and_later_versions_go_on(tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    published = publish_versions(src, 6, keyframe_every=3)  # keyframes 0 and 3
    path = tmp_path / "src" / data_path(1, Stream(src).manifest(1).files[0].name)
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))
    done = run_cli("mirror", src, dst, "--json")
    assert done.returncode == 3, done.stderr
    results = {line["version"]: line for line in map(json.loads, done.stdout.splitlines())}
    assert results[1]["status"] == "refused" and "version 1" in results[1]["error"]
    assert "hash" in results[1]["error"]
    assert results[2]["status"] == "refused" and "base version 1" in results[2]["error"]  # its base is gone
    assert Stream(dst).versions() == [0, 3, 4, 5]
    assert not (tmp_path / "dst" / data_path(1, Stream(src).manifest(1).files[0].name)).exists()
    for version in (0, 3, 4, 5):
        assert_same_tensors(dict(Stream(dst).iter_tensors(version)), published[version])


@pytest.mark.parametrize("at", [0, 2])
def test_gc_just_before_a_commit_keeps_what_the_mirror_wrote(tmp_path, at):
    """gc at the destination without grace, run for real just before the mirror commits version ``at``: the
    mirror holds a lease there on the version it copies (and its base), so gc keeps its data and the copy
    verifies."""
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    publish_versions(src, 3, keyframe_every=10)
    reports = []
    collect = lambda: reports.append(collect_garbage(Stream(dst), keep_last=1, grace_seconds=0))  # noqa: E731
    results = Mirror(Stream(src), HookedStorage(open_storage(dst), once_before("put", manifest_path(at), collect))
                     ).run_once()
    assert reports and [r.status for r in results] == ["copied"] * 3
    assert not [path for path in reports[0].debris if path.startswith(VERSIONS_DIR)]
    done = run_cli("verify", dst)
    assert done.returncode == 0, done.stderr
    assert read_leases(open_storage(dst)).records == []


def test_a_resumed_mirror_refreshes_the_files_it_reuses(tmp_path):
    """Run again after an interruption hours ago, the mirror reuses the data files it copied then; a gc that
    read the leases before the mirror began and reaches those files while the mirror commits keeps them
    (reused, they count as written now)."""
    src, dst = str(tmp_path / "src"), tmp_path / "dst"
    publish_versions(src, 3, keyframe_every=10)
    Mirror(Stream(src), open_storage(str(dst))).run_once()
    (dst / manifest_path(2)).unlink()  # as if killed before this commit
    backdate(dst / VERSIONS_DIR, 7200)
    hooked, reports = gc_finishing_before_put(str(dst), manifest_path(2))
    (result,) = Mirror(Stream(src), hooked).run_once()
    assert reports and not [path for path in reports[0].debris if path.startswith(VERSIONS_DIR)]
    assert (result.version, result.status, result.copied_bytes) == (2, "present", 0)
    done = run_cli("verify", str(dst))
    assert done.returncode == 0, done.stderr


def test_a_delta_contradicting_its_base_at_the_destination_is_not_committed(tmp_path):
    """copy_version of a delta resealed with chain_length 7 on keyframe 0 (which the destination holds): the
    destination's check of the base (reader obligation 5) refuses it before its commit, naming the version."""
    from ckptstream.transfer import Destination, copy_version

    src, dst = tmp_path / "src", str(tmp_path / "dst")
    publish_versions(str(src), 2, keyframe_every=10)
    Mirror(Stream(str(src)), open_storage(dst), MirrorConfig(versions="0:0")).run_once()
    path = src / manifest_path(1)
    path.write_bytes(reseal(path.read_bytes().replace(b'"chain_length": 1,', b'"chain_length": 7,')))
    with pytest.raises(IntegrityError, match="chain length 7") as caught:
        copy_version(Stream(str(src)), Destination(open_storage(dst)), 1)
    assert caught.value.version == 1 and Stream(dst).versions() == [0]


class DamagingStorage(PosixStorage):
    """A local directory whose disk flips one byte of the data files of ``damaged`` versions as they are
    written (what a bad disk or a broken NFS link does), so that the version is committed corrupt."""

    damaged: set[int] = set()

    @contextlib.contextmanager
    def open_write(self, path: str):
        with super().open_write(path) as f:
            if not any(path.startswith(version_dir(v) + "/") for v in self.damaged):
                yield f
                return
            buffer = io.BytesIO()
            yield buffer
            data = bytearray(buffer.getvalue())
            data[len(data) // 2] ^= 0x01
            f.write(bytes(data))


register_backend("damaging", lambda url, options: DamagingStorage(url.partition("://")[2]))


def test_follow_keeps_the_copy_current_while_the_trainer_publishes(tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    published = publish_versions(src, 2, keyframe_every=3)
    seen = []
    mirror = Mirror(Stream(src), open_storage(dst),
                    MirrorConfig(replica_id="site-mirror", poll_interval=0.1, heartbeat_interval=0.2,
                                 on_version=seen.append))
    stop = threading.Event()
    thread = threading.Thread(target=mirror.follow, args=(stop,))
    thread.start()
    DamagingStorage.damaged = {4}
    try:
        published.update(publish_versions(f"damaging://{src}", 5, keyframe_every=3, start=2))  # keyframes 3, 6
        deadline = time.monotonic() + 30
        while Stream(dst).latest() != 6 and time.monotonic() < deadline:
            time.sleep(0.05)
        # Version 4 is corrupt at the source and 5 is a delta on it: refused; the rest is copied.
        assert Stream(dst).versions() == [0, 1, 2, 3, 6]
        refused_dir = tmp_path / "dst" / version_dir(4)
        assert not refused_dir.exists() or not any(refused_dir.iterdir())  # not even its data files
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            records = Stream(dst).replicas()
            if records and records[0].version == 6 and records[0].state == "current":
                break
            time.sleep(0.05)
        (record,) = Stream(dst).replicas()
        assert (record.replica_id, record.kind, record.source, record.version, record.lag) == \
            ("site-mirror", "mirror", src, 6, 2)
        assert set(record.refused) == {"4", "5"} and "hash" in record.refused["4"]
        with pytest.raises(TimeoutError):  # a mirror serves nothing: a trainer never waits on it
            Stream(dst).wait_for_version(6, timeout=0.3, poll_interval=0.1)
        listed = run_cli("replicas", dst)
        assert "site-mirror" in listed.stdout and "mirror" in listed.stdout
    finally:
        DamagingStorage.damaged = set()
        stop.set()
        thread.join(30)
    assert not thread.is_alive()
    assert Stream(dst).replicas()[0].state == "stopped"
    assert {r.version: r.status for r in seen} == {0: "copied", 1: "copied", 2: "copied", 3: "copied",
                                                   4: "refused", 5: "refused", 6: "copied"}
    for version in (0, 1, 2, 3, 6):
        assert_same_tensors(dict(Stream(dst).iter_tensors(version)), published[version])


def committed_versions_are_whole(url: str) -> list[int]:
    """The versions visible at ``url``; each one's data files are all there, with their size and hash (a
    partial version would fail here)."""
    from ckptstream.transfer import holds_file

    stream = Stream(url)
    visible = stream.versions()
    for version in visible:
        for entry in stream.manifest(version).files:
            assert holds_file(stream.storage, data_path(version, entry.name), entry), (version, entry.name)
    return visible


def test_a_mirror_killed_at_random_moments_never_shows_a_partial_version(tmp_path):
    import random

    src, dst = str(tmp_path / "src"), tmp_path / "dst"
    publish_versions(src, 8, keyframe_every=2, scale=40)  # ~0.6 MB keyframes, small deltas
    rate = 1 << 20  # a copy of all of it takes a few seconds: a kill lands in the middle
    randomness = random.Random(1234)
    problems: list[BaseException] = []
    watching = threading.Event()

    def watch() -> None:  # look at DST all the while, as a follower of the copy would
        while not watching.is_set():
            if (dst / "stream.json").exists():
                try:
                    committed_versions_are_whole(str(dst))
                except (AssertionError, FileNotFoundError) as exc:  # a version without its files
                    problems.append(exc)
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    kills = 0
    try:
        for _ in range(10):
            process = subprocess.Popen([*CLI, "mirror", src, str(dst), "--bwlimit", str(rate)],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            while not (dst / "versions").exists() and process.poll() is None:  # its copying has begun
                time.sleep(0.01)
            time.sleep(randomness.uniform(0.0, 1.5))
            if process.poll() is None:
                process.kill()
                kills += 1
            process.wait()
    finally:
        watching.set()
        watcher.join()
    assert kills >= 5, "the mirror finished before most kills: make the copy slower"
    assert not problems, problems[0]
    done = run_cli("mirror", src, str(dst), "--json")
    assert done.returncode == 0, done.stderr
    assert stored_files(str(dst)) == stored_files(src)
    Stream(str(dst)).verify("latest")


def test_gc_at_the_source_keeps_the_version_a_slow_mirror_copies(tmp_path):
    from ckptstream.format import LEASE_CLOCK_SKEW_SECONDS
    from ckptstream.writer import collect_garbage

    src, dst, dst2 = str(tmp_path / "src"), str(tmp_path / "dst"), tmp_path / "dst2"
    published = publish_versions(src, 4, keyframe_every=1, scale=100)  # keyframes of ~1.6 MB
    rate, ttl = str(256 << 10), "1"  # a version takes ~6 s, longer than the lease's TTL
    slow = subprocess.Popen([*CLI, "mirror", src, dst, "--versions", "1:1", "--bwlimit", rate, "--lease-ttl", ttl,
                             "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not read_leases(Stream(src).storage).records and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(2 * float(ttl))  # past the first TTL: the lease lives on by renewal
    report = collect_garbage(Stream(src), keep_last=1)
    assert 1 in report.kept and 1 not in report.deleted_versions
    assert report.deleted_versions == [0, 2]
    out, err = slow.communicate(timeout=60)
    assert slow.returncode == 0, err
    assert json.loads(out.splitlines()[-1])["status"] == "copied"
    assert_same_tensors(dict(Stream(dst).iter_tensors(1)), published[1])
    # A mirror killed mid-copy leaves its lease: it protects the version only until it expires.
    killed = subprocess.Popen([*CLI, "mirror", src, str(dst2), "--versions", "1:1", "--bwlimit", rate,
                               "--lease-ttl", ttl], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not read_leases(Stream(src).storage).records and time.monotonic() < deadline:
        time.sleep(0.02)
    killed.kill()
    killed.wait()
    assert 1 in collect_garbage(Stream(src), keep_last=1).kept
    time.sleep(float(ttl) + LEASE_CLOCK_SKEW_SECONDS + 0.5)
    assert collect_garbage(Stream(src), keep_last=1).deleted_versions == [1]
    assert Stream(src).versions() == [3]
    assert not Stream(str(dst2)).exists() or Stream(str(dst2)).versions() == []
