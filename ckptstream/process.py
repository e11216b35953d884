"""Helpers for child processes: a free port to start a server (vLLM, vllm-router) on, death with the parent, a stop,
and evaluation commands run together (replay)."""

from __future__ import annotations

import ctypes
import os
import random
import signal
import socket
import subprocess
import time
from typing import Mapping, Sequence

_PR_SET_PDEATHSIG = 1

COMMAND_POLL_S = 0.2
"""How often ``run_together`` wakes while its commands run."""


def die_with_parent() -> None:
    """In the child, before exec (``Popen(preexec_fn=...)``): get SIGTERM when the parent dies (orphans
    keep holding ports). Linux sends it when the *thread* that started the child exits: start children
    from a thread that lives as long as they should (not from a pool's worker thread)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


STOP_POLL_S = 0.05
"""How often ``stop_process`` looks whether the descendants of the process it stops are gone."""


def stop_process(process: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGTERM ``process`` and wait up to ``timeout`` seconds for it and the descendants it had (vLLM's engine
    core, its workers and their resource tracker stop after it: what they leave, the tracker removes last);
    then SIGKILL whichever of them is left. A descendant of a killed process would live on as an orphan that
    nobody stops, holding memory and ports."""
    tree = [(pid, _start_time(pid)) for pid in descendants(process.pid)]
    deadline = time.monotonic() + timeout
    process.terminate()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    # (not our children: no wait() tells when they exit)
    while _still_running(tree) and time.monotonic() < deadline:
        time.sleep(STOP_POLL_S)
    for pid in _still_running(tree):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    killed = time.monotonic()
    while _still_running(tree) and time.monotonic() - killed < 10:
        time.sleep(STOP_POLL_S)


def _start_time(pid: int) -> str | None:
    """When ``pid`` started (in clock ticks since boot), which tells it from a later process given its number;
    None once it is gone or has exited (a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def _still_running(tree: list[tuple[int, str | None]]) -> list[int]:
    """The processes of ``tree`` (pid, start time) that still run."""
    return [pid for pid, started in tree if started is not None and _start_time(pid) == started]


def run_together(commands: Sequence[tuple[Sequence[str], Mapping[str, str]]], *, capture: bool
                 ) -> list[tuple[int, float, str | None]]:
    """Run every (command, environment) at once; per command (exit code, seconds it ran, its output: stdout and
    stderr together if ``capture``, else None: passed on). Ctrl-C (any exception) kills the commands still running.

    The wait wakes every ``COMMAND_POLL_S``: the kernel may deliver a Ctrl-C to any thread of this process (a lease
    renewal, a reader), and a wait blocked in the kernel would then not see it until every command had ended. So
    the seconds are measured to ``COMMAND_POLL_S``."""
    processes: list[subprocess.Popen[bytes]] = []
    started: list[float] = []
    pipe = subprocess.PIPE if capture else None
    try:
        for command, env in commands:
            started.append(time.perf_counter())
            processes.append(subprocess.Popen(list(command), env=dict(env), stdout=pipe,
                                              stderr=subprocess.STDOUT if capture else None))
        runs: list[tuple[int, float, str | None] | None] = [None] * len(processes)
        while None in runs:
            for index, process in enumerate(processes):
                if runs[index] is not None:
                    continue
                try:  # (with a pipe: reading it meanwhile, so that no command blocks on a full pipe)
                    output = process.communicate(timeout=COMMAND_POLL_S / len(processes))[0]
                except subprocess.TimeoutExpired:
                    continue
                runs[index] = (process.returncode, time.perf_counter() - started[index],
                               None if output is None else output.decode("utf-8", "replace"))
        return [run for run in runs if run is not None]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()


LOWEST_PICKED_PORT = 20000
"""``free_port`` picks from this port up to the kernel's ephemeral range."""
_PORTS = random.SystemRandom()  # (not the seedable module: trainers seed it alike in every process)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (for a server about to start), picked at random below the kernel's
    range of ephemeral ports: an outgoing connection takes its source port from that range, and could take
    a port picked there before the server binds it (seen as a vLLM server that did not start while others
    started beside it). Where that range leaves no room below it, a port of the range."""
    low = _lowest_ephemeral_port()
    if low - LOWEST_PICKED_PORT >= 1000:
        for _ in range(100):
            port = _PORTS.randrange(LOWEST_PICKED_PORT, low)
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _lowest_ephemeral_port() -> int:
    """The start of the kernel's range of ephemeral ports (Linux's; its default elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def descendants(pid: int) -> list[int]:
    """The PIDs of every live descendant of ``pid`` (from /proc, on Linux; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found
