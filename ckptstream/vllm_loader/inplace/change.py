"""The change between two versions, in checkpoint names and coordinates: what workers apply in place.

Built from the stored deltas between them and the cached older version (``build_change_from_deltas``:
before the newer one is decoded), or by comparing both cached versions (``build_change``: across a
keyframe).

Per checkpoint tensor that differs: the flat positions of the differing elements (int64, ascending) and
their old and new values in the checkpoint's dtype, compared bit for bit (a NaN that stays NaN is no
change; -0.0 and 0.0 differ). One safetensors file per (base, version) pair, written once per host in the
shared cache (``VersionCache.change``) and read by every worker of the host from there: never sent over
HTTP. The file's metadata names the stream, both versions and each tensor's shape.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from ...codec import bit_pattern, torch_dtype
from ...format import TensorEntry
from ...hf import tensor_specs
from ...reader.decode import TooManyChanges
from ...reader.materialize import MaterializedBase
from ...reader.stream import Stream

MAX_CHANGE_FRACTION = 0.05
"""Above this fraction of the elements changed, an update is reloaded fully: the staged positions and values
(12 bytes per bf16 element changed, on the device) would cost more memory than a reload saves time."""

KEPT_DELTAS_BYTES = 1 << 30
"""Stored delta bytes at most that an update keeps in memory (``Stream.keeping_reads``) between building its
change from the deltas and decoding the version from the same deltas, so that each is read from storage
once; deltas past it are read again (and counted as read again)."""

_POSITIONS, _OLD, _NEW = "positions", "old.", "new."
_LAYOUT_KEY, _LAYOUT = "layout", "packed-1"
"""A change file holds every changed tensor's positions in one tensor and their old and new values in one
tensor per dtype, in the order of its ``tensors`` metadata: read in a few calls, however many tensors changed."""
TOO_MANY = "too many elements changed"
WHOLE = "a version since the served one stores tensors whole"


@dataclass(frozen=True)
class ChangeSummary:
    """What a change holds: elements changed, of how many, in how many tensors; or why none was built."""

    changed: int
    total: int
    tensors: int
    problem: str | None = None


def build_change(base_dir: Path, target_dir: Path, out: Path, *, stream_id: str, base: int, version: int,
                 max_fraction: float) -> ChangeSummary:
    """Write the change from the materialized ``base_dir`` to ``target_dir`` to ``out``; none (``problem``
    set, nothing written) where the tensors differ in names, dtypes or shapes, or more than
    ``max_fraction`` of the elements changed (a full reload is then cheaper)."""
    old_tensors, new_tensors = MaterializedBase(base_dir, stream_id), MaterializedBase(target_dir, stream_id)
    try:
        names = new_tensors.names()
        if sorted(names) != sorted(old_tensors.names()):
            return ChangeSummary(0, 0, 0, problem="the versions hold different tensors")
        total = sum(math.prod(shape) for _, shape in tensor_specs(target_dir).values())
        pairs = ((name, old_tensors.load(name), new_tensors.load(name)) for name in names)
        return write_change(pairs, out, total=total, max_fraction=max_fraction, stream_id=stream_id, base=base,
                            version=version)
    finally:
        old_tensors.close()
        new_tensors.close()


def write_change(pairs: Iterable[tuple[str, torch.Tensor, torch.Tensor]], out: Path, *, total: int,
                 max_fraction: float, stream_id: str, base: int, version: int) -> ChangeSummary:
    """Write the change between the (name, old, new) tensor ``pairs`` (read one pair at a time) to ``out``,
    ``total`` elements in all; none (``problem`` set, nothing written) where a pair differs in dtype or
    shape, or more than ``max_fraction`` of the elements changed."""
    change = _Change(max_fraction * total)
    for name, old, new in pairs:
        if old.dtype != new.dtype or old.shape != new.shape:
            return ChangeSummary(0, 0, 0, problem=f"{name} changed its dtype or shape")
        flat_old, flat_new = old.reshape(-1), new.reshape(-1)
        positions = torch.nonzero(bit_pattern(flat_old) != bit_pattern(flat_new)).reshape(-1)
        if not change.add(name, tuple(new.shape), positions, flat_old[positions], flat_new[positions]):
            return ChangeSummary(change.changed, total, change.tensors, problem=TOO_MANY)
    return change.write(out, total, stream_id=stream_id, base=base, version=version)


def build_change_from_deltas(stream: Stream, base_dir: Path, out: Path, *, base: int, version: int,
                             max_fraction: float) -> ChangeSummary:
    """Write the change from ``base`` (materialized in ``base_dir``) to ``version`` to ``out`` from the
    stored deltas between them (``Stream.changes_since``), without decoding ``version``: the old values
    are read from ``base_dir`` at the changed positions, the new ones are the old XOR the deltas. None
    (``problem`` set, nothing written) where a version between them stores a tensor whole, their tensors
    differ, or more than ``max_fraction`` of the elements changed.

    The stored bytes of the deltas are checked against their stored hashes; the new tensors' hashes are
    not (that needs all their bytes): a decode of ``version`` checks them.
    """
    manifest = stream.manifest(version)
    total = sum(e.numel for e in manifest.tensors)
    base_tensors = MaterializedBase(base_dir, stream.info().stream_id)
    try:
        if sorted(e.name for e in manifest.tensors) != sorted(base_tensors.names()):
            return ChangeSummary(0, 0, 0, problem="the versions hold different tensors")
        budget = int(max_fraction * total)

        def gathered(entry: TensorEntry, positions: torch.Tensor,
                     xors: torch.Tensor) -> tuple[TensorEntry, torch.Tensor, torch.Tensor, torch.Tensor]:
            old = base_tensors.gather(entry, positions) if positions.numel() else xors
            return entry, positions, old, old ^ xors

        # (a tensor's changes cost 8 bytes of position and at most 8 of value each while they are read)
        changes = stream.changes_since(version, base, gathered, max_tensor_bytes=(budget + 1) * 16)
        if changes is None:
            return ChangeSummary(0, 0, 0, problem=WHOLE)
        change = _Change(max_fraction * total)
        try:
            for entry, positions, old, new in changes:
                dtype = torch_dtype(entry.dtype)
                if not change.add(entry.name, entry.shape, positions, old.view(dtype), new.view(dtype)):
                    return ChangeSummary(change.changed, total, change.tensors, problem=TOO_MANY)
        except TooManyChanges:
            return ChangeSummary(budget + 1, total, change.tensors, problem=TOO_MANY)
        finally:
            changes.close()  # (what has not started is cancelled)
    finally:
        base_tensors.close()
    return change.write(out, total, stream_id=stream.info().stream_id, base=base, version=version)


class _Change:
    """The changed tensors of a change being built, up to a number of changed elements."""

    def __init__(self, max_changed: float):
        self.max_changed = max_changed
        self.changed = 0
        self.entries: list[list[Any]] = []  # [name, shape, dtype, elements], in the order added
        self.positions: list[torch.Tensor] = []
        self.values: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}  # dtype -> (old, new)
        self._rank: list[int] = []  # each entry's place in its dtype's lists

    @property
    def tensors(self) -> int:
        return len(self.entries)

    def add(self, name: str, shape: tuple[int, ...], positions: torch.Tensor, old: torch.Tensor,
            new: torch.Tensor) -> bool:
        """Add a tensor's changed elements (none: nothing); False once the change holds too many."""
        if not positions.numel():
            return True
        self.changed += positions.numel()
        if self.changed > self.max_changed:
            return False
        dtype = str(new.dtype).removeprefix("torch.")
        self.entries.append([name, list(shape), dtype, positions.numel()])
        self.positions.append(positions)
        olds, news = self.values.setdefault(dtype, ([], []))
        self._rank.append(len(olds))
        olds.append(old.contiguous())
        news.append(new.contiguous())
        return True

    def write(self, out: Path, total: int, *, stream_id: str, base: int, version: int) -> ChangeSummary:
        from safetensors.torch import save_file

        order = sorted(range(len(self.entries)), key=lambda i: self.entries[i][0])  # by name: one file per change
        tensors = {_POSITIONS: torch.cat([self.positions[i] for i in order]) if order
                   else torch.zeros(0, dtype=torch.int64)}
        for dtype, (olds, news) in self.values.items():
            mine = [i for i in order if self.entries[i][2] == dtype]
            tensors[_OLD + dtype] = torch.cat([olds[self._rank[i]] for i in mine])
            tensors[_NEW + dtype] = torch.cat([news[self._rank[i]] for i in mine])
        metadata = {"stream_id": stream_id, "base": str(base), "version": str(version),
                    _LAYOUT_KEY: _LAYOUT, "tensors": json.dumps([self.entries[i] for i in order])}
        save_file(tensors, str(out), metadata=metadata)
        return ChangeSummary(self.changed, total, self.tensors)


def read_change(handle: Any) -> Iterator[tuple[str, tuple[tuple[int, ...], torch.Tensor, torch.Tensor,
                                                      torch.Tensor]]]:
    """Per changed tensor of an open change file (``safetensors.safe_open``), in the order written: its name
    and (shape, positions, old values, new values), views of the file's few tensors."""
    metadata = handle.metadata() or {}
    if metadata.get(_LAYOUT_KEY) != _LAYOUT:
        raise ValueError(f"not a change file of layout {_LAYOUT} (written by another ckptstream?)")
    positions = handle.get_tensor(_POSITIONS)
    entries = json.loads(metadata["tensors"])
    values: dict[str, tuple[torch.Tensor, torch.Tensor, list[int]]] = {}
    counts: dict[str, int] = {}
    for _, _, dtype, count in entries:
        if not isinstance(count, int) or count <= 0:
            raise ValueError(f"a change file's tensor holds {count!r} changed elements")
        counts[dtype] = counts.get(dtype, 0) + count
        if dtype not in values:
            values[dtype] = (handle.get_tensor(_OLD + dtype), handle.get_tensor(_NEW + dtype), [0])
    if sum(counts.values()) != positions.numel() or any(
            values[d][0].numel() != n or values[d][1].numel() != n for d, n in counts.items()):
        raise ValueError("a change file's tensors do not hold the elements its metadata counts")
    start = 0
    for name, shape, dtype, count in entries:
        old, new, offset = values[dtype]
        yield name, (tuple(shape), positions[start:start + count], old[offset[0]:offset[0] + count],
                     new[offset[0]:offset[0] + count])
        start += count
        offset[0] += count
