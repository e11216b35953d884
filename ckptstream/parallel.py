"""Ordered parallel map with bounded memory, shared by the writer (chunk encoding) and the reader (decoding)."""

from __future__ import annotations

import collections
import os
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Callable, Iterable, Iterator, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def default_workers() -> int:
    """Worker threads for encoding/decoding: one per core, at most 8."""
    return max(1, min(8, os.cpu_count() or 1))


def ordered_parallel(items: Iterable[T], work: Callable[[T], R], cost: Callable[[T], int], *, max_cost: int,
                     executor: Executor | None = None, workers: int | None = None) -> Iterator[R]:
    """``map(work, items)`` on threads, yielding results in order, with the summed ``cost`` of the items
    in flight (submitted but not yet yielded) at most ``max_cost`` (one item always runs).

    Uses ``executor`` if given (and leaves it running), else a pool of its own of ``workers`` threads.
    Closing the generator early cancels what has not started.
    """
    pool = executor or ThreadPoolExecutor(max_workers=workers or default_workers(),
                                          thread_name_prefix="ckptstream")
    pending: collections.deque[tuple[Future[R], int]] = collections.deque()
    in_flight = 0
    try:
        for item in items:
            item_cost = cost(item)
            while pending and in_flight + item_cost > max_cost:
                future, done_cost = pending.popleft()
                in_flight -= done_cost
                yield future.result()
            pending.append((pool.submit(work, item), item_cost))
            in_flight += item_cost
        while pending:
            yield pending.popleft()[0].result()
    finally:
        for future, _ in pending:
            future.cancel()
        if executor is None:
            pool.shutdown(wait=True)
