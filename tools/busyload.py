#!/usr/bin/env python3
"""Run a command beside a load: other work keeping the cores busy and holding memory, as on a shared CI runner
or a developer's workstation (``make test-busy`` runs the test suite so).

    python tools/busyload.py -- make test                            # 2 busy cores, 8 GiB held
    python tools/busyload.py --cores 4 --memory-gib 16 -- COMMAND ...

``--cores`` processes each hold their share of the memory (written, so resident) and keep writing it, one
byte a page, round and round: each keeps a core busy and its pages in use. The command starts once they all
hold their share; it finds their PIDs in ``BUSYLOAD_PIDS``. When it ends, they are stopped (they also end
if this process dies) and the exit status is the command's.

Standard library only (no ckptstream import).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys

PAGE = os.sysconf("SC_PAGE_SIZE")
PR_SET_PDEATHSIG = 1


def hold(size: int, ready: int) -> None:
    """A load process: hold ``size`` bytes, say so on the ``ready`` fd, then write them round and round."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    block = bytearray(size)
    view = memoryview(block)
    for start in range(0, size, PAGE):  # a written page is resident; a merely allocated one is not
        view[start] = 1
    os.write(ready, b"1")
    os.close(ready)
    turn = 0
    while True:
        turn = (turn + 1) & 0xFF
        for start in range(0, size, PAGE):
            view[start] = turn


def run(command: list[str], cores: int, memory: int) -> int:
    """Start the load, wait until it holds its memory, run ``command``, stop the load; the command's status."""
    load: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(cores):
            ready, told = os.pipe()
            load.append(subprocess.Popen([sys.executable, __file__, "--hold", str(memory // cores), str(told)],
                                         pass_fds=(told,)))
            os.close(told)
            with os.fdopen(ready, "rb") as f:
                if f.read(1) != b"1":
                    raise SystemExit(f"busyload: a load process ended before holding its memory "
                                     f"(exit status {load[-1].wait()})")
        pids = " ".join(str(p.pid) for p in load)
        print(f"busyload: {cores} busy processes holding {memory / (1 << 30):.2f} GiB: {pids}", file=sys.stderr)
        child = subprocess.Popen(command, env={**os.environ, "BUSYLOAD_PIDS": pids})
        while True:
            try:
                return child.wait()
            except KeyboardInterrupt:  # the command (same process group) got it too; it decides how to end
                continue
    finally:
        for process in load:
            process.kill()
        for process in load:
            process.wait()
        if load:
            print("busyload: load stopped", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--hold"]:
        hold(int(argv[1]), int(argv[2]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     usage="%(prog)s [--cores N] [--memory-gib G] -- COMMAND ...")
    parser.add_argument("--cores", type=int, default=2, help="busy processes (default 2)")
    parser.add_argument("--memory-gib", type=float, default=8.0, help="GiB they hold together (default 8)")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or args.cores < 1:
        parser.error("a command and at least one core are needed")
    return run(command, args.cores, int(args.memory_gib * (1 << 30)))


if __name__ == "__main__":
    sys.exit(main())
