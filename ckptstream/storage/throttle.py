"""``ThrottledStorage``: a storage whose reads are limited to a rate in bytes per second (``--bwlimit``).

A wrapper in the manner of ``wrapper.py``: it composes with any backend, and callers (materialize,
mirror, a follower) do not know it is there. One token bucket is shared by every thread reading through
the wrapper, so the limit holds for the sum of concurrent ranged reads. Writes pass through unlimited.
"""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Sequence
from typing import IO

from .base import Storage, check_ranges, concurrently
from .wrapper import WrapperStorage

THROTTLE_PIECE_BYTES = 1 << 20
"""Largest read sent at once under a limit: a big range is fetched in pieces as tokens allow, so that the
rate holds within a transfer too, not only on average over several."""
BURST_SECONDS = 0.1
"""The bucket holds at most this many seconds of the rate: an idle reader may start with that burst."""


class TokenBucket:
    """A token bucket of ``rate`` bytes per second that may go into debt: ``take(n)`` always succeeds and
    sleeps for as long as the bucket is in debt, so the bytes taken by time *t* never exceed
    ``burst + rate × t``, whichever threads take them."""

    def __init__(self, rate: float, burst: float | None = None):
        if not rate > 0:
            raise ValueError(f"a rate must be positive bytes per second, got {rate!r}")
        self.rate = float(rate)
        self.burst = max(1.0, rate * BURST_SECONDS) if burst is None else float(burst)
        self._tokens = self.burst
        self._last = time.monotonic()
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        """Account for ``n`` bytes; block until the bucket is out of debt."""
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate) - n
            self._last = now
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait > 0:
            time.sleep(wait)


class ThrottledStorage(WrapperStorage):
    """A view of another storage whose reads (of every kind, from every thread) together stay within
    ``bytes_per_second``. Listings, metadata, watches and writes pass through unchanged."""

    def __init__(self, inner: Storage, bytes_per_second: float):
        super().__init__(inner)
        self.bucket = TokenBucket(bytes_per_second)

    # ------------------------------------------------------------------------------------------ reading

    def read(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        if end is None:  # up to the end of the file: its size is known only once read
            data = self.inner.read(path, start, end)
            self.bucket.take(len(data))
            return data
        begin = start or 0
        parts = []
        for lo, hi in _pieces(begin, end):
            self.bucket.take(hi - lo)
            part = self.inner.read(path, lo, hi)
            parts.append(part)
            if len(part) < hi - lo:  # the file ends here
                break
        return b"".join(parts) if parts else self.inner.read(path, begin, end)

    def read_small(self, path: str, limit: int) -> bytes:
        data = self.inner.read_small(path, limit)  # small: taken from the bucket once read, as a whole read
        self.bucket.take(len(data))
        return data

    def read_into(self, path: str, offset: int, buffer: memoryview) -> None:
        for lo, hi in _pieces(0, len(buffer)):
            self.bucket.take(hi - lo)
            self.inner.read_into(path, offset + lo, buffer[lo:hi])

    def read_ranges(self, path: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        check_ranges(ranges)
        buffers = [bytearray(end - start) for start, end in ranges]
        self.read_ranges_into(path, [(start, memoryview(b)) for (start, _), b in zip(ranges, buffers)])
        return [bytes(b) for b in buffers]

    def read_ranges_into(self, path: str, targets: Sequence[tuple[int, memoryview]]) -> None:
        pieces = [(offset + lo, buffer[lo:hi]) for offset, buffer in targets for lo, hi in _pieces(0, len(buffer))]

        def one(piece: tuple[int, memoryview]) -> None:
            self.bucket.take(len(piece[1]))
            self.inner.read_into(path, *piece)

        concurrently(one, pieces)

    def open_read(self, path: str) -> IO[bytes]:
        return io.BufferedReader(_ThrottledFile(self.inner.open_read(path), self.bucket),
                                 buffer_size=THROTTLE_PIECE_BYTES)


def _pieces(start: int, end: int) -> list[tuple[int, int]]:
    """``[start, end)`` cut into consecutive ranges of at most ``THROTTLE_PIECE_BYTES``."""
    return [(lo, min(lo + THROTTLE_PIECE_BYTES, end)) for lo in range(start, end, THROTTLE_PIECE_BYTES)]


class _ThrottledFile(io.RawIOBase):
    """A sequential reader whose reads take their bytes from a shared bucket."""

    def __init__(self, inner: IO[bytes], bucket: TokenBucket):
        self._inner = inner
        self._bucket = bucket

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        view = memoryview(buffer)[:THROTTLE_PIECE_BYTES]
        data = self._inner.read(len(view))
        self._bucket.take(len(data))
        view[:len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self._inner.close()
        super().close()
