"""Taking a vLLM server over from the process that keeps it current (``replay`` beside ``serve``/``follow``).

One lock file per server URL in a runtime directory that every ckptstream process of this user finds,
whatever its ``--cache-dir``: ``$CKPTSTREAM_RUNTIME_DIR`` if set, else ``/tmp/ckptstream-<uid>``.

- A taker (``replay``) holds an **exclusive** ``flock`` on the server's lock file for as long as it
  drives the server (``Takeover``). Acquiring it waits for an update in flight to finish.
- A follower takes a **shared**, non-blocking ``flock`` on it around each round of work on that server
  (``try_share``): reconcile, reload, probe. When that fails, the server is taken over: the follower
  stands aside (no reconcile, no update for that server) until the lock is free again; then its
  reconcile sees that ``/weight_info`` is not its version, reloads its current version, and newer
  versions follow as usual.

The kernel drops a dead process's locks, so a replay killed with SIGKILL gives the server back. The key
is the server's host and port as written (lower-cased; ``localhost`` counts as ``127.0.0.1``, a missing
port as the scheme's): other names of one host (its IP address, another alias) are different locks, so
give both processes the same spelling.
"""

from __future__ import annotations

import hashlib
import os
import stat
import time
import urllib.parse
from pathlib import Path
from typing import Iterable

from ...errors import CkptStreamError, VllmError
from ...locks import try_lock, unlock

RUNTIME_DIR_ENV = "CKPTSTREAM_RUNTIME_DIR"


def runtime_dir() -> Path:
    """The directory of the per-server lock files (created on first use, private to this user)."""
    configured = os.environ.get(RUNTIME_DIR_ENV)
    path = Path(configured) if configured else Path("/tmp") / f"ckptstream-{os.getuid()}"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    status = path.lstat()
    if not stat.S_ISDIR(status.st_mode) or status.st_uid != os.getuid() or status.st_mode & 0o077:
        # Anyone who can create or hold these lock files could make followers stand aside forever.
        raise CkptStreamError(f"{path} must be a directory of this user's, private to it (mode 0700)",
                              hint=f"Remove it, or set {RUNTIME_DIR_ENV} to a private directory")
    return path


def server_key(url: str) -> str:
    """``host:port`` of a server URL, the way its lock is named (see the module docstring)."""
    parts = urllib.parse.urlsplit(url.strip().lower())
    host = parts.hostname or parts.path.split("/", 1)[0]
    host = "127.0.0.1" if host == "localhost" else host
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:  # not a number: keep the text, it still names one lock
        port = parts.netloc.rsplit(":", 1)[-1]
    return f"{host}:{port}"


def lock_path(url: str) -> Path:
    """The lock file of the server at ``url``."""
    key = server_key(url)
    readable = "".join(c if c.isalnum() else "-" for c in key)[:80]
    return runtime_dir() / f"server-{readable}-{hashlib.sha256(key.encode()).hexdigest()[:12]}.lock"


def try_share(url: str) -> int | None:
    """A shared hold on the server's lock (a file descriptor for ``locks.unlock``), or None while another
    process has taken the server over."""
    return try_lock(lock_path(url), shared=True)


class Takeover:
    """Exclusive hold on vLLM servers: while held, followers of these servers stand aside.

    Args:
        urls: the servers' base URLs, spelled as their followers spell them.
        timeout: seconds to wait for followers to finish an update in flight (VllmError after).

    Use as a context manager, or call ``release()``.
    """

    def __init__(self, urls: Iterable[str], *, timeout: float = 600.0, interval: float = 0.05):
        self._fds: list[int] = []
        deadline = time.monotonic() + timeout
        try:
            for url in sorted(set(urls)):  # one order for every taker: no deadlock between two
                while (fd := try_lock(lock_path(url))) is None:
                    if time.monotonic() > deadline:
                        raise VllmError(f"{url} is busy (another process holds it) after {timeout:.0f} s",
                                        hint="Another replay may be driving this server; wait for it "
                                             "or stop it")
                    time.sleep(interval)
                self._fds.append(fd)
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        """Give the servers back: their followers reconcile them to their own versions."""
        while self._fds:
            unlock(self._fds.pop())

    def __enter__(self) -> Takeover:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
