"""The base version's copy on a node (a cached version directory), read back through the worker's plans: the
checkpoint values that storage ranges of a runtime parameter load. An FP8 unit whose scale moves is quantized
again whole from them (``quantized.QuantizedParams.writes``).

The cost follows the ranges, not the tensors: a copy in order (a Linear's shard, an expert: ``Target.in_order``) is
read as the rows its part of a range loads and copied as a slice; any other copy is followed back from the range's
storage offsets to the checkpoint positions they load (``backwards``), and only the rows of the tensor that hold
those are read, on the host, each file opened once while the copy is open (one staging); the values go
to the device in one upload (``upload.Uploads``).
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import math
from pathlib import Path
from typing import Any

import torch

from ...errors import IntegrityError
from .trace import Target, TensorPlan, map_copy, range_index
from .upload import Uploads


class BaseCopy:
    """The checkpoint tensors ``files`` (name -> its file) of the base version, loaded as ``plans`` say; its files
    stay open until ``close``; the values read go to the device by ``upload``."""

    def __init__(self, files: dict[str, Path], plans: dict[str, TensorPlan], upload: Uploads):
        self._upload = upload
        self._files = files
        self._copies: dict[str, list[tuple[str, Target]]] = {}  # parameter -> (checkpoint tensor, copy) into it
        for name, plan in plans.items():
            if name in files:
                for target in plan.targets:
                    self._copies.setdefault(target.param, []).append((name, target))
        self._opened = contextlib.ExitStack()
        self._handles: dict[Path, Any] = {}

    def close(self) -> None:
        self._opened.close()

    def values(self, param: str, spans: list[tuple[int, int]]) -> list[torch.Tensor] | str:
        """The values ``param``'s storage ranges ``spans`` (sorted, apart) load, on the device, or why not."""
        sizes = [stop - start for start, stop in spans]
        at = list(itertools.accumulate(sizes, initial=0))  # where each span's values begin
        starts, stops = [start for start, _ in spans], [stop for _, stop in spans]
        offsets: torch.Tensor | None = None  # (every span's storage offsets: made only for a copy out of order)
        values: torch.Tensor | None = None
        seen = torch.zeros(at[-1], dtype=torch.bool)
        for name, target in self._copies.get(param, []):
            start, end = target.span
            first, last = bisect.bisect_right(stops, start), bisect.bisect_right(starts, end - 1)
            if start >= end or first >= last:
                continue  # (it copies nothing, or no span is within its reach)
            if target.in_order:  # (a Linear's shard, an expert's: read as rows, copied as slices, no index)
                for k in range(first, last):
                    low, high = max(starts[k], start), min(stops[k], end)
                    source = target.src_offset + low - start
                    rows, first_position = self._rows_holding(name, source, source + high - low)
                    if values is None:
                        values = torch.empty(at[-1], dtype=rows.dtype)
                    into = slice(at[k] + low - starts[k], at[k] + high - starts[k])
                    values[into] = rows[source - first_position:source - first_position + high - low]
                    seen[into] = True
                continue
            if offsets is None:
                offsets = range_index(torch.tensor(starts), torch.tensor(sizes), at[-1])
            wanted = offsets[at[first]:at[last]]
            covered, positions = map_copy(backwards(target), wanted, torch.full_like(wanted, target.dst_offset),
                                          torch.full_like(wanted, target.src_offset))
            where = covered.nonzero().reshape(-1)
            if not len(where):
                continue
            positions = positions[where]
            rows, first_position = self._rows_holding(name, int(positions.min()), int(positions.max()) + 1)
            if values is None:
                values = torch.empty(at[-1], dtype=rows.dtype)
            values[where + at[first]] = rows[positions - first_position]
            seen[where + at[first]] = True
        if values is None or not bool(seen.all()):
            return f"the copy of the base version fills {int(seen.sum())} of its {at[-1]} elements"
        return list(self._upload(values).split(sizes))

    def _rows_holding(self, name: str, first_position: int, end_position: int) -> tuple[torch.Tensor, int]:
        """(the rows of checkpoint tensor ``name`` that hold the flat positions [``first_position``,
        ``end_position``), flat; the position its first element is)."""
        from safetensors import SafetensorError, safe_open

        path = self._files[name]
        try:
            if path not in self._handles:
                self._handles[path] = self._opened.enter_context(safe_open(str(path), framework="pt"))
            part = self._handles[path].get_slice(name)
            shape = part.get_shape()
            if not shape:
                return self._handles[path].get_tensor(name).reshape(-1), 0
            row = math.prod(shape[1:])
            first, last = first_position // row, (end_position - 1) // row + 1
            return part[first:last].reshape(-1), first * row
        except SafetensorError as exc:
            raise IntegrityError(f"the base version's copy cannot be read back ({exc})", file=str(path),
                                 tensor=name) from exc


def backwards(target: Target) -> Target:
    """``target`` the other way round: from the parameter's storage offsets to the checkpoint tensor's positions
    (``map_copy`` then finds which offsets it writes, and from where), its dimensions by storage stride, largest
    first, as ``map_copy`` decomposes them. Where the strides do not nest (no view vLLM's loaders copy into),
    some offsets it writes are not found: the read then says it fills too few, and nothing is written."""
    dims = sorted(((size, dst, src) for size, dst, src in zip(target.sizes, target.dst_strides, target.src_strides)
                   if size > 1), key=lambda dim: -dim[1])
    return Target(target.param, tuple(d[0] for d in dims), target.dst_offset, tuple(d[1] for d in dims),
                  target.src_offset, tuple(d[2] for d in dims))
