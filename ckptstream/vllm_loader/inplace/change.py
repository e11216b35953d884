"""The change between two versions, in checkpoint names and coordinates: what workers apply in place.

Built from the stored deltas alone (``build_change_unbased``: no copy of either version needed), from the
stored deltas and the cached older version (``build_change_from_deltas``: before the newer one is decoded),
or by comparing both cached versions (``build_change``: across a keyframe).

Per checkpoint tensor that differs: the flat positions of the differing elements (ascending), compared
bit for bit (a NaN that stays NaN is no change; -0.0 and 0.0 differ), and either their old and new values in
the checkpoint's dtype (layout ``packed-1``), or the XOR of old and new bits and the publisher's check of the
change (layout ``xor-1``, FORMAT.md "Change checks"): each worker then reads the old values from its own
parameters and the checks, added up over the ranks, prove them the delta's base. Across a chain of deltas,
layout ``xor-steps-1`` (a layout of its own, so that a reader of ``xor-1`` alone refuses it; a one-step change
is ``xor-1`` as ever): ``xor-1``'s tensors, each changed tensor's entry once per step that changes it (the
step's positions, XOR and check), ordered by step, then name; the metadata's ``steps`` lists each step's
[base, version], oldest first, and each entry ends with its step's index there. A worker gathers the old
values at every step's positions from its parameters once, then applies the steps in order in memory, each
step's check summed on its own (its old values are the step before's new ones). One safetensors file per
(base, version) pair, written once per host in the shared cache (``VersionCache.change``) and read by every
worker of the host from there: never sent over HTTP. The file's metadata names the stream, both versions and
each tensor's shape.
"""

from __future__ import annotations

import json
import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, NamedTuple

import numpy
import torch

from ...codec import TORCH_TO_DTYPE, bit_pattern, torch_dtype
from ...errors import IntegrityError
from ...format import (ENCODING_PIECES, ENCODING_UNCHANGED, ENCODING_XOR_ZSTD, ChangeCheck, Manifest, TensorEntry,
                      safetensors_header)
from ...hf import tensor_specs
from ...reader.decode import TooManyChanges
from ...reader.materialize import MaterializedBase
from ...reader.stream import Stream
from .trace import range_index

if TYPE_CHECKING:
    from .upload import Uploads

MAX_CHANGE_FRACTION = 0.05
"""Above this fraction of the elements changed, an update is reloaded fully: the staged positions and values
(12 bytes per bf16 element changed, on the device) would cost more memory than a reload saves time."""

KEPT_DELTAS_BYTES = 1 << 30
"""Stored delta bytes at most that an update keeps in memory (``Stream.keeping_reads``) between building its
change from the deltas and decoding the version from the same deltas, so that each is read from storage
once; deltas past it are read again (and counted as read again)."""

_POSITIONS, _OLD, _NEW, _XOR = "positions", "old.", "new.", "xor."
POSITIONS_DTYPES = {True: torch.int32, False: torch.int64}
"""A change file's positions: int32 where every changed tensor has at most ``_NARROW_POSITIONS_MAX`` elements (half
the bytes to write, read and send to a device of the int64 a tensor of more needs); the readers take either."""
_NARROW_POSITIONS_MAX = (1 << 31) - 1
_LAYOUT_KEY, _LAYOUT, _XOR_LAYOUT, _STEPS_LAYOUT = "layout", "packed-1", "xor-1", "xor-steps-1"
"""A change file holds every changed tensor's positions in one tensor and its values in one tensor per dtype
and kind (old and new: ``packed-1``; the XOR of both: ``xor-1``, ``xor-steps-1``), in the order of its
``tensors`` metadata:
read in a few calls, however many tensors changed."""
TOO_MANY = "too many elements changed"
WHOLE = "a version since the served one stores tensors whole"
UNCHECKED = "the version is not a chain of deltas on the served one whose every change has a check"
"""Why no change is built from the deltas alone: a keyframe between the versions, or a delta without change
checks (written by the device encoder or an older ckptstream); the caller builds one with the served version's
copy."""


class ChangedTensor(NamedTuple):
    """A changed tensor of a change file: its shape, positions, and its old and new values (``packed-1``), or
    the XOR of both and the publisher's check of the change (``xor-1``; ``xor-steps-1``: of one step, the
    version that step makes in ``step``): views of the file's tensors, but for int64 positions read from int32."""

    shape: tuple[int, ...]
    positions: torch.Tensor
    old: torch.Tensor | None
    new: torch.Tensor | None
    xor: torch.Tensor | None = None
    check: ChangeCheck | None = None
    step: int | None = None


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
            dtype = torch_dtype(entry.dtype)
            return entry, positions, old.view(dtype), (old ^ xors).view(dtype)

        # (a tensor's changes cost 8 bytes of position and at most 8 of value each while they are read)
        changes = stream.changes_since(version, base, gathered, max_tensor_bytes=(budget + 1) * 16)
        if changes is None:
            return ChangeSummary(0, 0, 0, problem=WHOLE)
        change = _Change(max_fraction * total)
        try:
            for entry, positions, old, new in changes:
                if not change.add(entry.name, entry.shape, positions, old, new):
                    return ChangeSummary(change.changed, total, change.tensors, problem=TOO_MANY)
        except TooManyChanges:
            return ChangeSummary(budget + 1, total, change.tensors, problem=TOO_MANY)
        finally:
            changes.close()  # (what has not started is cancelled)
    finally:
        base_tensors.close()
    return change.write(out, total, stream_id=stream.info().stream_id, base=base, version=version)


def build_change_from_stored(stream: Stream, out: Path, *, base: int, version: int, base_dir: Path | None,
                             max_fraction: float) -> ChangeSummary:
    """Write the change from ``base`` to ``version`` to ``out`` from the stored deltas: from the deltas alone where
    every step carries checks (``build_change_unbased``: the ranks read the old values from what they serve, and
    the checks prove them), else, given ``base_dir`` (the served version's decoded copy), from the deltas and that
    copy (``build_change_from_deltas``). Its problem where neither was built (``UNCHECKED`` without a copy)."""
    summary = build_change_unbased(stream, out, base=base, version=version, max_fraction=max_fraction)
    if summary.problem == UNCHECKED and base_dir is not None:
        summary = build_change_from_deltas(stream, base_dir, out, base=base, version=version,
                                           max_fraction=max_fraction)
    return summary


def build_change_unbased(stream: Stream, out: Path, *, base: int, version: int,
                         max_fraction: float) -> ChangeSummary:
    """Write the change from ``base`` to ``version`` to ``out`` from the stored deltas alone: per changed
    tensor the positions, the XOR of old and new bits, and the publisher's check, per step of the chain of
    deltas from ``base`` to ``version`` (one step: layout ``xor-1``; more: ``xor-steps-1``); no copy of any
    version is read. None (``problem`` set, nothing written) where no such chain leads from ``base`` to
    ``version`` (a keyframe between) or a delta of it has an ``xor-zstd`` entry without a check this
    ckptstream reads (``UNCHECKED``), a step's tensors differ from its base's, or more than ``max_fraction``
    of ``version``'s elements change (each step's changes counted: what the file holds).

    The stored bytes of the deltas are checked against their stored hashes, and each tensor's changes are
    counted against its check; the values are checked where they are applied (``checks.staging_problem``).

    Raises:
        IntegrityError: a delta changes another number of elements than its check counts.
    """
    steps: list[tuple[Manifest, Manifest]] = []  # (its base, a delta), oldest first
    manifest = stream.manifest(version)
    while manifest.version != base:
        if manifest.base_version is None or manifest.base_version < base:
            return ChangeSummary(0, 0, 0, problem=UNCHECKED)
        below = stream.manifest(manifest.base_version)
        steps.insert(0, (below, manifest))
        manifest = below
    checks = [{entry.name: entry_check(entry) for entry in step.tensors} for _, step in steps]
    if not steps or any(check is None for step in checks for check in step.values()):
        return ChangeSummary(0, 0, 0, problem=UNCHECKED)
    if any(sorted(names) != sorted(e.name for e in below.tensors) for names, (below, _) in zip(checks, steps)):
        return ChangeSummary(0, 0, 0, problem="the versions hold different tensors")
    total = sum(e.numel for e in steps[-1][1].tensors)
    budget = int(max_fraction * total)
    change = _Change(max_fraction * total, (_XOR,), _XOR_LAYOUT if len(steps) == 1 else _STEPS_LAYOUT)
    for index, ((below, step), step_checks) in enumerate(zip(steps, checks)):
        # (a tensor's changes cost 8 bytes of position and at most 8 of value each while they are read; viewed in
        # its dtype on the reading threads: each torch call on this one waits for the interpreter lock again, up to
        # a switch interval, while they decode, thousands of times for a MoE model's experts)
        changes = stream.changes_since(step.version, below.version,
                                       lambda entry, positions, xors: (entry, positions,
                                                                       xors.view(torch_dtype(entry.dtype))),
                                       max_tensor_bytes=(budget - change.changed + 1) * 16)
        if changes is None:
            return ChangeSummary(0, 0, 0, problem=WHOLE)
        try:
            for entry, positions, xors in changes:
                check = step_checks[entry.name]
                assert check is not None
                if positions.numel() != check.count:
                    raise IntegrityError(f"the delta changes {positions.numel()} elements, its check counts "
                                         f"{check.count}", version=step.version, tensor=entry.name,
                                         hint="The version is forged or damaged; run `ckptstream verify`")
                if not change.add(entry.name, entry.shape, positions, xors,
                                  check=check, step=None if len(steps) == 1 else index):
                    return ChangeSummary(change.changed, total, change.tensors, problem=TOO_MANY)
        except TooManyChanges:
            return ChangeSummary(budget + 1, total, change.tensors, problem=TOO_MANY)
        finally:
            changes.close()  # (what has not started is cancelled)
    return change.write(out, total, stream_id=stream.info().stream_id, base=base, version=version,
                        steps=[[below.version, step.version] for below, step in steps] if len(steps) > 1 else None)


def write_unchanging(name: str, shape: tuple[int, ...], dtype: torch.dtype, position: int, out: Path, *,
                     packed: bool) -> None:
    """Write at ``out`` a change file of element ``position`` of tensor ``name`` that changes nothing (old and new
    values equal, ``packed``, or their XOR 0 and the check of no change), to stage and drop: a worker's staging
    warmed up (``InPlaceApplier.prepare``)."""
    zero = torch.zeros(1, dtype=dtype)
    change = _Change(1) if packed else _Change(1, (_XOR,), _XOR_LAYOUT)
    change.add(name, shape, torch.tensor([position], dtype=torch.int64), *((zero, zero) if packed else (zero,)),
               check=None if packed else ChangeCheck(count=1))
    change.write(out, 1, stream_id="warm-up", base=0, version=0)


def with_old_values(stream: Stream, base_dir: Path | None, change: Path) -> Path | None:
    """The change of layout ``packed-1`` (old and new values) between the versions of the change file
    ``change``: itself where it is one, else built once beside it (``<base>-<version>.packed-1.safetensors``)
    from the stored deltas and ``base_dir``, the cached copy of its base. For ranks that cannot check a change
    from the deltas alone (``xor-1``: ``checks.check_problem``'s ``unverifiable``), which compare its old values
    with theirs instead. None where none is built (``build_change_from_deltas``' reasons; ``base_dir`` None:
    no copy of the base to build on)."""
    from safetensors import safe_open

    with safe_open(str(change), framework="pt") as handle:
        metadata = handle.metadata() or {}
    if metadata.get(_LAYOUT_KEY) == _LAYOUT:
        return change
    if base_dir is None:
        return None
    out = change.with_name(f"{change.name.removesuffix('.safetensors')}.{_LAYOUT}.safetensors")
    if out.is_file():
        # (reused only where it is this change's: a file left from another stream or versions is rebuilt)
        with safe_open(str(out), framework="pt") as handle:
            theirs = handle.metadata() or {}
        if all(theirs.get(key) == metadata.get(key) for key in ("stream_id", "base", "version")) and \
                theirs.get(_LAYOUT_KEY) == _LAYOUT and metadata.get("stream_id") == stream.info().stream_id:
            return out
    # (a name no reader looks for until it is renamed into place; deleted with either version, as ``out``)
    incoming = out.with_name(f"{out.name}.{os.getpid()}-{threading.get_ident()}.incoming")
    try:
        summary = build_change_from_deltas(stream, base_dir, incoming, base=int(metadata["base"]),
                                           version=int(metadata["version"]), max_fraction=MAX_CHANGE_FRACTION)
        if summary.problem is not None or not incoming.is_file():
            return None
        os.replace(incoming, out)
    finally:
        incoming.unlink(missing_ok=True)
    return out


def entry_check(entry: TensorEntry) -> ChangeCheck | None:
    """The check of the change a delta's ``entry`` makes on its base (a tensor in pieces: the sum of its
    pieces'; unchanged: none changed), or None where one is missing or of a version this ckptstream cannot
    read, or the entry is stored whole."""
    if entry.encoding == ENCODING_PIECES:
        parts = [entry_check(piece) for piece in entry.pieces]
        return None if None in parts else sum((p for p in parts if p is not None), ChangeCheck())
    if entry.encoding == ENCODING_UNCHANGED:
        return ChangeCheck()
    if entry.encoding == ENCODING_XOR_ZSTD and entry.check is not None and entry.check.known:
        return entry.check
    return None


class _Change:
    """The changed tensors of a change being built, up to a number of changed elements: per tensor its
    positions and one tensor of values per kind (``kinds``: the prefixes of their names in the file)."""

    def __init__(self, max_changed: float, kinds: tuple[str, ...] = (_OLD, _NEW), layout: str = _LAYOUT):
        self.max_changed = max_changed
        self.kinds = kinds
        self.layout = layout
        self.changed = 0
        self.entries: list[list[Any]] = []  # [name, shape, dtype, elements(, check)], in the order added
        self.positions: list[torch.Tensor] = []
        self.values: dict[str, list[list[torch.Tensor]]] = {}  # dtype -> per kind, the tensors' values
        self._rank: list[int] = []  # each entry's place in its dtype's lists

    @property
    def tensors(self) -> int:
        return len(self.entries)

    def add(self, name: str, shape: tuple[int, ...], positions: torch.Tensor, *values: torch.Tensor,
            check: ChangeCheck | None = None, step: int | None = None) -> bool:
        """Add a tensor's changed elements (none: nothing), one tensor of values per kind (of the step of index
        ``step``, in a change of several); False once the change holds too many."""
        if not positions.numel():
            return True
        self.changed += positions.numel()
        if self.changed > self.max_changed:
            return False
        dtype = str(values[0].dtype).removeprefix("torch.")
        self.entries.append([name, list(shape), dtype, positions.numel()]
                            + ([] if check is None else [check.to_json()]) + ([] if step is None else [step]))
        self.positions.append(positions)
        lists = self.values.setdefault(dtype, [[] for _ in self.kinds])
        self._rank.append(len(lists[0]))
        for held, value in zip(lists, values):
            held.append(value)  # (1-D and contiguous, as the builders make them: ``write`` reads their bytes)
        return True

    def write(self, out: Path, total: int, *, stream_id: str, base: int, version: int,
              steps: list[list[int]] | None = None) -> ChangeSummary:
        # by step, then name: one file per change
        order = sorted(range(len(self.entries)), key=lambda i: (self.entries[i][5:], self.entries[i][0]))
        narrow = all(math.prod(entry[1]) <= _NARROW_POSITIONS_MAX for entry in self.entries)
        positions = numpy.empty(self.changed, dtype=numpy.int32 if narrow else numpy.int64)
        at = 0
        for i in order:  # (numpy narrows them as it copies: one pass, no torch op per tensor)
            count = self.positions[i].numel()
            positions[at:at + count] = self.positions[i].numpy()
            at += count
        tensors: list[tuple[str, list[numpy.ndarray], torch.dtype]] = [
            (_POSITIONS, [positions], POSITIONS_DTYPES[narrow])]
        for dtype, lists in self.values.items():
            mine = [i for i in order if self.entries[i][2] == dtype]
            for kind, held in zip(self.kinds, lists):
                pieces = [held[self._rank[i]] for i in mine]
                tensors.append((kind + dtype, [p.view(torch.uint8).numpy() for p in pieces], pieces[0].dtype))
        metadata = {"stream_id": stream_id, "base": str(base), "version": str(version),
                    _LAYOUT_KEY: self.layout, "tensors": json.dumps([self.entries[i] for i in order])}
        if steps is not None:
            metadata["steps"] = json.dumps(steps)
        tensors.sort(key=lambda tensor: -tensor[2].itemsize)  # (each then starts aligned to its dtype, as safetensors'
        # own writer lays them out: a reader may view the bytes in place)
        sizes = [sum(piece.nbytes for piece in pieces) for _, pieces, _ in tensors]
        header, _ = safetensors_header(((name, TORCH_TO_DTYPE[dtype], (size // dtype.itemsize,), size)
                                        for (name, _, dtype), size in zip(tensors, sizes)), metadata)
        # Written piece by piece from the decoded tensors: concatenated first, then serialized, a change of
        # 50 M elements cost two more copies of its bytes on the follower's path (~0.3 s of a 10 GB MoE update).
        with open(out, "wb") as file:
            file.write(header)
            for _, pieces, _ in tensors:
                file.writelines(pieces)
        return ChangeSummary(self.changed, total, self.tensors)


@dataclass(frozen=True)
class ChangeEntry:
    """A changed tensor's entry in a change file: its name, shape, dtype (the checkpoint's name of it), the number
    of changed elements, where they start in the file's positions (``start``) and in its values of that dtype
    (``value_start``); for ``xor-1`` its publisher's check, for ``xor-steps-1`` also the version its step makes."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    count: int
    start: int
    value_start: int
    check: ChangeCheck | None = None
    step: int | None = None

    @property
    def key(self) -> str:
        """Its name in a staging's ``coverage`` and ``checks``: the tensor's, with ``@`` and the version its step
        makes in a change of several steps."""
        return self.name if self.step is None else f"{self.name}@{self.step}"


@dataclass(frozen=True)
class ChangeFile:
    """A change file read whole (``load_change``): its entries, and its few tensors: every entry's positions end to
    end (``POSITIONS_DTYPES``), and per dtype its values (old and new: ``packed-1``; the XOR of both: ``xor-1``,
    ``xor-steps-1``)."""

    entries: list[ChangeEntry]
    positions: torch.Tensor
    values: dict[str, tuple[torch.Tensor, ...]]

    @property
    def packed(self) -> bool:
        """Whether it holds old and new values (``packed-1``) rather than their XOR."""
        return any(len(held) == 2 for held in self.values.values())

    def tensor(self, i: int) -> ChangedTensor:
        """Entry ``i`` as a ``ChangedTensor`` (views of the file's tensors; its positions int64)."""
        entry = self.entries[i]
        at = self.positions[entry.start:entry.start + entry.count].to(torch.int64)
        parts = [v[entry.value_start:entry.value_start + entry.count] for v in self.values[entry.dtype]]
        if len(parts) == 2:
            return ChangedTensor(entry.shape, at, parts[0], parts[1])
        return ChangedTensor(entry.shape, at, None, None, parts[0], entry.check, entry.step)

    def dtype(self, entry: ChangeEntry) -> torch.dtype:
        """The torch dtype of ``entry``'s values."""
        return self.values[entry.dtype][0].dtype

    def positions_of(self, indices: list[int], upload: Uploads | None = None) -> torch.Tensor:
        """The positions of the entries ``indices``, end to end in that order, in the file's dtype, on the host, or
        sent by ``upload`` to its device."""
        (positions,) = _ranges((self.positions,), [(self.entries[i].start, self.entries[i].count) for i in indices],
                               upload)
        return positions

    def values_of(self, indices: list[int], upload: Uploads | None = None) -> tuple[torch.Tensor, ...]:
        """The values (old and new, or the XOR) of the entries ``indices`` (all of one dtype), end to end, on the
        host, or sent by ``upload`` to its device."""
        ranges = [(self.entries[i].value_start, self.entries[i].count) for i in indices]
        return _ranges(self.values[self.entries[indices[0]].dtype], ranges, upload)


_WINDOW_SLACK = 2
"""A GPU gathers ranges itself from the window of the file's tensors that holds them, sent whole, where that window
holds at most this many times their elements (a staging chunk's copies are a few layers' parameters, close together
in a one-step change's file: about 1.5 times; a change of several steps lays each step's apart, and its chunks'
ranges are mostly gathered on the host)."""


def _ranges(tensors: tuple[torch.Tensor, ...], ranges: list[tuple[int, int]],
            upload: Uploads | None = None) -> tuple[torch.Tensor, ...]:
    """The (start, count) ranges (at least one, none empty) of each of the 1-D host ``tensors``, end to end, on the
    host, or sent by ``upload`` to its device. On the host they are gathered by numpy: a torch slice per entry would
    cost a reader beside a generating engine a wait for the interpreter each (thousands of experts' tensors), and one
    index of every element would cost memory and time. A GPU takes the window that holds them (``_window``) in one
    upload per tensor and gathers them itself with one index (``_gather_window``): inside a GPU server the host's
    gather was the larger part of a staging."""
    window = _window(ranges) if upload is not None and upload.device.type != "cpu" else None
    if window is not None:
        (low, high), relative, total = window
        return _gather_window(tuple(upload(tensor[low:high]) for tensor in tensors), relative, total)
    gathered = []
    for tensor in tensors:
        size = tensor.element_size()
        flat = tensor.view(torch.uint8).numpy()  # (numpy holds no bf16)
        part = torch.from_numpy(numpy.concatenate([flat[start * size:(start + count) * size]
                                                   for start, count in ranges])).view(tensor.dtype)
        gathered.append(part if upload is None else upload(part))
    return tuple(gathered)


def _window(ranges: list[tuple[int, int]]) -> tuple[tuple[int, int], list[tuple[int, int]], int] | None:
    """The span [low, high) of elements that holds ``ranges``, the ranges relative to it, and their elements; None
    where the span holds more than ``_WINDOW_SLACK`` times those (sending it whole would cost more than a gather on
    the host)."""
    low, high = min(start for start, _ in ranges), max(start + count for start, count in ranges)
    total = sum(count for _, count in ranges)
    if high - low > _WINDOW_SLACK * total:
        return None
    return (low, high), [(start - low, count) for start, count in ranges], total


def _gather_window(windows: tuple[torch.Tensor, ...], ranges: list[tuple[int, int]],
                   total: int) -> tuple[torch.Tensor, ...]:
    """The (start, count) ranges of each 1-D window of ``windows`` (one device, one length), ``total`` elements end to
    end. Ranges one after the other from the window's start are the window itself; others are gathered by one index
    made on the device (a few ops, whatever the number of ranges; 16 bytes per element at its peak)."""
    if all(start == (ranges[k - 1][0] + ranges[k - 1][1] if k else 0) for k, (start, _) in enumerate(ranges)):
        return windows
    starts, counts = torch.tensor(ranges, dtype=torch.int64).to(windows[0].device).unbind(1)  # (one transfer)
    index = range_index(starts, counts, total)
    return tuple(window[index] for window in windows)


def load_change(handle: Any) -> ChangeFile:
    """The change file open in ``handle`` (``safetensors.safe_open``), of any layout, its entries checked against
    its tensors (``ValueError`` where they disagree)."""
    metadata = handle.metadata() or {}
    layout = metadata.get(_LAYOUT_KEY)
    if layout not in (_LAYOUT, _XOR_LAYOUT, _STEPS_LAYOUT):
        raise ValueError(f"not a change file of layout {_LAYOUT}, {_XOR_LAYOUT} or {_STEPS_LAYOUT} (written by "
                         "another ckptstream?)")
    kinds = (_OLD, _NEW) if layout == _LAYOUT else (_XOR,)
    steps = [int(v) for _, v in json.loads(metadata["steps"])] if layout == _STEPS_LAYOUT else []
    positions = handle.get_tensor(_POSITIONS)
    if positions.dtype not in POSITIONS_DTYPES.values() or positions.dim() != 1:
        raise ValueError(f"a change file's positions are {positions.dtype} of {positions.dim()} dimensions, not 1-D "
                         "int32 or int64")
    values: dict[str, tuple[torch.Tensor, ...]] = {}
    counts: dict[str, int] = {}
    entries: list[ChangeEntry] = []
    start = 0
    for entry in json.loads(metadata["tensors"]):
        name, shape, dtype, count = entry[0], entry[1], entry[2], entry[3]
        if not isinstance(count, int) or count <= 0:
            raise ValueError(f"a change file's tensor holds {count!r} changed elements")
        check = None
        if layout != _LAYOUT:
            check = ChangeCheck.from_json(entry[4] if len(entry) > 4 else None)
            if not check.known or check.count != count:
                raise ValueError(f"a change file's tensor {name!r} has no check of its {count} changes")
        step = None
        if layout == _STEPS_LAYOUT:
            index = entry[5] if len(entry) > 5 else None
            if not isinstance(index, int) or not 0 <= index < len(steps) or (
                    entries and entries[-1].step is not None and steps[index] < entries[-1].step):
                raise ValueError(f"a change file's tensor {name!r} names no step, or not in order: {index!r}")
            step = steps[index]
        if dtype not in values:
            values[dtype] = tuple(handle.get_tensor(kind + dtype) for kind in kinds)
        entries.append(ChangeEntry(name, tuple(shape), dtype, count, start, counts.get(dtype, 0), check, step))
        counts[dtype] = counts.get(dtype, 0) + count
        start += count
    if start != positions.numel() or any(v.numel() != counts[d] for d, held in values.items() for v in held):
        raise ValueError("a change file's tensors do not hold the elements its metadata counts")
    return ChangeFile(entries, positions, values)


def read_change(handle: Any) -> Iterator[tuple[str, ChangedTensor]]:
    """Per changed tensor of an open change file (``safetensors.safe_open``) of any layout, in the order
    written (``xor-steps-1``: once per step, oldest first): its name and ``ChangedTensor`` (views of the
    file's few tensors)."""
    change = load_change(handle)
    for i, entry in enumerate(change.entries):
        yield entry.name, change.tensor(i)
