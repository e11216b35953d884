"""Work done inside a vLLM worker's process while its engine generates (tracing loaders, staging a change) that
hands the interpreter back to the engine's thread quickly.

The engine's loop lets go of the interpreter lock at each wait (on the GPU, on its queues) and needs it back to
launch what comes next. A thread running Python beside it keeps the lock until the interpreter's switch
interval makes it hand over: 5 ms by default, paid at every such wait. An engine step with twenty of them then
took 108 ms instead of 6 ms beside a busy Python thread (``tools/bench_beside_engine.py``), and a client's
request spanning a staging felt it at every step. While such work runs the interval is
``BESIDE_ENGINE_SWITCH_INTERVAL_S`` (9 ms a step there), and the work itself slows by a few percent.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Iterator

BESIDE_ENGINE_SWITCH_INTERVAL_S = 0.0001
"""``sys.setswitchinterval`` while work runs beside the engine: the longest the engine's thread waits for the
interpreter each time it wants it back."""
MEASURE_WAITS_ENV = "CKPTSTREAM_MEASURE_INTERPRETER_WAITS"
"""Set to 1 in a vLLM server's environment, its workers measure each staging's ``InterpreterWaits`` (the staging's
``seconds``: ``interpreter wait longest``, ``interpreter waits total``; ``tools/bench_matrix.py`` sets it)."""

_lock = threading.Lock()
_running = 0  # works beside the engine now: the first sets the interval, the last restores it
_restore = 0.0


@contextlib.contextmanager
def beside_engine() -> Iterator[None]:
    """Run the block with the interpreter's switch interval at ``BESIDE_ENGINE_SWITCH_INTERVAL_S`` (or lower, if it
    was lower), restored once the last of the blocks running at once (in any thread) ends."""
    global _running, _restore
    with _lock:
        if not _running:
            _restore = sys.getswitchinterval()
            if _restore > BESIDE_ENGINE_SWITCH_INTERVAL_S:  # (set and read back, an interval loses a microsecond)
                sys.setswitchinterval(BESIDE_ENGINE_SWITCH_INTERVAL_S)
        _running += 1
    try:
        yield
    finally:
        with _lock:
            _running -= 1
            if not _running and _restore > BESIDE_ENGINE_SWITCH_INTERVAL_S:
                sys.setswitchinterval(_restore)


class InterpreterWaits:
    """While the block runs, a thread that asks for the interpreter every ``interval`` seconds notes how late it got
    it: ``longest``, the longest a Python thread of this process (the engine's, beside the work) waited for the
    interpreter meanwhile (plus the operating system's own scheduling delay), and ``total``, those waits added up.
    A measurement (``MEASURE_WAITS_ENV``), not run otherwise: the thread itself asks for the interpreter."""

    def __init__(self, interval: float = 0.001):
        self.interval, self.longest, self.total = interval, 0.0, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ckptstream-interpreter-waits", daemon=True)

    def __enter__(self) -> InterpreterWaits:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            asked = time.perf_counter()
            if self._stop.wait(self.interval):
                return
            late = time.perf_counter() - asked - self.interval
            self.longest, self.total = max(self.longest, late), self.total + max(late, 0.0)


class StagingClock:
    """A staging's seconds per phase, and its thread's CPU seconds among them: where a staging beside a generating
    engine takes longer than alone, the wall seconds the CPU seconds lack are waits (the interpreter lock, the
    device)."""

    def __init__(self) -> None:
        self._started = self._last = time.perf_counter()
        self._cpu = time.thread_time()
        self._laps: dict[str, float] = {}

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self._laps[phase], self._last = now - self._last, now

    def seconds(self) -> dict[str, float]:
        return {**{phase: round(s, 4) for phase, s in self._laps.items()},
                "wall": round(self._last - self._started, 4), "cpu": round(time.thread_time() - self._cpu, 4)}
