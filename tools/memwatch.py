#!/usr/bin/env python3
"""Run a command and report the peak memory of its whole process tree.

    python tools/memwatch.py -- python -m pytest -q            # `make test` runs the suite this way
    python tools/memwatch.py --samples mem.tsv -- COMMAND ...   # each sample too: seconds, bytes, processes

The tree is the command and every process it starts, children of children included. Daemons that detach
(``ray start`` leaves its GCS, raylet and workers running, vLLM's engine processes) stay in it: this process
is their subreaper (Linux's ``PR_SET_CHILD_SUBREAPER``), so an orphan is re-parented here, not to init.
Each process counts its PSS (``/proc/PID/smaps_rollup``: shared pages split between the processes mapping
them, so the sum is what the tree holds), its RSS where PSS is unreadable. At the end, on stderr: the peak,
when it was reached, and the largest processes at that moment. The exit status is the command's.

Standard library only (no ckptstream import): it watches the environment the project is tested in.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from typing import NamedTuple

PR_SET_CHILD_SUBREAPER = 36
PAGE = os.sysconf("SC_PAGE_SIZE")
GIB = 1 << 30
MIB = 1 << 20


class Sample(NamedTuple):
    at: float  # seconds since the command started
    total: int  # bytes
    processes: dict[int, tuple[int, str]]  # pid -> (bytes, command name)


def _tree(root: int) -> list[int]:
    """``root`` and its live descendants, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != b"Z":
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, ()))
    return found


def _memory(pid: int) -> int | None:
    """PSS of ``pid`` in bytes (RSS where smaps_rollup is unreadable); None once it is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return None


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            words = [w.decode(errors="replace") for w in f.read().split(b"\0") if w]
    except OSError:
        return "?"
    return " ".join(words)[:100] or "?"


def sample(root: int, started: float) -> Sample:
    """The memory of ``root``'s tree now (``root`` itself, this watcher, is left out)."""
    processes = {}
    for pid in _tree(root):
        if pid == root:
            continue
        size = _memory(pid)
        if size is not None:
            processes[pid] = (size, "")
    return Sample(time.monotonic() - started, sum(size for size, _ in processes.values()), processes)


def _fmt(size: int) -> str:
    return f"{size / GIB:.2f} GiB"


def watch(command: list[str], interval: float, samples_path: str | None, label: str) -> int:
    """Run ``command``, sampling this process's tree every ``interval`` s; report the peak; its exit status."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        print("memwatch: not a subreaper here: processes that detach are not counted", file=sys.stderr)
    me, started = os.getpid(), time.monotonic()
    wall_start = time.time()
    child = subprocess.Popen(command)
    status: list[int] = []
    done = threading.Event()

    def forward(signum: int, frame: object) -> None:  # the command decides how to end
        if not done.is_set():
            os.kill(child.pid, signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, forward)
    signal.signal(signal.SIGINT, lambda signum, frame: None)  # Ctrl-C reaches the command itself (its group)

    def reap() -> None:
        """Wait for the command; orphans re-parented here are reaped as they end (no zombies)."""
        while True:
            try:
                pid, code = os.waitpid(-1, 0)
            except ChildProcessError:
                break
            if pid == child.pid:
                status.append(os.waitstatus_to_exitcode(code))
                break
        done.set()

    threading.Thread(target=reap, daemon=True).start()
    peak = Sample(0.0, 0, {})
    out = open(samples_path, "w", buffering=1) if samples_path else None
    try:
        while not done.wait(interval):
            now = sample(me, started)
            if out is not None:
                out.write(f"{now.at:.1f}\t{now.total}\t{len(now.processes)}\n")
            if now.total > peak.total:
                peak = now._replace(processes={pid: (size, _name(pid)) for pid, (size, _) in now.processes.items()})
    finally:
        if out is not None:
            out.close()
    code = status[0] if status else 1
    code = 128 - code if code < 0 else code  # ended by a signal: as a shell says it
    when = time.strftime("%H:%M:%S", time.localtime(wall_start + peak.at))
    print(f"\n{label}: peak memory {_fmt(peak.total)} (PSS of {len(peak.processes)} processes) at {when}, "
          f"{peak.at:.0f} s into {time.monotonic() - started:.0f} s", file=sys.stderr)
    left = [pid for pid in _tree(me) if pid != me]
    if left:
        print(f"  {len(left)} processes of the tree outlived the command: {left[:10]}", file=sys.stderr)
    largest = sorted(peak.processes.items(), key=lambda item: -item[1][0])[:8]
    for pid, (size, name) in largest:
        print(f"  {size / MIB:8.0f} MiB  {pid:>7}  {name}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     usage="%(prog)s [--interval S] [--samples FILE] -- COMMAND ...")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between samples (default 1)")
    parser.add_argument("--samples", help="write every sample to this file (seconds, bytes, processes)")
    parser.add_argument("--label", default="memwatch", help="how the report line starts")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given")
    return watch(command, args.interval, args.samples, args.label)


if __name__ == "__main__":
    sys.exit(main())
