"""Keeping the trainer's heap out of the garbage collector's full passes while a publisher is open.

A full collection (generation 2) walks every object the collector tracks: some 300,000 once torch is
imported, more with Triton and a trainer's own, ~0.1 s of a core. It runs in whichever thread's allocation
crosses the collector's threshold, the publisher's background threads included, and holds the GIL
throughout: one that falls inside ``publish`` (tens of milliseconds with the device encoder) doubles its
blocking time or more. Frozen objects (``gc.freeze``) are left out of later passes, which then walk only
what was created since. vLLM freezes its engine's heap after startup, and its trainer-side weight
transfer the trainer's, for the same reason.

Measured on the H200 host (``tools/bench_gpu_snapshot.py``, 15 GB model, 447 tensors, 20 versions without
freezing): four full collections per run of ten versions, 0.18-0.23 s each; the three versions whose
``publish`` blocked more than 0.2 s each had one inside it (0.27-0.31 s against 0.09 s otherwise).

Freezing is per process: the first publisher that asks freezes, the last one closed unfreezes (as vLLM's
engine does at shutdown, so that a process going on without it collects those objects again). Where the
process had frozen objects itself before (its own policy, or a library's at import: seen with 375
objects on the H200 host), the heap is frozen all the same, and left frozen.
"""

from __future__ import annotations

import gc
import threading

_lock = threading.Lock()
_holders = 0
_unfreeze_at_release = False  # whether the heap was unfrozen before the first hold


class HeapFreeze:
    """One publisher's hold on the frozen heap: ``hold`` (idempotent) freezes the process's heap, once for
    all holders; ``release`` (idempotent) gives the hold back, the last one unfreezing what was frozen
    (unless the process had frozen objects before)."""

    def __init__(self) -> None:
        self._holding = False

    @property
    def holding(self) -> bool:
        """Whether this publisher holds the frozen heap."""
        return self._holding

    def hold(self) -> None:
        """Collect, then freeze every object alive (the trainer's model, optimizer and modules), unless
        another hold did already."""
        global _holders, _unfreeze_at_release
        with _lock:
            if self._holding:
                return
            if _holders == 0:
                _unfreeze_at_release = gc.get_freeze_count() == 0
                gc.collect()  # so that no garbage is frozen
                gc.freeze()
            _holders += 1
            self._holding = True

    def release(self) -> None:
        """Give the hold back; the last holder unfreezes what was frozen."""
        global _holders
        with _lock:
            if not self._holding:
                return
            self._holding = False
            _holders -= 1
            if _holders == 0 and _unfreeze_at_release:
                gc.unfreeze()
