"""``ChunkedReads``: reads of an object store served from aligned chunks fetched concurrently.

A reader of a version asks for one range per tensor: hundreds of small ranges, each a request whose
latency (and, on some servers, whose cost) does not shrink with its size. This wrapper turns them into
requests of ``RANGE_CHUNK_BYTES`` aligned chunks, each fetched once, ``MAX_CONCURRENT_READS`` at a time, and
shared by every range that falls into it — the request pattern of a raw parallel GET of the same objects.
A chunk is dropped as soon as all its bytes have been handed out (data files are read once, front to back,
by a decoder), and at most ``max_chunks`` are held: memory stays bounded. Data files are immutable (their
names are unique to their writer), so a chunk never goes stale.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from .base import MAX_CONCURRENT_READS, RANGE_CHUNK_BYTES, Storage, check_ranges, concurrently, short_read
from .wrapper import WrapperStorage


class _Chunk:
    __slots__ = ("future", "handed_out")

    def __init__(self, future: Future[bytes]):
        self.future = future
        self.handed_out = 0


class ChunkedReads(WrapperStorage):
    """Ranged reads of ``inner`` through a bounded cache of aligned chunks; everything else passes through.

    Args:
        inner: the storage read (an object store; POSIX files gain nothing from it).
        max_chunks: chunks held at most (default ``2 * MAX_CONCURRENT_READS``: those in flight and those
            being handed out).
    """

    def __init__(self, inner: Storage, *, max_chunks: int = 2 * MAX_CONCURRENT_READS):
        super().__init__(inner)
        self._max_chunks = max_chunks
        self._chunks: collections.OrderedDict[tuple[str, int], _Chunk] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    @property
    def held_chunks(self) -> int:
        """Chunks held now (fetched or being fetched, not yet handed out whole)."""
        with self._lock:
            return len(self._chunks)

    def clear(self) -> None:
        """Drop every held chunk (a decode is done: what it did not read is not needed)."""
        with self._lock:
            self._chunks.clear()

    def close(self) -> None:
        """Drop the chunks and stop the fetching threads."""
        self.clear()
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    # -------------------------------------------------------------------------------------- chunked reads

    def read(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        if start is None or end is None:
            return self.inner.read(path, start, end)
        check_ranges([(start, end)])
        if end == start:
            return self.inner.read(path, start, end)
        first, last = start // RANGE_CHUNK_BYTES, (end - 1) // RANGE_CHUNK_BYTES
        chunks = [self._chunk(path, index) for index in range(first, last + 1)]
        parts = []
        try:
            for index, chunk in zip(range(first, last + 1), chunks):
                data = chunk.future.result()
                base = index * RANGE_CHUNK_BYTES
                part = data[max(start, base) - base:min(end, base + len(data)) - base]
                parts.append(part)
                self._handed_out(path, index, chunk, len(part), len(data))
                if len(data) < RANGE_CHUNK_BYTES:  # the end of the file
                    break
        except BaseException:
            with self._lock:  # a failed fetch is not kept: the next read asks again
                for index in range(first, last + 1):
                    held = self._chunks.get((path, index))
                    if held is not None and held.future.done() and held.future.exception() is not None:
                        del self._chunks[(path, index)]
            raise
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def read_ranges(self, path: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        check_ranges(ranges)
        return concurrently(lambda span: self._exact(path, *span), ranges)

    # Through ``read`` (the chunks), not the inner storage's own: Storage's implementations do that.
    read_into = Storage.read_into
    read_ranges_into = Storage.read_ranges_into

    def _exact(self, path: str, start: int, end: int) -> bytes:
        data = self.read(path, start, end)
        if len(data) != end - start:
            raise short_read(path, start, end - start, len(data))
        return data

    def _chunk(self, path: str, index: int) -> _Chunk:
        with self._lock:
            chunk = self._chunks.get((path, index))
            if chunk is not None:
                self._chunks.move_to_end((path, index))
                return chunk
            if self._pool is None:
                self._pool = ThreadPoolExecutor(MAX_CONCURRENT_READS, thread_name_prefix="ckptstream-chunk")
            start = index * RANGE_CHUNK_BYTES
            chunk = _Chunk(self._pool.submit(self.inner.read, path, start, start + RANGE_CHUNK_BYTES))
            self._chunks[(path, index)] = chunk
            while len(self._chunks) > self._max_chunks:
                self._chunks.popitem(last=False)  # readers holding its future still get their bytes
            return chunk

    def _handed_out(self, path: str, index: int, chunk: _Chunk, count: int, size: int) -> None:
        with self._lock:
            chunk.handed_out += count
            if chunk.handed_out >= size and self._chunks.get((path, index)) is chunk:
                del self._chunks[(path, index)]
