"""The poll loop of followers, node agents and mirrors: waits, backoff after failures, the ways it ends."""

from __future__ import annotations

import threading

import pytest

from ckptstream.polling import poll


class _Script:
    """A ``look`` that fails or succeeds as scripted, then sets ``stop``."""

    def __init__(self, outcomes: list[bool], stop: threading.Event):
        self.outcomes = list(outcomes)
        self.stop = stop

    def __call__(self) -> None:
        ok = self.outcomes.pop(0)
        if not self.outcomes:
            self.stop.set()
        if not ok:
            raise OSError("store away")


def test_backoff_doubles_after_failures_in_a_row_and_resets_after_a_success():
    stop, wake = threading.Event(), threading.Event()
    waits: list[float] = []
    look = _Script([False, False, False, True, False, False, False, False], stop)
    poll(stop, wake, look, interval=0.001, on_error=lambda exc, wait: waits.append(wait), retry=(OSError,),
         max_backoff=0.005)
    assert waits == [0.002, 0.004, 0.005, 0.002, 0.004, 0.005, 0.005]


def test_an_error_outside_retry_ends_the_loop_and_on_error_may_end_it():
    stop, wake = threading.Event(), threading.Event()
    with pytest.raises(KeyError):
        poll(stop, wake, lambda: {}["x"], interval=0.001, on_error=lambda exc, wait: None, retry=(OSError,))

    def give_up(exc: Exception, wait: float) -> None:
        raise RuntimeError("diverged") from exc

    with pytest.raises(RuntimeError, match="diverged"):
        poll(stop, wake, _Script([False, True], stop), interval=0.001, on_error=give_up, retry=(OSError,))


def test_a_wake_cuts_the_wait_short_and_a_set_stop_ends_the_loop():
    stop, wake = threading.Event(), threading.Event()
    looks: list[int] = []

    def look() -> None:
        looks.append(1)
        wake.set()  # as a watch of the source does: the next look comes at once
        if len(looks) == 2:
            stop.set()

    poll(stop, wake, look, interval=60.0, on_error=lambda exc, wait: None, retry=(OSError,))  # at once, not in 60 s
    assert len(looks) == 2
