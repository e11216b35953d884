"""The shared memory a killed engine leaves in /dev/shm is removed, and only that (real processes, real
SIGKILL); a stopped process's descendants are stopped with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from multiprocessing import resource_tracker, shared_memory

import pytest

from ckptstream.process import descendants, stop_process
from ckptstream.shm import SHM_DIR, EngineSegments, used_segments

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc") or not os.path.isdir(SHM_DIR), reason="Linux only")

# A child that creates a segment the way vLLM's message queues do (its resource tracker would remove it at its
# exit, were the tracker not killed with it), says its name and waits.
CREATES = ("from multiprocessing import shared_memory; import sys; s = shared_memory.SharedMemory(create=True, "
           "size=1 << 20); print(s.name, flush=True); sys.stdin.read()")


def _engine() -> tuple[subprocess.Popen[str], str]:
    """The child above in a process group of its own (its resource tracker in it too); the segment's name."""
    child = subprocess.Popen([sys.executable, "-c", CREATES], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, start_new_session=True)
    assert child.stdout is not None
    return child, child.stdout.readline().strip()


def _kill_group(child: subprocess.Popen[str]) -> None:
    os.killpg(child.pid, signal.SIGKILL)
    child.wait()


def test_the_segment_of_a_killed_engine_is_removed():
    child, name = _engine()
    segments = EngineSegments()
    segments.note(child.pid)
    assert name in segments.names
    _kill_group(child)  # the engine and its resource tracker: nobody unlinks the segment
    assert os.path.exists(os.path.join(SHM_DIR, name))
    assert segments.remove_orphans() == [name]
    assert not os.path.exists(os.path.join(SHM_DIR, name))


def test_a_segment_another_live_process_maps_is_kept():
    child, name = _engine()
    segments = EngineSegments()
    segments.note(child.pid)
    kept = shared_memory.SharedMemory(name=name)  # (this process maps it: as a reader of another job would)
    try:
        resource_tracker.unregister(kept._name, "shared_memory")  # (this process only reads it)
        _kill_group(child)
        assert name in used_segments([os.getpid()])
        assert segments.remove_orphans() == []
        assert os.path.exists(os.path.join(SHM_DIR, name))
    finally:
        kept.close()
        kept.unlink()


def test_a_stopped_process_takes_its_descendants_along():
    """vLLM's API server exits on SIGTERM; an engine core or worker left hanging is killed after the timeout
    instead of living on as an orphan."""
    script = ("import signal, subprocess, sys; signal.signal(signal.SIGTERM, lambda *_: sys.exit(0)); "
              "p = subprocess.Popen([sys.executable, '-c', 'import signal, sys; "
              "signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); sys.stdin.read()'], "
              "stdout=subprocess.PIPE); p.stdout.readline(); print(p.pid, flush=True); sys.stdin.read()")
    process = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert process.stdout is not None
    hung = int(process.stdout.readline())
    assert descendants(process.pid) == [hung]
    stop_process(process, timeout=1)
    assert process.returncode == 0  # (it ran its own shutdown)
    assert _gone(hung)


def _gone(pid: int) -> bool:
    """Whether ``pid`` no longer runs (gone, or a zombie its new parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
