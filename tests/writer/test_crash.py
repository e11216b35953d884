"""A writer killed (SIGKILL, a real subprocess) at each stage before the commit leaves no visible version,
blocks nothing, and its debris is removed by gc."""

from __future__ import annotations

import os
import signal

import pytest

from ckptstream import Publisher, Stream
from ckptstream.format import TEMP_PREFIX
from ckptstream.storage import open_storage
from ckptstream.writer import collect_garbage
from tests.helpers import assert_same_tensors, preloaded_process, random_state


def _publish_and_die(url: str, stage: str) -> None:
    """In a child process: publish version 1 of a stream holding version 0, and SIGKILL itself at ``stage``:
    the kill is real; the patch only decides when it happens."""
    import contextlib

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    publisher = Publisher(url)
    storage = publisher.storage
    real_open_write, real_put_if_absent = storage.open_write, storage.put_if_absent

    class DyingFile:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            self.f.write(data)
            self.f.flush()
            die()

    @contextlib.contextmanager
    def open_write(path):
        with real_open_write(path) as f:
            yield DyingFile(f) if stage == "mid-data" else f
        if stage == "after-data":
            die()

    def put_if_absent(path, data):
        if stage == "before-commit":
            die()
        if stage == "mid-commit":  # POSIX: temp manifest written and fsynced, not yet linked
            os.link = lambda *a: die()
        real_put_if_absent(path, data)

    storage.open_write, storage.put_if_absent = open_write, put_if_absent
    publisher.publish(random_state(1)).result()
    print("NOT KILLED")


@pytest.mark.parametrize("stage", ["mid-data", "after-data", "before-commit"])
def test_writer_killed_before_commit(stream_url, stage):
    _kill_and_recover(stream_url, stage)


def test_writer_killed_inside_the_posix_commit(local_url):
    # (On S3 the commit is one conditional PUT: there is no stage inside it to kill.)
    _kill_and_recover(local_url, "mid-commit")


def _kill_and_recover(stream_url: str, stage: str) -> None:
    with Publisher(stream_url) as publisher:
        publisher.publish(random_state(0)).result()
    child = preloaded_process(_publish_and_die, stream_url, stage)  # a real process, forked ready-imported
    child.start()
    child.join(120)
    assert child.exitcode == -signal.SIGKILL, child.exitcode

    stream = Stream(stream_url)
    assert stream.versions() == [0]  # nothing visible
    storage = open_storage(stream_url)
    # An object store shows no unfinished upload at all; everywhere else the dead writer left debris.
    leaves_debris = not (stage == "mid-data" and stream_url.startswith("s3://"))
    debris_before = storage.list("versions/000000000001") + [
        e for e in storage.list("manifests") if e.name.startswith(TEMP_PREFIX)]
    assert bool(debris_before) == leaves_debris

    # Nothing is blocked: the next publish takes version 1 and is correct.
    with Publisher(stream_url) as publisher:
        assert publisher.publish(random_state(2)).result().version == 1
    assert_same_tensors(dict(Stream(stream_url).iter_tensors(1)), random_state(2))

    # gc (grace 0) removes the dead writer's debris and nothing else.
    report = collect_garbage(Stream(stream_url), keep_last=5, grace_seconds=0)
    assert report.deleted_versions == []
    assert bool(report.debris) == leaves_debris
    committed = {f.name for f in Stream(stream_url).manifest(1).files}
    assert {e.name for e in storage.list("versions/000000000001")} == committed
    assert not any(e.name.startswith(TEMP_PREFIX) for d in ("", "manifests", "versions/000000000001")
                   for e in storage.list(d))
    Stream(stream_url).verify(1)
