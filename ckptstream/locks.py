"""Advisory file locks (``flock``) that die with their process: who owns a local directory or a server.

The kernel drops a ``flock`` when its holder exits, SIGKILL included, so the lock of a dead process is
simply free again: no stale-lock cleanup, no pid files. Used for local directories (the versions of a
follower's cache, a materialization in progress) and for a vLLM server taken over by a replay.
"""

from __future__ import annotations

import fcntl
import os

LOCK_FILE = ".lock"
"""The lock file inside a directory whose owner holds it (a follower's cache, a materialization's build)."""


def try_lock(path: str | os.PathLike[str], *, shared: bool = False, create: bool = True) -> int | None:
    """Hold a lock on the file ``path`` without waiting: its descriptor (for :func:`unlock`), or None when
    another process holds it (or, with ``create=False``, when the file does not exist).

    Args:
        shared: a shared lock (any number of holders; excludes an exclusive one) instead of an exclusive one.
        create: create the file if it is missing.
    """
    try:
        fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o644)
    except FileNotFoundError:
        if create:
            raise
        return None
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def lock_file(path: str | os.PathLike[str], *, shared: bool = False, wait: bool = True) -> int | None:
    """Hold a lock on the file that is at ``path`` when the lock is granted (created if missing): its
    descriptor, or None when ``wait`` is false and another process holds it.

    For lock files that are removed: a remover unlinks the file while holding it exclusively, so a lock
    granted on a file that is no longer at ``path`` (opened before the unlink, granted after it) protects
    nothing; it is dropped and taken again on the file now there.
    """
    mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, mode if wait else mode | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            now, held = os.stat(path), os.fstat(fd)
            if (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def unlock(fd: int) -> None:
    """Release a lock taken by :func:`try_lock` (closing its descriptor drops it)."""
    os.close(fd)
