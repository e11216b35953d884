"""Storages that wrap another one and change what it may do, without touching the backend."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import IO

from .base import Entry, RefusesWrites, Storage, Watch


class WrapperStorage(Storage):
    """Another storage, every operation passed through unchanged: the base of wrappers, which override only
    what they change (zarr's ``WrapperStore``)."""

    def __init__(self, inner: Storage):
        self.inner = inner
        self.url = inner.url
        self.capabilities = inner.capabilities

    def read(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        return self.inner.read(path, start, end)

    def read_small(self, path: str, limit: int) -> bytes:
        return self.inner.read_small(path, limit)

    def read_into(self, path: str, offset: int, buffer: memoryview) -> None:
        self.inner.read_into(path, offset, buffer)

    def read_ranges(self, path: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        return self.inner.read_ranges(path, ranges)

    def read_ranges_into(self, path: str, targets: Sequence[tuple[int, memoryview]]) -> None:
        self.inner.read_ranges_into(path, targets)

    def will_read(self, path: str, offset: int, length: int) -> None:
        self.inner.will_read(path, offset, length)

    def open_read(self, path: str) -> IO[bytes]:
        return self.inner.open_read(path)

    def open_write(self, path: str) -> contextlib.AbstractContextManager[IO[bytes]]:
        return self.inner.open_write(path)

    def put_if_absent(self, path: str, data: bytes) -> None:
        self.inner.put_if_absent(path, data)

    def put(self, path: str, data: bytes) -> None:
        self.inner.put(path, data)

    def touch(self, path: str) -> None:
        self.inner.touch(path)

    def list(self, path: str) -> list[Entry]:
        return self.inner.list(path)

    def size(self, path: str) -> int:
        return self.inner.size(path)

    def exists(self, path: str) -> bool:
        return self.inner.exists(path)

    def delete(self, path: str) -> None:
        self.inner.delete(path)

    def delete_tree(self, path: str) -> None:
        self.inner.delete_tree(path)

    def watch(self, path: str, callback: Callable[[], None]) -> Watch | None:
        return self.inner.watch(path, callback)


class ReadOnlyStorage(RefusesWrites, WrapperStorage):
    """A read-only view of another storage: reads, listings and watches pass through, every write raises
    StorageCapabilityError (a reader that must never change the stream it reads, such as a verifier)."""

    def __init__(self, inner: Storage):
        super().__init__(inner)
        self.capabilities = dataclasses.replace(inner.capabilities, writable=False, put_if_absent=False)
