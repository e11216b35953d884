"""The device encoder's two kernels: count the changed elements of spans block by block, then compact them.

A span is a contiguous run of at most ``MAX_SPAN_ELEMENTS`` elements of a tensor (integer views of the
resident copy, ``old``, and of the published tensor, ``new``), cut in blocks of ``BLOCK`` elements.

- ``count_blocks(old, new, counts, first)``: ``counts[first + b]`` = number of elements of the span's block
  ``b`` where ``old != new`` (``counts`` holds the blocks of every span counted on that device).
- ``compact(old, new, ends, counts, first, base, changed)``: the span's changed elements, in ascending
  order, as int32 span-relative positions and ``old ^ new`` values; ``old`` is set to ``new`` there (the
  resident copy then holds the new version). Block ``b`` writes from ``ends[first + b] - counts[first + b]
  - base``: ``ends`` is the inclusive prefix sum of ``counts`` (one ``cumsum`` for all spans), ``base`` its
  value before the span's first block.

Two implementations with the same contract: ``TritonKernels`` (CUDA; each kernel one pass over the span's
bytes, no scratch beyond the outputs and the block counts) and ``TorchKernels`` (torch ops on any device:
the reference, and the fallback where Triton is missing). The Triton kernels also run on CPU tensors in
Triton's interpreter (``TRITON_INTERPRET=1``), where the tests compare them with the reference bit for bit.

Why kernels of our own: ``(old != new).sum()`` materializes a bool mask and its int64 cast (9 bytes per
element: 302 MB of scratch for a 64 MiB bf16 span) and cost twice the time of an XOR pass on an H200;
``nonzero_static`` over the mask was a third pass, and each of the ~12 torch ops per span cost host time.
"""

from __future__ import annotations

import functools
from typing import Protocol

import torch

BLOCK = 8192
"""Elements per block: the unit of the counts and of one program of each kernel."""

MAX_SPAN_ELEMENTS = 2 ** 31 - BLOCK
"""Span-relative positions are int32."""


class ChangeKernels(Protocol):
    """The two kernels (see the module's docstring)."""

    def count_blocks(self, old: torch.Tensor, new: torch.Tensor, counts: torch.Tensor, first: int) -> None:
        """Write the number of changed elements of each of the span's ``blocks(old.numel())`` blocks into
        ``counts`` (int32) from ``first`` on."""
        ...

    def compact(self, old: torch.Tensor, new: torch.Tensor, ends: torch.Tensor, counts: torch.Tensor, first: int,
                base: int, changed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The span's ``changed`` changed elements (int32 positions, XOR values); sets ``old`` to ``new``
        there."""
        ...

    def warm_up(self, dtypes: set[torch.dtype], device: torch.device) -> None:
        """Prepare the kernels for spans of these integer dtypes on ``device`` (Triton compiles them)."""
        ...


def blocks(elements: int) -> int:
    """The number of blocks of a span of ``elements``."""
    return -(-elements // BLOCK)


def prefix_sums(counts: torch.Tensor) -> torch.Tensor:
    """``ends``: the inclusive prefix sums of the block counts (int32: a payload is far below 2**31
    elements)."""
    return counts.cumsum(0, dtype=torch.int32)


def span_totals(ends: torch.Tensor, last_blocks: list[int]) -> list[int]:
    """``ends`` at each span's last block, read by the host (a sync with the device)."""
    if not last_blocks:
        return []
    return ends.index_select(0, torch.tensor(last_blocks, dtype=torch.int64, device=ends.device)).tolist()


class TorchKernels:
    """The kernels as torch ops, on any device (the reference)."""

    def count_blocks(self, old: torch.Tensor, new: torch.Tensor, counts: torch.Tensor, first: int) -> None:
        full = old.numel() // BLOCK * BLOCK
        changed = old != new
        if full:
            counts[first:first + full // BLOCK].copy_(changed[:full].view(-1, BLOCK).sum(1))
        if full < old.numel():
            counts[first + full // BLOCK] = changed[full:].sum()

    def compact(self, old: torch.Tensor, new: torch.Tensor, ends: torch.Tensor, counts: torch.Tensor, first: int,
                base: int, changed: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.nonzero_static(old != new, size=changed).view(-1)
        new_values = new.index_select(0, positions)
        xor_values = old.index_select(0, positions).bitwise_xor_(new_values)
        old.index_copy_(0, positions, new_values)
        return positions.to(torch.int32), xor_values

    def warm_up(self, dtypes: set[torch.dtype], device: torch.device) -> None:
        pass


class TritonKernels:
    """The kernels in Triton: one pass over the span's bytes each, on the current CUDA stream."""

    def __init__(self) -> None:
        self._count, self._compact = _triton_kernels()

    def count_blocks(self, old: torch.Tensor, new: torch.Tensor, counts: torch.Tensor, first: int) -> None:
        if old.numel():
            self._count[(blocks(old.numel()),)](old, new, counts, first, old.numel(), BLOCK=BLOCK, num_warps=8)

    def compact(self, old: torch.Tensor, new: torch.Tensor, ends: torch.Tensor, counts: torch.Tensor, first: int,
                base: int, changed: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.empty(changed, dtype=torch.int32, device=old.device)
        values = torch.empty(changed, dtype=old.dtype, device=old.device)
        if changed:
            self._compact[(blocks(old.numel()),)](old, new, ends, counts, positions, values, first, old.numel(), base,
                                                  BLOCK=BLOCK, num_warps=8)
        return positions, values

    def warm_up(self, dtypes: set[torch.dtype], device: torch.device) -> None:
        """Compile both kernels for each dtype by running them on a few elements, on a stream of their own
        (a first compilation takes ~1.5 s per kernel and dtype; later processes load Triton's disk cache).
        The ints are not specialized on their values, so these compilations are the ones real spans use."""
        stream = torch.cuda.Stream(device)
        with torch.cuda.stream(stream):
            for dtype in dtypes:
                old = torch.zeros(BLOCK + 1, dtype=dtype, device=device)
                new = torch.ones_like(old)
                counts = torch.zeros(blocks(old.numel()), dtype=torch.int32, device=device)
                self.count_blocks(old, new, counts, 0)
                # the capture's own ops: Triton compiles per signature (an int64 ``ends`` would be another
                # compilation of the compaction at the first delta), and torch's ops load on first use
                ends = prefix_sums(counts)
                span_totals(ends, [counts.numel() - 1])
                self.compact(old, new, ends, counts, 0, 0, old.numel())
        stream.synchronize()


@functools.cache
def _triton_kernels():  # type: ignore[no-untyped-def]  # Triton's JIT objects are untyped
    """Compile-on-first-use Triton kernels (importing Triton takes ~1 s: only where a CUDA capture runs).
    The ints are not specialized (``do_not_specialize``): one compilation per dtype serves every span."""
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["first", "n"])
    def count_kernel(old_ptr, new_ptr, counts_ptr, first, n, BLOCK: tl.constexpr):  # noqa: N803  (Triton's style)
        block = tl.program_id(0)
        offsets = block * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < n
        old = tl.load(old_ptr + offsets, mask=inside, other=0)
        new = tl.load(new_ptr + offsets, mask=inside, other=0)
        tl.store(counts_ptr + first + block, tl.sum((old != new).to(tl.int32), axis=0))

    @triton.jit(do_not_specialize=["first", "n", "base"])
    def compact_kernel(old_ptr, new_ptr, ends_ptr, counts_ptr, positions_ptr, values_ptr, first, n, base,
                       BLOCK: tl.constexpr):  # noqa: N803
        block = tl.program_id(0)
        offsets = block * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < n
        old = tl.load(old_ptr + offsets, mask=inside, other=0)
        new = tl.load(new_ptr + offsets, mask=inside, other=0)
        changed = (old != new) & inside
        flags = changed.to(tl.int32)
        start = (tl.load(ends_ptr + first + block) - tl.load(counts_ptr + first + block) - base).to(tl.int32)
        slots = start + tl.cumsum(flags, axis=0) - flags
        tl.store(positions_ptr + slots, offsets, mask=changed)
        tl.store(values_ptr + slots, old ^ new, mask=changed)
        tl.store(old_ptr + offsets, new, mask=changed)

    return count_kernel, compact_kernel


def kernels_for(device: torch.device) -> ChangeKernels:
    """Triton's kernels for a CUDA device where Triton imports, else the torch ops."""
    if device.type == "cuda":
        try:
            return TritonKernels()
        except ImportError:
            pass
    return TorchKernels()
