"""``KeptReads``: reads kept in memory for a while, so that a second reader of the same bytes reads none.

A read-through cache in the manner of zarr's caching store, but for one task and bounded: only while a
``keeping`` block runs are the ranges read kept (up to ``max_bytes`` together; what would exceed it, or overlap a
range kept already, is read and not kept), and a kept range serves later reads of that range or of parts of it
(the change of a batch of tensors is read as one range, the decode reads them one by one) until as many bytes as
it holds have been served, then is dropped. ``clear()`` drops what nobody read again. A follower keeps the
deltas it builds an update's change from, and the decode of that version, which reads the same ranges of the
same files, reads them from memory: each delta is read from storage once per update. Data files are immutable
(their names are unique to their writer), so a kept range never goes stale.
"""

from __future__ import annotations

import bisect
import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from .base import Storage
from .wrapper import WrapperStorage


class KeptReads(WrapperStorage):
    """Reads of ``inner``, those made inside ``keeping()`` kept for later reads of the same bytes;
    everything else passes through."""

    def __init__(self, inner: Storage):
        super().__init__(inner)
        self._lock = threading.Lock()
        # Per file: the kept ranges' starts, sorted (a read finds the one range that may hold it by bisection: a
        # version's deltas are one file of thousands of ranges), and per start the range.
        self._starts: dict[str, list[int]] = {}
        self._ranges: dict[str, dict[int, _Kept]] = {}
        self._kept_bytes = 0
        self._max_bytes: int | None = None  # keeping, up to this many bytes; None: not keeping

    @property
    def kept_bytes(self) -> int:
        """Bytes kept now."""
        with self._lock:
            return self._kept_bytes

    @contextlib.contextmanager
    def keeping(self, max_bytes: int) -> Iterator[None]:
        """Keep what is read inside the block, at most ``max_bytes`` together (what is kept stays after it,
        until read again or ``clear()``)."""
        with self._lock:
            self._max_bytes = max_bytes
        try:
            yield
        finally:
            with self._lock:
                self._max_bytes = None

    def clear(self) -> None:
        """Drop every kept range."""
        with self._lock:
            self._starts.clear()
            self._ranges.clear()
            self._kept_bytes = 0

    def read(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        if start is None or end is None:
            return self.inner.read(path, start, end)
        data = self._take((path, start, end))
        if data is None:
            data = self.inner.read(path, start, end)
            self._keep((path, start, end), data)
        return data

    def read_into(self, path: str, offset: int, buffer: memoryview) -> None:
        key = (path, offset, offset + len(buffer))
        data = self._take(key)
        if data is None:
            self.inner.read_into(path, offset, buffer)
            self._keep(key, buffer)
        else:
            buffer[:] = data

    def read_ranges(self, path: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        if not self._active():
            return self.inner.read_ranges(path, ranges)
        return Storage.read_ranges(self, path, ranges)  # through read(): each range kept or served

    def read_ranges_into(self, path: str, targets: Sequence[tuple[int, memoryview]]) -> None:
        if not self._active():
            self.inner.read_ranges_into(path, targets)
            return
        Storage.read_ranges_into(self, path, targets)  # through read_into(): each range kept or served

    def _active(self) -> bool:
        with self._lock:
            return self._max_bytes is not None or bool(self._kept_bytes)

    def _take(self, key: tuple[str, int, int]) -> bytes | None:
        """The bytes of ``key`` from the kept range holding them, if any; a range that has served as many bytes
        as it holds is dropped."""
        path, start, end = key
        with self._lock:
            starts = self._starts.get(path)
            if not starts:
                return None
            at = bisect.bisect_right(starts, start) - 1
            kept = self._ranges[path][starts[at]] if at >= 0 else None
            if kept is None or end > kept.end:
                return None
            offset = start - kept.start
            data = kept.data if (offset, end) == (0, kept.end) else kept.data[offset:end - kept.start]
            kept.unserved -= end - start
            if kept.unserved <= 0:
                del starts[at], self._ranges[path][kept.start]
                self._kept_bytes -= len(kept.data)
            return data

    def _keep(self, key: tuple[str, int, int], data: bytes | memoryview) -> None:
        path, start, end = key
        with self._lock:
            if self._max_bytes is None or self._kept_bytes + len(data) > self._max_bytes:
                return
            if len(data) != end - start:
                return  # a read at the end of the file: not the range asked, not kept
            starts = self._starts.setdefault(path, [])
            at = bisect.bisect_left(starts, start)
            ranges = self._ranges.setdefault(path, {})
            if (at > 0 and ranges[starts[at - 1]].end > start) or (at < len(starts) and starts[at] < end):
                return  # overlaps a kept range: each read has one range that may hold it
            starts.insert(at, start)
            ranges[start] = _Kept(start, end, bytes(data), len(data))
            self._kept_bytes += len(data)


@dataclass
class _Kept:
    """A kept range of a file: its bytes, and how many more bytes it serves before it is dropped."""

    start: int
    end: int
    data: bytes
    unserved: int
