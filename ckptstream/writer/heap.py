"""Keeping the trainer's heap out of the garbage collector's full passes while a publisher is open.

A full collection (generation 2) walks every object the collector tracks: some 300,000 once torch is
imported, more with Triton and a trainer's own (0.1 s on a 2-core VM, 0.18-0.23 s on the H200 host). It
runs in whichever thread's allocation crosses the collector's threshold, the publisher's background
threads included, and holds the GIL throughout: one that falls inside ``publish`` (tens of milliseconds
with the device encoder) doubles its blocking time or more. Frozen objects (``gc.freeze``) are left out of
later passes, which then walk only what was created since. vLLM freezes its engine's heap after startup
for the same reason.

Measured on the H200 host (``tools/bench_gpu_snapshot.py``, 15 GB model, 447 tensors, 20 versions without
freezing): four full collections per run of ten versions; the three versions whose ``publish`` blocked
more than 0.2 s each had one inside it (0.27-0.31 s against 0.09 s otherwise).

Freezing is per process: the first publisher that asks collects once (so that no garbage is frozen), then
freezes; the last one closed unfreezes (as vLLM's engine does at shutdown), unless something froze more
objects since (a freeze of its own, which includes ours: its owner decides). The cost while frozen: an
object alive at the first publish that later becomes garbage in a reference cycle is reclaimed only after
the unfreeze. Another library's ``gc.unfreeze()`` ends the benefit early, nothing worse.
"""

from __future__ import annotations

import gc
import threading

_lock = threading.Lock()
_holders = 0
_frozen_count: int | None = None  # gc.get_freeze_count() right after our freeze; None: not frozen by us


class HeapFreeze:
    """One publisher's hold on the frozen heap: ``hold`` (idempotent) freezes the process's heap, once for
    all holders; ``release`` (idempotent) gives the hold back, the last one unfreezing (see the module)."""

    def __init__(self) -> None:
        self._holding = False

    def hold(self) -> None:
        """Collect, then freeze every object alive (the trainer's model, optimizer and modules), unless
        another hold did already."""
        global _holders, _frozen_count
        with _lock:
            if self._holding:
                return
            self._holding = True
            _holders += 1
            first = _holders == 1
        if not first:
            return
        # Outside the lock: the collection runs finalizers, which may close (release) other publishers.
        gc.collect()
        with _lock:
            if _holders and _frozen_count is None:
                gc.freeze()
                _frozen_count = gc.get_freeze_count()

    def release(self) -> None:
        """Give the hold back; the last holder unfreezes what was frozen, unless more was frozen since."""
        global _holders, _frozen_count
        if not self._holding:  # (without the lock: a finalizer closing a publisher that never held)
            return
        with _lock:
            if not self._holding:
                return
            self._holding = False
            _holders -= 1
            if _holders == 0 and _frozen_count is not None:
                if gc.get_freeze_count() <= _frozen_count:  # (frozen objects that die leave the count)
                    gc.unfreeze()
                _frozen_count = None
