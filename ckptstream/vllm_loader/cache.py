"""The follower's local cache of decoded versions: the only module that creates or deletes names in it.

Layout::

    <root>/<stream id>/<owner>/            one follower's directory (owner: its replica id)
    <root>/<stream id>/<owner>/.lock       flock'ed (exclusive) for as long as that follower runs
    <root>/<stream id>/<owner>/000000000007/  a complete materialized version (it holds its marker file)
    <root>/<stream id>/<owner>/.incoming-000000000008/  a version being written (renamed when complete)

Every follower owns a directory of its own, so two followers of one stream on one host (``serve`` and a
``replay``, two ``follow`` processes) never delete each other's versions. The exclusive ``flock`` on
``.lock`` makes ownership exclusive between processes: a second process asking for an owned directory
gets ``<owner>.2`` (then ``.3``, ...) instead. The kernel drops the lock when its process dies, even of
SIGKILL, so a restarted follower with the same replica id finds and adopts its previous directory.
Within one process, caches of the same owner name are the same owner (a follower re-created in the
process adopts its predecessor's directory, as a restarted process would); the lock is held until the
last of them closes.

A version is written by the reader (``Stream.write_into``) into an ``.incoming-*`` directory this module
made, then renamed into place here: every name in the owner's directory is this module's, so the leftovers
of a follower killed mid-write are removed by the next owner of the directory. Besides those and version
directories of its own, it deletes, for an *ephemeral* owner (a replay), the owner's directory when it
closes (and the leftovers of an ephemeral owner that died, once nobody holds their lock).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from pathlib import Path

from ..format import MARKER_FILE, parse_version_name, version_name
from ..locks import LOCK_FILE, try_lock, unlock
from ..reader import Stream

log = logging.getLogger("ckptstream.follow")

INCOMING_PREFIX = ".incoming-"
"""A version being written; what a killed follower leaves, removed by the directory's next owner."""
EPHEMERAL_FILE = ".ephemeral"
"""Present in the directory of an owner whose cache is removed when it closes (a replay)."""
MAX_OWNER_SUFFIX = 64

# Owner directories this process holds: path -> [lock file descriptor, number of open caches].
_held: dict[Path, list[int]] = {}
_held_lock = threading.Lock()


def default_cache_dir(expected_bytes: int = 0) -> Path:
    """/dev/shm/ckptstream when it has room for three copies of the model, else ~/.cache/ckptstream/follow."""
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 3 * expected_bytes + (256 << 20):
        return shm / "ckptstream"
    return Path.home() / ".cache" / "ckptstream" / "follow"


def safe_owner(name: str) -> str:
    """``name`` reduced to a plain directory name (letters, digits, ``.``, ``_``, ``-``)."""
    cleaned = "".join(c if c.isalnum() or c in "._-" else "-" for c in name).lstrip(".-")
    return cleaned or "follower"


class VersionCache:
    """Decoded versions of one stream, in a directory owned by one follower until ``close()``.

    Args:
        root: the cache root shared by followers (``--cache-dir``).
        stream_id: the stream's identity (versions of different streams never mix).
        owner: the follower's stable name (its replica id): a restarted follower of the same name adopts
            the directory; a second live process of the same name gets a directory of its own.
        ephemeral: remove the directory on ``close()`` (replays: nobody adopts it later).
    """

    def __init__(self, root: str | os.PathLike[str], stream_id: str, owner: str, *, ephemeral: bool = False):
        self.stream_dir = Path(root).expanduser().absolute() / stream_id
        self.stream_dir.mkdir(parents=True, exist_ok=True)
        self.ephemeral = ephemeral
        self._reclaim_dead_ephemeral()
        base = safe_owner(owner)
        for attempt in range(1, MAX_OWNER_SUFFIX + 1):
            name = base if attempt == 1 else f"{base}.{attempt}"
            if _acquire(self.stream_dir / name):
                break
        else:
            raise OSError(f"{MAX_OWNER_SUFFIX} followers named {base!r} already own caches in {self.stream_dir}")
        if attempt > 1:
            log.warning("another process owns the cache %s; using %s", self.stream_dir / base, name)
        self.owner = name
        self.dir = self.stream_dir / name
        self._open = True
        if ephemeral:
            (self.dir / EPHEMERAL_FILE).touch()

    def path(self, version: int) -> Path:
        """Where ``version`` is (or would be) materialized."""
        return self.dir / version_name(version)

    def versions(self) -> list[int]:
        """Complete cached versions (a materialized directory has its marker; partial ones have none)."""
        found = []
        for child in self.dir.iterdir():
            version = parse_version_name(child.name)
            if version is not None and (child / MARKER_FILE).exists():
                found.append(version)
        return sorted(found)

    def materialize(self, stream: Stream, version: int, base: int | None, *, holder: str = "follower") -> Path:
        """Decode ``version`` into the cache, applying its delta to the cached ``base`` if given; the
        version's directory appears complete or not at all. ``holder`` names the lease held meanwhile."""
        incoming = self.dir / f"{INCOMING_PREFIX}{version_name(version)}"
        shutil.rmtree(incoming, ignore_errors=True)  # a failed earlier attempt of this owner
        incoming.mkdir()
        try:
            stream.write_into(version, incoming, base_dir=self.path(base) if base is not None else None,
                              holder=holder)
            target = self.path(version)
            if target.exists():  # a damaged copy being replaced
                shutil.rmtree(target)
            os.rename(incoming, target)
            return target
        finally:
            shutil.rmtree(incoming, ignore_errors=True)

    def prune(self, keep: set[int]) -> None:
        """Remove every cached version of this owner not in ``keep``, and versions left half-written."""
        for child in self.dir.iterdir():
            version = parse_version_name(child.name)
            if (version is not None and version not in keep) or child.name.startswith(INCOMING_PREFIX):
                shutil.rmtree(child, ignore_errors=True)

    def close(self) -> None:
        """Give the directory up (and remove it if ephemeral); a later owner of the same name adopts it."""
        if not self._open:
            return
        self._open = False
        with _held_lock:
            held = _held[self.dir]
            held[1] -= 1
            if held[1]:
                return
            del _held[self.dir]
            if self.ephemeral:
                shutil.rmtree(self.dir, ignore_errors=True)  # still holding the lock: nobody else is inside
            unlock(held[0])

    def __enter__(self) -> VersionCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _reclaim_dead_ephemeral(self) -> None:
        """Remove directories of ephemeral owners that died without closing (their lock is free)."""
        for child in self.stream_dir.iterdir():
            if not (child / EPHEMERAL_FILE).exists():
                continue
            with _held_lock:
                fd = None if child in _held else _try_lock(child, create=False)
                if fd is None:
                    continue  # its owner is alive (maybe this process)
                try:
                    shutil.rmtree(child, ignore_errors=True)
                finally:
                    unlock(fd)


def _acquire(directory: Path) -> bool:
    """Own ``directory`` (this process already does, or its lock was free)."""
    with _held_lock:
        held = _held.get(directory)
        if held is not None:
            held[1] += 1
            return True
        fd = _try_lock(directory)
        if fd is None:
            return False
        _held[directory] = [fd, 1]
        return True


def _try_lock(directory: Path, create: bool = True) -> int | None:
    """An exclusive, non-blocking flock on ``directory/.lock`` (the descriptor), or None if held."""
    if create:
        directory.mkdir(exist_ok=True)
    return try_lock(directory / LOCK_FILE, create=create)
