"""The loop of everything that follows a source (a follower, a node agent, a mirror): look, wait, look
again; after a failure, keep what is held and retry with backoff."""

from __future__ import annotations

import threading
from typing import Callable

MAX_BACKOFF = 30.0
"""Seconds between retries at most, by default, after failures in a row."""


def poll(stop: threading.Event, wake: threading.Event, look: Callable[[], None], *, interval: float,
         on_error: Callable[[Exception, float], None], retry: tuple[type[Exception], ...],
         max_backoff: float = MAX_BACKOFF) -> None:
    """Call ``look`` until ``stop`` is set, ``interval`` seconds apart (sooner when ``wake`` is set, by a
    watch of the source or by whoever sets ``stop``). A failure of ``look`` (one of ``retry``) is reported
    to ``on_error`` with the wait before the next try, doubled after each failure in a row, up to
    ``max_backoff``; ``on_error`` may raise to end the loop. Other exceptions end it."""
    wait = interval
    while not stop.is_set():
        try:
            look()
            wait = interval
        except retry as exc:
            wait = min(max(wait * 2, interval), max_backoff)
            on_error(exc, wait)
        wake.wait(wait)
        wake.clear()
