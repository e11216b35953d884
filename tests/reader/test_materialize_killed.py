"""A materialize killed half-way leaves its temporary directory; the next one of the same output removes
it, and never the temporary directory of a materialize still running (real processes, real SIGKILL)."""

from __future__ import annotations

import multiprocessing.process
import os
import signal
import time
from pathlib import Path

import pytest

from ckptstream import Publisher, Stream
from ckptstream.reader.materialize import remove_stale_builds
from tests.helpers import preloaded_context, preloaded_process, random_state


def _materialize_and_block(url: str, out: str, started) -> None:
    """In a child process: materialize version 0 and, after its first tensor, block (so the parent can
    kill it mid-way)."""
    def progress(_):
        started.set()
        time.sleep(600)

    Stream(url).materialize(0, out, progress=progress, workers=1, overwrite=True)


@pytest.fixture
def stream(local_url):
    with Publisher(local_url) as publisher:
        publisher.publish(random_state(0, scale=8)).result()
    return Stream(local_url)


def _start(url: str, out: Path) -> multiprocessing.process.BaseProcess:
    started = preloaded_context().Event()
    child = preloaded_process(_materialize_and_block, url, str(out), started)  # forked ready-imported
    child.start()
    assert started.wait(120), "the materialize did not reach its first tensor"
    return child


def _temps(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(".tmp-"))


def _kill(child: multiprocessing.process.BaseProcess) -> None:
    os.kill(child.pid, signal.SIGKILL)
    child.join(60)
    assert child.exitcode == -signal.SIGKILL


def test_killed_materialize_debris_is_removed_by_the_next_run(stream, tmp_path):
    parent = tmp_path / "outputs"
    out = parent / "model"
    first = _start(stream.url, out)
    _kill(first)
    killed = _temps(parent)
    assert len(killed) == 1 and killed[0].endswith("-model") and not out.exists()

    second = _start(stream.url, out)  # its start removes the killed run's directory, not its own
    try:
        live = _temps(parent)
        assert len(live) == 1 and live != killed
        stream.materialize(0, out)  # a concurrent run of the same output: the live one's directory stays
        assert _temps(parent) == live and (out / "ckptstream.json").is_file()
        assert remove_stale_builds(out) == []
    finally:
        _kill(second)
    stream.materialize(0, out, overwrite=True)
    assert _temps(parent) == [] and sorted(p.name for p in parent.iterdir()) == ["model"]


def test_stale_directories_of_other_outputs_and_older_versions(stream, tmp_path):
    parent = tmp_path / "outputs"
    other = _start(stream.url, parent / "other")
    _kill(other)
    legacy = parent / f".tmp-{'a' * 32}-model"  # an older ckptstream's debris: no lock file
    legacy.mkdir()
    (legacy / "model.safetensors").write_bytes(b"partial")
    stream.materialize(0, parent / "model")
    remaining = _temps(parent)
    assert len(remaining) == 1 and remaining[0].endswith("-other")  # another output's debris is its own
    stream.materialize(0, parent / "other", overwrite=True)
    assert _temps(parent) == []
