"""Ordered parallel map with bounded memory, shared by the writer (chunk encoding) and the reader (decoding)."""

from __future__ import annotations

import collections
import ctypes
import os
import sys
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Callable, Generator, Iterable, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def default_workers() -> int:
    """Worker threads for encoding/decoding: one per core, at most 8."""
    return max(1, min(8, os.cpu_count() or 1))


def one_cpu_thread_each() -> None:
    """Thread-pool initializer: torch's CPU ops called on this thread run on it alone (an OpenMP team of
    one). The pool's workers are the parallelism; each of them waking a team of one thread per core
    oversubscribes the cores (a ``torch.cat`` of 60 kB took 10 ms instead of 0.07 ms from 2 workers on 2
    cores). Only the calling thread's OpenMP setting changes (``omp_set_num_threads`` is per thread), not
    ``torch.get_num_threads()`` of the others. A no-op where torch is not loaded or has no libgomp."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    torch.get_num_threads()  # torch's per-thread initialization first: it would set the team size again
    try:
        with open("/proc/self/maps") as maps:
            path = next((line.split()[-1] for line in maps if "libgomp" in line), None)
        if path is not None:
            ctypes.CDLL(path).omp_set_num_threads(1)
    except OSError:
        pass  # not Linux, or the library is not where the map said: torch's default then


def ordered_parallel(items: Iterable[T], work: Callable[[T], R], cost: Callable[[T], int], *, max_cost: int,
                     executor: Executor | None = None, workers: int | None = None) -> Generator[R, None, None]:
    """``map(work, items)`` on threads, yielding results in order, with the summed ``cost`` of the items
    in flight (submitted but not yet yielded) at most ``max_cost`` (one item always runs).

    Uses ``executor`` if given (and leaves it running), else a pool of its own of ``workers`` threads, each
    running torch's CPU ops on itself alone (:func:`one_cpu_thread_each`).
    Closing the generator early cancels what has not started.
    """
    pool = executor or ThreadPoolExecutor(max_workers=workers or default_workers(),
                                          thread_name_prefix="ckptstream", initializer=one_cpu_thread_each)
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
