"""A stream in a directory of a POSIX file system (local disk, NFS, Lustre).

Writes go to a unique temporary file that is fsynced and renamed into place; ``put_if_absent`` links the
temporary file to its final name (link(2) fails if the name exists, atomically, also on NFS). Ranged reads
use pread on one descriptor from several threads; changes are watched through inotify (watchdog) when it
is installed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import stat
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any

from ..errors import IntegrityError, StorageCapabilityError
from .base import (SMALL_READ_BLOCK, Capabilities, Entry, Storage, check_ranges, checked_small, concurrently,
                   short_read, temp_name)

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

    def read_small(self, path: str, limit: int) -> bytes:
        # O_NONBLOCK: opening a FIFO blocks until a writer comes, for ever; regular files ignore the flag.
        fd = os.open(self._abs(path), os.O_RDONLY | os.O_NONBLOCK)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise IntegrityError("not a regular file (a FIFO, a device or a directory), so not read", file=path,
                                     hint="ckptstream writes only regular files here: remove it")
            chunks: list[bytes] = []
            left = limit + 1
            while left > 0 and (chunk := os.read(fd, min(left, SMALL_READ_BLOCK))):
                chunks.append(chunk)
                left -= len(chunk)
        finally:
            os.close(fd)
        return checked_small(path, b"".join(chunks), limit)

    def read_into(self, path: str, offset: int, buffer: memoryview) -> None:
        with open(self._abs(path), "rb", buffering=0) as f:
            f.seek(offset)
            done = 0
            while done < len(buffer):
                n = f.readinto(buffer[done:])
                if not n:
                    raise EOFError(f"{path}: wanted {len(buffer)} bytes at {offset}, file ends after {done}")
                done += n

    def read_ranges(self, path: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        check_ranges(ranges)
        buffers = [bytearray(end - start) for start, end in ranges]
        self.read_ranges_into(path, [(start, memoryview(b)) for (start, _), b in zip(ranges, buffers)])
        return [bytes(b) for b in buffers]

    def read_ranges_into(self, path: str, targets: Sequence[tuple[int, memoryview]]) -> None:
        fd = os.open(self._abs(path), os.O_RDONLY)
        try:
            def fill(target: tuple[int, memoryview]) -> None:
                offset, buffer = target
                done = 0
                while done < len(buffer):  # preadv fills the caller's buffer without a copy
                    n = os.preadv(fd, [buffer[done:]], offset + done)
                    if not n:
                        raise short_read(path, offset, len(buffer), done)
                    done += n

            concurrently(fill, targets)
        finally:
            os.close(fd)

    def will_read(self, path: str, offset: int, length: int) -> None:
        # Each read opens the file anew, so the kernel's read-ahead never sees a sequence: asked for, it
        # reads these bytes while the caller works on the last ones. A hint: nothing here fails a read
        # (macOS has no posix_fadvise; the read itself reports a missing file).
        if not hasattr(os, "posix_fadvise"):
            return
        with contextlib.suppress(OSError):
            fd = os.open(self._abs(path), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)

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

    def touch(self, path: str) -> None:
        os.utime(self._abs(path))

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
