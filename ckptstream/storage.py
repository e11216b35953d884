"""Byte storage under a stream root: POSIX paths (local disk, NFS, Lustre) and fsspec object stores.

A small interface in the manner of zarr's ``Store``: paths are ``/``-separated and relative to the stream
root; capability flags say what a backend can do; ``put_if_absent`` is a real primitive of each backend
(hard link on POSIX, a conditional PUT with ``If-None-Match: *`` on S3), never check-then-write. Every write
goes through a uniquely named temporary file that is moved into place, so a crashed writer leaves only
``.tmp-*`` debris and never a partial file under a final name. Storage never sees tensors.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import shutil
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import IO, Any, Iterator, Mapping

from .errors import StorageCapabilityError
from .format import TEMP_PREFIX

_LOCAL_PROTOCOLS = ("", "file", "local")
# Object stores whose fsspec backend turns open(path, "xb") into an atomic put-if-absent.
_CONDITIONAL_PUT_PROTOCOLS = ("s3", "s3a")


@dataclass(frozen=True)
class Entry:
    """One child of a listed directory."""

    name: str
    is_dir: bool
    size: int
    mtime: float | None  # seconds since the epoch; None where the backend has none (object-store prefixes)


def temp_name(name: str) -> str:
    """A temporary name beside ``name``, unique to this writer (a shared name corrupts caches on NFS)."""
    return f"{TEMP_PREFIX}{uuid.uuid4().hex}-{name}"


class Storage(ABC):
    """Byte storage rooted at a stream URL.

    Capabilities:
        is_posix: paths are files of this machine's file system (inotify may see local writes).
        atomic_create: ``put_if_absent`` is atomic, so concurrent committers cannot both win.
    """

    url: str
    is_posix: bool = False
    atomic_create: bool = True

    @abstractmethod
    def read(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of a file (all of it by default). Raises FileNotFoundError."""

    def read_into(self, path: str, offset: int, buffer: memoryview) -> None:
        """Fill ``buffer`` with the file's bytes from ``offset``; a short file is an EOFError."""
        if not len(buffer):
            return
        data = self.read(path, offset, offset + len(buffer))
        if len(data) != len(buffer):
            raise EOFError(f"{path}: wanted {len(buffer)} bytes at {offset}, file has {len(data)}")
        buffer[:] = data

    @abstractmethod
    def open_read(self, path: str) -> IO[bytes]:
        """A file object for reading a file sequentially."""

    @abstractmethod
    def open_write(self, path: str) -> contextlib.AbstractContextManager[IO[bytes]]:
        """Write a file: it appears under ``path``, durable, only when the block exits without error."""

    @abstractmethod
    def put_if_absent(self, path: str, data: bytes) -> None:
        """Create ``path`` with ``data`` atomically; FileExistsError if it exists (nothing is changed)."""

    def put(self, path: str, data: bytes) -> None:
        """Create or atomically replace a small file."""
        with self.open_write(path) as f:
            f.write(data)

    @abstractmethod
    def list(self, path: str) -> list[Entry]:
        """Children of a directory (empty if it does not exist), fresh from the backend."""

    @abstractmethod
    def size(self, path: str) -> int:
        """Size of a file in bytes. Raises FileNotFoundError."""

    @abstractmethod
    def exists(self, path: str) -> bool:
        """True if a file exists at ``path``, asked of the backend now (no cached listing)."""

    @abstractmethod
    def delete(self, path: str) -> None:
        """Remove a file; a missing file is not an error."""

    @abstractmethod
    def delete_tree(self, path: str) -> None:
        """Remove a directory and everything under it; a missing one is not an error."""

    def join(self, path: str) -> str:
        """The full location of a path, for messages and for tools that read it directly."""
        return f"{self.url.rstrip('/')}/{path}"


class PosixStorage(Storage):
    """A directory of a POSIX file system. Commits with link(2), which fails if the target exists."""

    is_posix = True

    def __init__(self, root: str):
        self.root = os.path.abspath(os.path.expanduser(root))
        self.url = self.root

    def _abs(self, path: str) -> str:
        return os.path.join(self.root, *path.split("/")) if path else self.root

    def read(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        with open(self._abs(path), "rb") as f:
            if start:
                f.seek(start)
            return f.read() if end is None else f.read(end - (start or 0))

    def read_into(self, path: str, offset: int, buffer: memoryview) -> None:
        with open(self._abs(path), "rb", buffering=0) as f:
            f.seek(offset)
            done = 0
            while done < len(buffer):
                n = f.readinto(buffer[done:])
                if not n:
                    raise EOFError(f"{path}: wanted {len(buffer)} bytes at {offset}, file ends after {done}")
                done += n

    def open_read(self, path: str) -> IO[bytes]:
        return open(self._abs(path), "rb")

    @contextlib.contextmanager
    def open_write(self, path: str) -> Iterator[IO[bytes]]:
        target = self._abs(path)
        directory = os.path.dirname(target)
        os.makedirs(directory, exist_ok=True)
        temp = os.path.join(directory, temp_name(os.path.basename(target)))
        try:
            with open(temp, "xb") as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            os.replace(temp, target)
            fsync_path(directory)
        finally:
            _remove_quietly(temp)

    def put_if_absent(self, path: str, data: bytes) -> None:
        target = self._abs(path)
        directory = os.path.dirname(target)
        os.makedirs(directory, exist_ok=True)
        temp = os.path.join(directory, temp_name(os.path.basename(target)))
        try:
            with open(temp, "xb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(temp, target)  # atomic and exclusive, also on NFS
            except OSError as exc:
                if isinstance(exc, FileExistsError):
                    raise
                raise StorageCapabilityError(
                    f"cannot hard-link in {directory} ({exc}); ckptstream commits with link(2)",
                    hint="Use a file system that supports hard links (local disk, NFS, Lustre)") from exc
            fsync_path(directory)
        finally:
            _remove_quietly(temp)

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


class FsspecStorage(Storage):
    """An fsspec file system (S3 through s3fs). Commits with ``open(path, "xb")``: a conditional PUT."""

    def __init__(self, fs: Any, root: str, url: str):
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url
        protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
        self.atomic_create = any(p in _CONDITIONAL_PUT_PROTOCOLS for p in protocols)

    def _abs(self, path: str) -> str:
        return f"{self.root}/{path}" if path else self.root

    def read(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        return self.fs.cat_file(self._abs(path), start=start, end=end)

    def open_read(self, path: str) -> IO[bytes]:
        return self.fs.open(self._abs(path), "rb", block_size=8 << 20, cache_type="readahead")

    @contextlib.contextmanager
    def open_write(self, path: str) -> Iterator[IO[bytes]]:
        # An object appears only when its (multipart) upload completes, so the final name is safe to use.
        f = self.fs.open(self._abs(path), "wb")
        try:
            yield f
        except BaseException:
            with contextlib.suppress(Exception):
                f.discard()  # abort the (multipart) upload: nothing appears
                f.closed = True  # so that garbage collection does not complete the upload
            raise
        f.close()

    def put_if_absent(self, path: str, data: bytes) -> None:
        if not self.atomic_create:
            raise StorageCapabilityError(
                f"storage {self.url} has no atomic put-if-absent, so concurrent commits could be lost",
                hint="Use a POSIX path or an S3-compatible object store")
        with self.fs.open(self._abs(path), "xb") as f:  # s3fs: PUT with If-None-Match: *
            f.write(data)

    def list(self, path: str) -> list[Entry]:
        full = self._abs(path)
        self.fs.invalidate_cache(full)
        try:
            items = self.fs.ls(full, detail=True)
        except FileNotFoundError:
            return []
        entries = []
        for item in items:
            name = item["name"].rstrip("/").rsplit("/", 1)[-1]
            if item["name"].rstrip("/") == full:
                continue
            modified = item.get("LastModified") or item.get("mtime")
            if isinstance(modified, _dt.datetime):
                modified = modified.timestamp()
            entries.append(Entry(name, item["type"] == "directory", int(item.get("size") or 0), modified))
        return entries

    def size(self, path: str) -> int:
        self.fs.invalidate_cache(self._abs(path))
        return int(self.fs.info(self._abs(path))["size"])

    def exists(self, path: str) -> bool:
        full = self._abs(path)
        self.fs.invalidate_cache(full)
        return bool(self.fs.isfile(full))

    def delete(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._abs(path))

    def delete_tree(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self._abs(path), recursive=True)


def open_storage(url: str, storage_options: Mapping[str, Any] | None = None) -> Storage:
    """Storage for a stream URL: a local path or ``file://`` URL, or any fsspec URL (``s3://bucket/p``).

    ``storage_options`` go to the fsspec file system (for s3fs: ``profile``, ``endpoint_url``, ``key``,
    ...). S3 also follows the standard AWS configuration: ``AWS_ENDPOINT_URL``, credentials, profiles.
    """
    import fsspec.core

    protocol, _, rest = url.partition("://")
    if not rest:
        return PosixStorage(url)
    if protocol in _LOCAL_PROTOCOLS:
        return PosixStorage(rest)
    fs, root = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
    return FsspecStorage(fs, root, url.rstrip("/"))


def fsync_path(path: str | os.PathLike[str]) -> None:
    """fsync a file or directory by path (a directory's fsync makes renames and links in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
