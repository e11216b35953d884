"""A storage that counts the wall-clock seconds its reads are in flight (the fetch part of a pull)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from typing import Iterator

from .base import Entry, Storage
from .wrapper import WrapperStorage


class TimedReads(WrapperStorage):
    """Another storage, counting the seconds during which at least one request that reads (``read*``,
    ``size``, ``exists``, ``list``) is in flight: a pull reads on many threads at once, so this is the union
    of their intervals, not their sum. ``read_seconds()`` before and after a pull gives its fetch time; the
    rest of the pull's wall time is spent decoding with no read outstanding."""

    def __init__(self, inner: Storage):
        super().__init__(inner)
        self._lock = threading.Lock()
        self._in_flight = 0
        self._since = 0.0
        self._seconds = 0.0

    def read_seconds(self) -> float:
        """Seconds with a read in flight so far (monotonic)."""
        with self._lock:
            return self._seconds + (time.monotonic() - self._since if self._in_flight else 0.0)

    @contextlib.contextmanager
    def _reading(self) -> Iterator[None]:
        with self._lock:
            if not self._in_flight:
                self._since = time.monotonic()
            self._in_flight += 1
        try:
            yield
        finally:
            with self._lock:
                self._in_flight -= 1
                if not self._in_flight:
                    self._seconds += time.monotonic() - self._since

    def read(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        with self._reading():
            return self.inner.read(path, start, end)

    def read_small(self, path: str, limit: int) -> bytes:
        with self._reading():
            return self.inner.read_small(path, limit)

    def read_into(self, path: str, offset: int, buffer: memoryview) -> None:
        with self._reading():
            self.inner.read_into(path, offset, buffer)

    def read_ranges(self, path: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        with self._reading():
            return self.inner.read_ranges(path, ranges)

    def read_ranges_into(self, path: str, targets: Sequence[tuple[int, memoryview]]) -> None:
        with self._reading():
            self.inner.read_ranges_into(path, targets)

    def list(self, path: str) -> list[Entry]:
        with self._reading():
            return self.inner.list(path)

    def size(self, path: str) -> int:
        with self._reading():
            return self.inner.size(path)

    def exists(self, path: str) -> bool:
        with self._reading():
            return self.inner.exists(path)
