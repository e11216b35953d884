"""The storage interface: the ``Storage`` ABC, its declared ``Capabilities``, listing entries and watches.

A small interface in the manner of zarr's ``Store``: paths are ``/``-separated and relative to the stream
root; a backend declares what it can do in a frozen ``Capabilities`` record instead of callers guessing from
its type; ``put_if_absent`` is a real primitive of each backend, never check-then-write. Every write goes
through a uniquely named temporary file (or an upload that completes atomically), so a crashed writer never
leaves a partial file under a final name. Storage never sees tensors.
"""

from __future__ import annotations

import contextlib
import shutil
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO, Protocol, TypeVar

from ..errors import IntegrityError, StorageCapabilityError
from ..format import TEMP_PREFIX

# Ranges one ``read_ranges`` call fetches at once: enough to fill a link to an object store (each request
# is latency-bound), few enough not to exhaust its connection pool or the file descriptors of a POSIX host.
MAX_CONCURRENT_READS = 16
RANGE_CHUNK_BYTES = 8 << 20
"""Large reads are split into ranges of this size, read concurrently: large enough to amortize a request's
latency, small enough that ``MAX_CONCURRENT_READS`` of them in flight stay a bounded buffer."""

SMALL_READ_BLOCK = 1 << 20
"""``read_small`` reads a file in blocks of at most this size: asking for its whole limit at once would
allocate the limit (64 MiB for a manifest), however small the file."""

_T = TypeVar("_T")
_R = TypeVar("_R")


@dataclass(frozen=True)
class Capabilities:
    """What a storage backend can do, declared by the backend.

    Attributes:
        writable: files can be written, replaced and deleted (``open_write``, ``put``, ``delete``,
            ``delete_tree``); without it each of these raises StorageCapabilityError.
        put_if_absent: ``put_if_absent`` is an atomic, exclusive create, so that of two concurrent committers
            exactly one wins; without it ``put_if_absent`` raises StorageCapabilityError (and a stream cannot
            be published there).
        listing: ``list`` enumerates a directory; without it ``list`` raises StorageCapabilityError and
            readers must probe names they know.
        ranged_reads: reading a byte range transfers only that range; without it ranged reads still work but
            fetch the whole file.
        notifications: ``watch`` can report changes; they are a hint that wakes a poller early, never a
            replacement for polling (inotify does not see other NFS clients' writes).
        posix: paths are files of this machine's file system (``Storage.is_posix``).
    """

    writable: bool = True
    put_if_absent: bool = True
    listing: bool = True
    ranged_reads: bool = True
    notifications: bool = False
    posix: bool = False

    def __post_init__(self) -> None:
        if self.put_if_absent and not self.writable:
            raise ValueError("a backend that cannot write cannot create files if absent")


@dataclass(frozen=True)
class Entry:
    """One child of a listed directory."""

    name: str
    is_dir: bool
    size: int
    mtime: float | None  # seconds since the epoch; None where the backend has none (object-store prefixes)


class Watch(Protocol):
    """A running change notification, returned by ``Storage.watch``."""

    def stop(self) -> None:
        """Stop reporting changes and release what the watch holds (threads, inotify descriptors)."""


def temp_name(name: str) -> str:
    """A temporary name beside ``name``, unique to this writer (a shared name corrupts caches on NFS)."""
    return f"{TEMP_PREFIX}{uuid.uuid4().hex}-{name}"


def check_ranges(ranges: Sequence[tuple[int, int]]) -> None:
    """Refuse byte ranges ``[start, end)`` that are not ``0 <= start <= end`` (ValueError)."""
    for start, end in ranges:
        if not 0 <= start <= end:
            raise ValueError(f"invalid byte range [{start}, {end})")


def chunk_spans(start: int, end: int) -> list[tuple[int, int]]:
    """``[start, end)`` as consecutive ranges of at most ``RANGE_CHUNK_BYTES`` (none for an empty range)."""
    return [(a, min(a + RANGE_CHUNK_BYTES, end)) for a in range(start, end, RANGE_CHUNK_BYTES)]


def short_read(path: str, offset: int, wanted: int, got: int) -> EOFError:
    """The error of a read that found fewer bytes than it asked for (the file is shorter than expected)."""
    return EOFError(f"{path}: wanted {wanted} bytes at {offset}, file has {got}")


def checked_small(path: str, data: bytes, limit: int) -> bytes:
    """``data``, the first at most ``limit + 1`` bytes of a file, if the file has at most ``limit`` bytes;
    else the IntegrityError of ``Storage.read_small`` (the one definition of it, for every backend)."""
    if len(data) > limit:
        raise IntegrityError(f"over the {limit}-byte limit of this file (read no further)", file=path,
                             hint="ckptstream writes it far smaller: it is damaged or was put there by something "
                                  "else; remove it or put the right file back")
    return data


def concurrently(function: Callable[[_T], _R], items: Sequence[_T]) -> list[_R]:
    """``[function(item) for item in items]``, at most ``MAX_CONCURRENT_READS`` at once; the first error of
    any item is raised once all have finished."""
    if len(items) <= 1:
        return [function(item) for item in items]
    with ThreadPoolExecutor(min(MAX_CONCURRENT_READS, len(items)), thread_name_prefix="ckptstream-read") as pool:
        futures = [pool.submit(function, item) for item in items]
    return [future.result() for future in futures]


class Storage(ABC):
    """Byte storage rooted at a stream URL.

    Attributes:
        url: where the storage is, for messages.
        capabilities: what the backend can do (see :class:`Capabilities`).
    """

    url: str
    capabilities: Capabilities

    @property
    def is_posix(self) -> bool:
        """Paths are files of this machine's file system (inotify may see local writes)."""
        return self.capabilities.posix

    @property
    def atomic_create(self) -> bool:
        """``put_if_absent`` is atomic, so concurrent committers cannot both win."""
        return self.capabilities.put_if_absent

    # ------------------------------------------------------------------------------------------ reading

    @abstractmethod
    def read(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of a file (all of it by default; fewer at the end of the file).
        Raises FileNotFoundError."""

    def read_small(self, path: str, limit: int) -> bytes:
        """The whole of a small file that may not be trusted (a manifest, ``stream.json``, a record, the
        latest-version hint), reading at most ``limit + 1`` bytes of it however long it is, so that a
        file that never ends cannot hang the reader nor fill its memory.

        Raises:
            FileNotFoundError: no such file.
            IntegrityError: the file has more than ``limit`` bytes, or is not a regular file (a FIFO, a
                device, a directory: POSIX, which opens it without blocking).
        """
        return checked_small(path, self.read(path, 0, limit + 1), limit)

    def read_into(self, path: str, offset: int, buffer: memoryview) -> None:
        """Fill ``buffer`` with the file's bytes from ``offset``; a short file is an EOFError."""
        if not len(buffer):
            return
        data = self.read(path, offset, offset + len(buffer))
        if len(data) != len(buffer):
            raise short_read(path, offset, len(buffer), len(data))
        buffer[:] = data

    def read_ranges(self, path: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """The bytes of each range ``[start, end)`` of one file, fetched concurrently (at most
        ``MAX_CONCURRENT_READS`` at once), in the order asked. A range past the end of the file is an
        EOFError; a missing file a FileNotFoundError."""
        check_ranges(ranges)

        def one(span: tuple[int, int]) -> bytes:
            start, end = span
            data = self.read(path, start, end) if end > start else b""
            if len(data) != end - start:
                raise short_read(path, start, end - start, len(data))
            return data

        return concurrently(one, ranges)

    def read_ranges_into(self, path: str, targets: Sequence[tuple[int, memoryview]]) -> None:
        """Fill each ``buffer`` of ``(offset, buffer)`` with the file's bytes from ``offset``, concurrently
        (at most ``MAX_CONCURRENT_READS`` at once); a short file is an EOFError."""
        concurrently(lambda target: self.read_into(path, *target), targets)

    def will_read(self, path: str, offset: int, length: int) -> None:
        """A hint that bytes ``[offset, offset + length)`` of a file are read soon: a backend that can fetch
        them in the background starts it (POSIX: the kernel's read-ahead); the others ignore it."""
        return None

    @abstractmethod
    def open_read(self, path: str) -> IO[bytes]:
        """A file object for reading a file sequentially."""

    # ------------------------------------------------------------------------------------------ writing

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

    def touch(self, path: str) -> None:
        """Make a file's modification time (what ``list`` reports, what gc's grace period counts from) now,
        its bytes unchanged: a writer that reuses a file written long ago makes it count as written now.
        Raises FileNotFoundError.

        This default writes the file again (read back in pieces of ``RANGE_CHUNK_BYTES``); backends with a
        cheaper way override it."""
        with self.open_read(path) as source, self.open_write(path) as out:
            shutil.copyfileobj(source, out, RANGE_CHUNK_BYTES)

    # ------------------------------------------------------------------------------------------ metadata

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

    # ------------------------------------------------------------------------------------------ changes

    def watch(self, path: str, callback: Callable[[], None]) -> Watch | None:
        """Call ``callback()`` (from another thread) when files under the directory ``path`` change; None
        if this backend cannot notify (``capabilities.notifications`` is false). A notification is a hint
        to look now: callers keep polling, since no backend sees every writer."""
        return None


def capability_error(storage: Storage, operation: str, path: str) -> StorageCapabilityError:
    """The error of a write that ``storage`` cannot do (a read-only backend)."""
    return StorageCapabilityError(f"storage {storage.url} is read-only; cannot {operation}", file=path,
                                  hint="Write to the stream's own storage (a POSIX path or an S3-compatible "
                                       "object store), not to a read-only view of it")


class RefusesWrites:
    """The writes of a storage that cannot write (``capabilities.writable`` false): each raises
    StorageCapabilityError. Mixed in before ``Storage`` (or a wrapper) by read-only backends and views."""

    def open_write(self, path: str) -> contextlib.AbstractContextManager[IO[bytes]]:
        raise capability_error(self, "write a file", path)  # type: ignore[arg-type]

    def put_if_absent(self, path: str, data: bytes) -> None:
        raise capability_error(self, "create a file", path)  # type: ignore[arg-type]

    def put(self, path: str, data: bytes) -> None:
        raise capability_error(self, "write a file", path)  # type: ignore[arg-type]

    def touch(self, path: str) -> None:
        raise capability_error(self, "touch a file", path)  # type: ignore[arg-type]

    def delete(self, path: str) -> None:
        raise capability_error(self, "delete a file", path)  # type: ignore[arg-type]

    def delete_tree(self, path: str) -> None:
        raise capability_error(self, "delete a directory", path)  # type: ignore[arg-type]
