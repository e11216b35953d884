"""A storage that measures its reads: the wall-clock seconds they are in flight (the fetch part of a pull)
and the bytes they return (what was read from storage, whatever the manifests say)."""

from __future__ import annotations

import contextlib
import io
import threading
import time
from collections.abc import Sequence
from typing import IO, Iterator

from .base import Entry, Storage
from .wrapper import WrapperStorage


class TimedReads(WrapperStorage):
    """Another storage, counting the seconds during which at least one request that reads (``read*``,
    ``size``, ``exists``, ``list``) is in flight: a pull reads on many threads at once, so this is the union
    of their intervals, not their sum. ``read_seconds()`` before and after a pull gives its fetch time; the
    rest of the pull's wall time is spent decoding with no read outstanding.

    It also counts the bytes every read returns (``bytes_read()``), file objects of ``open_read`` included:
    placed right over a backend, that is what was read from the storage (a chunk read whole to serve a few
    of its bytes counts whole, a byte served twice is counted twice). Listings and metadata count no bytes."""

    def __init__(self, inner: Storage):
        super().__init__(inner)
        self._lock = threading.Lock()
        self._in_flight = 0
        self._since = 0.0
        self._seconds = 0.0
        self._bytes = 0

    def read_seconds(self) -> float:
        """Seconds with a read in flight so far (monotonic)."""
        with self._lock:
            return self._seconds + (time.monotonic() - self._since if self._in_flight else 0.0)

    def bytes_read(self) -> int:
        """Bytes the reads have returned so far (monotonic)."""
        with self._lock:
            return self._bytes

    def count(self, n: int) -> None:
        """Add ``n`` bytes read (the file objects of ``open_read`` call it as they are read)."""
        with self._lock:
            self._bytes += n

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
            data = self.inner.read(path, start, end)
        self.count(len(data))
        return data

    def read_small(self, path: str, limit: int) -> bytes:
        with self._reading():
            data = self.inner.read_small(path, limit)
        self.count(len(data))
        return data

    def read_into(self, path: str, offset: int, buffer: memoryview) -> None:
        with self._reading():
            self.inner.read_into(path, offset, buffer)
        self.count(len(buffer))

    def read_ranges(self, path: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        with self._reading():
            datas = self.inner.read_ranges(path, ranges)
        self.count(sum(len(d) for d in datas))
        return datas

    def read_ranges_into(self, path: str, targets: Sequence[tuple[int, memoryview]]) -> None:
        with self._reading():
            self.inner.read_ranges_into(path, targets)
        self.count(sum(len(buffer) for _, buffer in targets))

    def open_read(self, path: str) -> IO[bytes]:
        return io.BufferedReader(_CountedFile(self.inner.open_read(path), self))

    def list(self, path: str) -> list[Entry]:
        with self._reading():
            return self.inner.list(path)

    def size(self, path: str) -> int:
        with self._reading():
            return self.inner.size(path)

    def exists(self, path: str) -> bool:
        with self._reading():
            return self.inner.exists(path)


class _CountedFile(io.RawIOBase):
    """A sequential reader whose reads are counted by a ``TimedReads``."""

    def __init__(self, inner: IO[bytes], meter: TimedReads):
        self._inner = inner
        self._meter = meter

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        view = memoryview(buffer)
        with self._meter._reading():
            data = self._inner.read(len(view))
        self._meter.count(len(data))
        view[:len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self._inner.close()
        super().close()
