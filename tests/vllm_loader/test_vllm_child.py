"""vLLM as serve's child (``vllm_child``), with a shell standing in for vLLM: a session of its own, so that a
terminal's Ctrl-C reaches serve alone; a second Ctrl-C while serve stops it kills all it started; SIGHUP stops
serve unless ignored (nohup)."""

from __future__ import annotations

import os
import select
import signal
import threading

from ckptstream.process import descendants
from ckptstream.shm import EngineSegments
from ckptstream.vllm_loader.vllm_child import start_child, stop_child, stop_on_signals

# Ignores SIGTERM (a hung engine), starts a grandchild, says so and waits.
STUBBORN = "trap '' TERM; sleep 1000 & echo started; wait"


def _start(tmp_path):
    child, output, log_file = start_child(["sh", "-c", STUBBORN], dict(os.environ), tmp_path / "vllm.log")
    while not any("started" in line for line in list(output.lines)):
        output.thread.join(timeout=0.05)  # (the output thread ends with the child; the line comes first)
        assert child.poll() is None
    return child, output, log_file


def _stop(child, output, log_file) -> None:
    os.killpg(child.pid, signal.SIGKILL)
    stop_child(child, output, log_file, EngineSegments())


def test_vllm_runs_in_a_session_of_its_own_and_reads_no_terminal(tmp_path):
    child, output, log_file = _start(tmp_path)
    try:
        assert os.getsid(child.pid) == child.pid != os.getsid(0)
        assert os.readlink(f"/proc/{child.pid}/fd/0") == os.devnull
    finally:
        _stop(child, output, log_file)


def test_a_second_ctrl_c_while_serve_stops_vllm_kills_what_it_started(tmp_path):
    child, output, log_file = _start(tmp_path)
    exits = [os.pidfd_open(pid) for pid in descendants(child.pid)]  # (readable once the process has exited)
    assert exits
    stop = threading.Event()
    previous, signalled = stop_on_signals(stop, child)
    try:
        signal.raise_signal(signal.SIGINT)
        assert stop.is_set() and signalled.is_set() and child.poll() is None  # a stop request: serve stops it
        signal.raise_signal(signal.SIGINT)  # Ctrl-C again while the stop waits for a vLLM that ignores SIGTERM
        assert child.wait(timeout=60) == -signal.SIGKILL
        assert all(select.select([fd], [], [], 60)[0] for fd in exits)  # its grandchild too
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for fd in exits:
            os.close(fd)
        stop_child(child, output, log_file, EngineSegments())


def test_sighup_stops_serve_unless_ignored_as_under_nohup(tmp_path):
    child, output, log_file = _start(tmp_path)
    before = signal.getsignal(signal.SIGHUP)
    try:
        for ignored in (False, True):
            signal.signal(signal.SIGHUP, signal.SIG_IGN if ignored else signal.SIG_DFL)
            previous, _ = stop_on_signals(threading.Event(), child)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            assert (signal.SIGHUP in previous) is not ignored
    finally:
        signal.signal(signal.SIGHUP, before)
        _stop(child, output, log_file)
