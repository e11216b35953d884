"""A stream in a directory of a POSIX file system (local disk, NFS, Lustre).

Writes go to a unique temporary file that is fsynced and renamed into place; ``put_if_absent`` links the
temporary file to its final name (link(2) fails if the name exists, atomically, also on NFS). Ranged reads
use pread on one descriptor from several threads; large ones read what the page cache does not hold with
``O_DIRECT`` (see ``_read_cold``). Changes are watched through inotify (watchdog) when it is installed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import mmap
import os
import shutil
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any

from ..errors import StorageCapabilityError
from .base import (MAX_CONCURRENT_READS, Capabilities, Entry, Storage, check_ranges, concurrently, short_read,
                   temp_name)

# watchdog event types that mean something changed; reads ("opened", "closed_no_write") are not changes,
# and a watcher woken by every reader of the directory would poll in a loop.
_CHANGE_EVENTS = frozenset({"created", "modified", "moved", "deleted", "closed"})


class PosixStorage(Storage):
    """A directory of a POSIX file system. Commits with link(2), which fails if the target exists."""

    def __init__(self, root: str):
        self.root = os.path.abspath(os.path.expanduser(root))
        self.url = self.root
        self.capabilities = Capabilities(posix=True,
                                         notifications=importlib.util.find_spec("watchdog") is not None)

    def _abs(self, path: str) -> str:
        return os.path.join(self.root, *path.split("/")) if path else self.root

    # ------------------------------------------------------------------------------------------ reading

    def read(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        with open(self._abs(path), "rb") as f:
            if start:
                f.seek(start)
            return f.read() if end is None else f.read(max(0, end - (start or 0)))

    def read_into(self, path: str, offset: int, buffer: memoryview) -> None:
        self.read_ranges_into(path, [(offset, buffer)])

    def read_ranges(self, path: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        check_ranges(ranges)
        buffers = [bytearray(end - start) for start, end in ranges]
        self.read_ranges_into(path, [(start, memoryview(b)) for (start, _), b in zip(ranges, buffers)])
        return [bytes(b) for b in buffers]

    def read_ranges_into(self, path: str, targets: Sequence[tuple[int, memoryview]]) -> None:
        fd = os.open(self._abs(path), os.O_RDONLY)
        direct = None
        try:
            if any(len(buffer) >= DIRECT_MIN_BYTES for _, buffer in targets):
                direct = _open_direct(self._abs(path))
                if direct is not None:  # a read that does not wait still starts readahead, unless random
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)

            def fill(target: tuple[int, memoryview]) -> None:
                offset, buffer = target
                done = _read_cold(fd, direct, offset, buffer) if direct is not None else 0
                while done < len(buffer):  # preadv fills the caller's buffer without a copy
                    n = os.preadv(fd, [buffer[done:]], offset + done)
                    if not n:
                        raise short_read(path, offset, len(buffer), done)
                    done += n

            concurrently(fill, targets)
        finally:
            os.close(fd)
            if direct is not None:
                os.close(direct)

    def open_read(self, path: str) -> IO[bytes]:
        return open(self._abs(path), "rb")

    # ------------------------------------------------------------------------------------------ writing

    @contextlib.contextmanager
    def _durable_temp(self, path: str) -> Iterator[tuple[IO[bytes], str, str]]:
        """A new file under a writer-unique temporary name beside ``path``: (file, temp path, target path).
        The file is fsync'd when the block exits without error; the temporary name is always removed."""
        target = self._abs(path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        temp = os.path.join(os.path.dirname(target), temp_name(os.path.basename(target)))
        try:
            with open(temp, "xb") as f:
                yield f, temp, target
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            _remove_quietly(temp)
            raise

    @contextlib.contextmanager
    def open_write(self, path: str) -> Iterator[IO[bytes]]:
        with self._durable_temp(path) as (f, temp, target):
            yield f
        try:
            os.replace(temp, target)
            fsync_path(os.path.dirname(target))
        finally:
            _remove_quietly(temp)

    def put_if_absent(self, path: str, data: bytes) -> None:
        with self._durable_temp(path) as (f, temp, target):
            f.write(data)
        directory = os.path.dirname(target)
        try:
            try:
                os.link(temp, target)  # atomic and exclusive, also on NFS
            except FileExistsError:
                # NFS: when the reply to a link is lost, the client retransmits it, and the server (its
                # duplicate-request cache gone) answers EEXIST for the link this very call made. The target
                # being our own temporary file's inode tells the two apart.
                if not _same_file(temp, target):
                    raise
            except OSError as exc:
                raise StorageCapabilityError(
                    f"cannot hard-link in {directory} ({exc}); ckptstream commits with link(2)",
                    hint="Use a file system that supports hard links (local disk, NFS, Lustre)") from exc
            fsync_path(directory)
        finally:
            _remove_quietly(temp)

    # ------------------------------------------------------------------------------------------ metadata

    def list(self, path: str) -> list[Entry]:
        try:
            with os.scandir(self._abs(path)) as it:
                entries = []
                for e in it:
                    try:
                        st = e.stat()
                    except FileNotFoundError:
                        continue  # removed while listing
                    entries.append(Entry(e.name, e.is_dir(), st.st_size, st.st_mtime))
                return entries
        except (FileNotFoundError, NotADirectoryError):
            return []

    def size(self, path: str) -> int:
        return os.stat(self._abs(path)).st_size

    def exists(self, path: str) -> bool:
        return os.path.isfile(self._abs(path))

    def delete(self, path: str) -> None:
        _remove_quietly(self._abs(path))

    def delete_tree(self, path: str) -> None:
        shutil.rmtree(self._abs(path), ignore_errors=True)

    # ------------------------------------------------------------------------------------------ changes

    def watch(self, path: str, callback: Callable[[], None]) -> _ObserverWatch | None:
        """inotify through watchdog (None if it is not installed). Creates the directory if needed, since
        inotify can only watch what exists. Sees this machine's writes only, not other NFS clients'."""
        if not self.capabilities.notifications:
            return None
        from watchdog.events import FileSystemEvent, FileSystemEventHandler
        from watchdog.observers import Observer

        class Handler(FileSystemEventHandler):
            def on_any_event(self, event: FileSystemEvent) -> None:
                if event.event_type in _CHANGE_EVENTS:
                    callback()

        directory = self._abs(path)
        os.makedirs(directory, exist_ok=True)
        observer = Observer()
        observer.schedule(Handler(), directory)
        observer.daemon = True
        observer.start()
        return _ObserverWatch(observer)


class _ObserverWatch:
    """A watchdog observer as a ``Watch``."""

    def __init__(self, observer: Any):
        self._observer = observer

    def stop(self) -> None:
        self._observer.stop()
        self._observer.join(timeout=10)


DIRECT_MIN_BYTES = 1 << 20
"""Reads at least this large take what the page cache holds and read the rest with ``O_DIRECT``."""
_DIRECT_ALIGN = 4096  # offsets, lengths and memory of O_DIRECT reads: a multiple of any block size in use
_DIRECT_PIECE = 1 << 20
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", 0)


def _open_direct(path: str) -> int | None:
    """A descriptor of ``path`` for ``O_DIRECT`` reads, or None where the file system has none (tmpfs)."""
    if not _O_DIRECT or not _RWF_NOWAIT:
        return None
    try:
        return os.open(path, os.O_RDONLY | _O_DIRECT)
    except OSError:
        return None


class _Bounces:
    """Page-aligned buffers of ``_DIRECT_PIECE`` bytes (plus a block at each end) for ``O_DIRECT`` reads,
    kept for reuse: fresh memory costs a page fault per page on its first touch."""

    def __init__(self, keep: int):
        self._free: list[mmap.mmap] = []
        self._keep = keep
        self._lock = threading.Lock()

    def take(self) -> mmap.mmap:
        with self._lock:
            if self._free:
                return self._free.pop()
        return mmap.mmap(-1, _DIRECT_PIECE + 2 * _DIRECT_ALIGN)

    def give(self, bounce: mmap.mmap) -> None:
        with self._lock:
            if len(self._free) < self._keep:
                self._free.append(bounce)
                return
        bounce.close()


_bounces = _Bounces(keep=MAX_CONCURRENT_READS)


def _read_cold(fd: int, direct: int, offset: int, buffer: memoryview) -> int:
    """Fill a prefix of ``buffer`` with the file's bytes at ``offset`` read with ``O_DIRECT`` into an aligned
    buffer and copied out, unless the page cache holds the range's start (a file just written on this
    host: a read that does not wait, ``RWF_NOWAIT``, tells). Returns the bytes filled: all of them, none
    if cached, or fewer at the end of the file or where the file system refuses ``O_DIRECT`` (the caller
    reads the rest through the page cache).

    A cold read through the page cache costs this machine kind's kernel more CPU than the copy
    (allocating and filling cache pages: 1.0-3.5 s of system time per 1.3 GB against 0.1-0.2 s with
    ``O_DIRECT``, measured), CPU that the decoding threads need; the data are read once, so caching
    them gains nothing."""
    if len(buffer) < DIRECT_MIN_BYTES:
        return 0
    try:  # is the range's first byte cached? (``fd`` has readahead off: the probe reads nothing more)
        os.preadv(fd, [buffer[:1]], offset, _RWF_NOWAIT)
        return 0
    except OSError:  # not cached (BlockingIOError), or the file system cannot tell
        pass
    done = 0
    bounce = _bounces.take()
    try:
        with memoryview(bounce) as view:
            while done < len(buffer):
                start = offset + done
                aligned = start - start % _DIRECT_ALIGN
                want = min(len(buffer) - done, _DIRECT_PIECE)
                span = -(-(start + want - aligned) // _DIRECT_ALIGN) * _DIRECT_ALIGN
                try:
                    n = os.preadv(direct, [view[:span]], aligned)
                except OSError:
                    break
                got = min(n - (start - aligned), want)
                if got <= 0:
                    break
                buffer[done:done + got] = view[start - aligned:start - aligned + got]
                done += got
    finally:
        _bounces.give(bounce)
    return done


def fsync_path(path: str | os.PathLike[str]) -> None:
    """fsync a file or directory by path (a directory's fsync makes renames and links in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # the target was removed meanwhile: it was not ours to keep
        return False


def _remove_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
