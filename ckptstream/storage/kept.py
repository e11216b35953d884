"""``KeptReads``: reads kept in memory for a while, so that a second reader of the same bytes reads none.

A read-through cache in the manner of zarr's caching store, but for one task and bounded: only while a
``keeping`` block runs are the ranges read kept (up to ``max_bytes`` together; what would exceed it is read
and not kept), and a kept range serves later reads of that range or of parts of it (the change of a batch of
tensors is read as one range, the decode reads them one by one) until each of its bytes has been served once,
then is dropped. ``clear()`` drops what nobody read again. A follower keeps the deltas it builds an update's
change from, and the decode of that version, which reads the same ranges of the same files, reads them from
memory: each delta is read from storage once per update. Data files are immutable (their names are unique to
their writer), so a kept range never goes stale.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

from .base import Storage
from .wrapper import WrapperStorage


class KeptReads(WrapperStorage):
    """Reads of ``inner``, those made inside ``keeping()`` kept for one more read of the same range;
    everything else passes through."""

    def __init__(self, inner: Storage):
        super().__init__(inner)
        self._lock = threading.Lock()
        self._kept: dict[tuple[str, int, int], bytes] = {}
        self._unserved: dict[tuple[str, int, int], int] = {}  # per kept range, its bytes no read has had yet
        self._by_path: dict[str, list[tuple[str, int, int]]] = {}  # the kept ranges of each file
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
            self._kept.clear()
            self._unserved.clear()
            self._by_path.clear()
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
            return self._max_bytes is not None or bool(self._kept)

    def _take(self, key: tuple[str, int, int]) -> bytes | None:
        """The bytes of ``key`` from a kept range holding them, if any; a range whose every byte has been served is
        dropped."""
        path, start, end = key
        with self._lock:
            holder = key if key in self._kept else next(
                (k for k in self._by_path.get(path, ()) if k[1] <= start and end <= k[2]), None)
            if holder is None:
                return None
            kept = self._kept[holder]
            data = kept if holder == key else kept[start - holder[1]:end - holder[1]]
            self._unserved[holder] -= end - start
            if self._unserved[holder] <= 0:
                del self._kept[holder], self._unserved[holder]
                self._by_path[path].remove(holder)
                self._kept_bytes -= len(kept)
            return data

    def _keep(self, key: tuple[str, int, int], data: bytes | memoryview) -> None:
        with self._lock:
            if self._max_bytes is None or key in self._kept or self._kept_bytes + len(data) > self._max_bytes:
                return
            if len(data) != key[2] - key[1]:
                return  # a read at the end of the file: not the range asked, not kept
            self._kept[key] = bytes(data)
            self._unserved[key] = len(data)
            self._by_path.setdefault(key[0], []).append(key)
            self._kept_bytes += len(data)
