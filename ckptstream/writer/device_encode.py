"""The device encoder: deltas of CUDA tensors computed where the tensors live.

Front half, ``DeviceSnapshot.take`` (what ``publish`` waits for): the snapshot buffer is a device-resident
copy of the last version (the model's bytes, on the tensors' devices, less the smallest tensors: see
below). On a side CUDA stream, per span of every tensor (whole tensors with Triton's kernels), the number
of changed elements (``resident != live`` on integer views) is counted block by block on the device
(``device_kernels``); ONE host sync reads the spans' totals (per device), which decide the payload budget.
Then per changed span, with no further sync, the compaction kernel writes the positions (int32
span-relative) and XOR values and updates the resident copy there, and the span's payload is copied at
once into a pinned staging block. A tensor without a resident copy yet (the first version, a new tensor,
a payload over its budget) is copied device-to-device instead. The smallest tensors (``WHOLE_BYTES``, and
within ``HOST_COMPARED_RATIO`` of the model's bytes none kept resident) are staged whole, their changes
found on the host: what they leave out of the resident copies outweighs the kernels' scratch, so that
the device memory stays within 1x the model's bytes.

Back half, on the publisher's background thread: ``DeviceSnapshot.land`` hands each tensor to the executor
as one task: its payload read from the staging block and applied to a host mirror of the last version
(pageable memory, from which the keyframes are encoded), its hash taken, and the delta's sparse sections
built (``DeviceDeltaEncoder.prepare``); full tensors come through a ring of slots carved from the same
pinned block. ``DeviceDeltaEncoder`` then serializes and compresses every chunk on host threads, each
waiting only for its own tensor, with the host encoder's own serialization (``codec.SparseChunks``,
``codec.encode_xor_chunk``), so both encoders store the same bytes for the same tensors.

Everything is written with torch ops that run on any device: the CPU run of the same code is the reference
tested against the host encoder (there the payload stays in CPU tensors). The CUDA-only parts (side
streams, events, the pinned block) are guarded by ``is_cuda``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import deque
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Iterable, Mapping

import torch

from .. import codec
from ..errors import PublishError
from ..format import ENCODING_XOR_ZSTD, ENCODING_ZSTD, LAYOUT_SPARSE, ChangeCheck
from . import device_kernels
from .device_kernels import MAX_SPAN_ELEMENTS, ChangeKernels, TorchKernels, TritonKernels, kernels_for
from .encode import (BaseVersion, DeltaEncoder, EncodedTensor, EncodedVersion, Pieces, Snapshot, assemble_delta,
                     base_tensor)
from .pieces import PieceOf
from .snapshot import NamedTensors, check_tensor

log = logging.getLogger("ckptstream.publish")

MAX_PAYLOAD_RATIO = 0.1
"""A version's compact payload (positions and XOR values, on the device until the back half copies it)
may reach this fraction of the model's bytes; beyond it the version becomes a keyframe. Bounds the extra
device memory next to the snapshot buffer, and the delta would hardly pay anyway (more than ~3 % of bf16
elements changed)."""

SPAN_BYTES = 64 << 20
"""With the torch kernels, change detection runs over spans of at most this many bytes of a tensor: bounds
the device scratch of one span (its mask and the mask's int64 sum, 9 bytes per element). Triton's kernels
have no such scratch and take whole tensors (``device_kernels.MAX_SPAN_ELEMENTS``: int32 positions)."""

RING_SLOT_BYTES = 32 << 20
RING_SLOTS = 4
"""The ring through which full tensors reach the host: 4 x 32 MiB, at the start of the pinned block."""

WHOLE_BYTES = 1 << 20
"""A tensor of at most this many bytes (norm weights, biases) is not compared on the device: its new bytes
go to the pinned block whole (two copies instead of ~12 kernels and copies, which cost ~0.15 ms of host
time each in ``publish``), and its changes are found on the host when it lands."""

HOST_COMPARED_RATIO = 0.003
"""The smallest tensors, up to this fraction of the model's bytes (and half the ring), have no resident
copy: staged whole every version, they are compared with the host mirror when they land. What they leave
out of the resident copies is more than the device scratch of a capture (the block counts and their
prefix sums, ~0.05 % of the model's bytes, and one tensor's payload: ~3 % of the largest tensor at 1 %
changed), so that the encoder's device memory stays within 1x the model's bytes."""

_ALIGN = 8
"""Payload sections in the pinned block start at multiples of this (the widest element)."""


@dataclass
class _TensorCapture:
    """One tensor of a capture: its resident copy (holding this version; None for a tensor compared on
    the host) and its changes since the previous one, span by span (``positions`` None: nothing recorded,
    the tensor is copied whole from its resident copy)."""

    name: str
    dtype: torch.dtype
    shape: torch.Size
    resident: torch.Tensor | None
    positions: list[torch.Tensor] | None = None  # int32 span-relative element indices, ascending, per span
    values: list[torch.Tensor] = field(default_factory=list)  # XOR values at those positions
    starts: list[int] = field(default_factory=list)  # the spans' first elements
    whole: torch.Tensor | None = None  # or: the tensor's new bytes (integer view), its changes found on landing
    place: PieceOf | None = None  # where the tensor lies in the whole tensor it is a piece of (its check's positions)

    @property
    def nbytes(self) -> int:
        """The tensor's bytes."""
        return self.shape.numel() * self.dtype.itemsize


@dataclass
class _Compared:
    """A tensor being compared with its resident copy in ``DeviceSnapshot.take``: its spans (first element,
    integer views of the resident copy and of the tensor)."""

    capture: _TensorCapture
    live: torch.Tensor
    spans: list[tuple[int, torch.Tensor, torch.Tensor]]
    whole: bool = False  # staged whole (see WHOLE_BYTES, HOST_COMPARED_RATIO): no spans


@dataclass
class DeviceCapture:
    """What ``DeviceSnapshot.take`` recorded of one version, waiting on the device for the back half."""

    version: int
    previous: int | None
    """The version the resident copies held before (the changes are against it); None: no delta."""
    declined: bool
    """Whether the changes outgrew ``max_payload_ratio`` (the version is to be a keyframe)."""
    tensors: list[_TensorCapture]
    ready: dict[torch.device, torch.cuda.Event]
    """Per CUDA device, an event after the capture's last kernel and copy."""
    released: threading.Event = field(default_factory=threading.Event)
    """Set once the back half no longer reads the resident copies nor the pinned block (the next capture
    waits for it): by ``DeviceSnapshot.land`` once its last tensor has landed, or ``abandon``."""
    landing: bool = False
    """Whether ``land`` was called for it (then it releases the capture)."""


@dataclass
class LandedTensor:
    """One tensor of a landed version, once its host mirror holds the version."""

    changes: tuple[torch.Tensor, torch.Tensor] | None
    """The changes as host tensors (int64 positions, XOR values); None for a tensor copied whole."""
    hash: str
    """The format's hash of the tensor (``codec.tensor_hash`` of the mirror)."""
    prepared: object = None
    """What the ``prepare`` given to ``DeviceSnapshot.land`` made of the changes."""
    check: ChangeCheck | None = None
    """The check of the changes (FORMAT.md, "Change checks"), taken with ``prepare``."""


Prepare = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object]
"""``prepare(mirror, positions, values)``: work on a tensor's changes, run by ``land`` on the thread that
applied them, as soon as they are (the delta encoder's sparse sections)."""


@dataclass
class LandedVersion:
    """A capture being applied to the host mirror, tensor by tensor, on the executor ``land`` was given:
    ``tensors[name]`` resolves once that tensor's mirror holds the version."""

    version: int
    previous: int | None
    declined: bool
    compared: frozenset[str]
    """The tensors whose changes were recorded (the others were copied whole)."""
    tensors: dict[str, Future[LandedTensor]]
    mirror: list[tuple[str, torch.Tensor]]
    prepared: bool
    """Whether ``land`` ran a ``prepare`` on the changes."""

    def wait(self) -> None:
        """Return once every tensor has landed (raises the first failure)."""
        for future in self.tensors.values():
            future.result()

    def hashes(self) -> list[str]:
        """The tensors' hashes, in the mirror's order, once they have landed."""
        return [self.tensors[name].result().hash for name, _ in self.mirror]


class PinnedRing:
    """One pinned host block, allocated once (``reserve``) and reused: the staging area of the captures'
    payloads, and at its start the ``slots`` buffers of ``slot_bytes`` through which ``copy`` brings device
    tensors of any size to the host, on a copy stream of its own. Used from one thread at a time."""

    def __init__(self, slot_bytes: int = RING_SLOT_BYTES, slots: int = RING_SLOTS):
        self.slot_bytes = slot_bytes
        self.slots = slots
        self.block: torch.Tensor | None = None
        """The pinned block (uint8), once reserved."""
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    @property
    def pinned_bytes(self) -> int:
        """Pinned host memory held."""
        return 0 if self.block is None else self.block.numel()

    def reserve(self, nbytes: int) -> None:
        """Hold a block of at least ``nbytes`` (and of the ring's slots); reallocated only to grow. Call
        only while nothing is staged in it."""
        nbytes = max(nbytes, self.slot_bytes * self.slots)
        if self.block is None or self.block.numel() < nbytes:
            self.block = None
            self.block = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def copy(self, src: torch.Tensor, dst: torch.Tensor, after: torch.cuda.Event | None = None) -> None:
        """``dst[:] = src`` for a contiguous ``src`` on any device and a contiguous host ``dst`` of the same
        bytes; for a CUDA ``src``, once ``after`` (an event of the stream that wrote it) has passed. Uses the
        start of the block: nothing staged there may still be needed."""
        src_bytes, dst_bytes = codec.as_bytes(src), codec.as_bytes(dst)
        if not src.is_cuda:
            dst_bytes.copy_(src_bytes)
            return
        stream = self._streams.get(src.device)
        if stream is None:
            stream = self._streams[src.device] = torch.cuda.Stream(src.device)
        self.reserve(0)
        assert self.block is not None
        buffers = [self.block[n * self.slot_bytes:(n + 1) * self.slot_bytes] for n in range(self.slots)]
        if after is not None:
            stream.wait_event(after)
        pending: deque[tuple[torch.cuda.Event, torch.Tensor, int, int]] = deque()
        with torch.cuda.stream(stream):
            for number, start in enumerate(range(0, src_bytes.numel(), self.slot_bytes)):
                end = min(start + self.slot_bytes, src_bytes.numel())
                if len(pending) == self.slots:
                    _drain(pending.popleft(), dst_bytes)
                buffer = buffers[number % self.slots]
                buffer[:end - start].copy_(src_bytes[start:end], non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
                pending.append((event, buffer, start, end))
        while pending:
            _drain(pending.popleft(), dst_bytes)

    def clear(self) -> None:
        """Release the pinned block."""
        self.block = None


def _drain(item: tuple[torch.cuda.Event, torch.Tensor, int, int], dst_bytes: torch.Tensor) -> None:
    event, buffer, start, end = item
    event.synchronize()
    dst_bytes[start:end].copy_(buffer[:end - start])


class DeviceSnapshot:
    """The device-resident copy of the last version, its host mirror and the pinned ring between them.

    Thread-safe: ``take`` runs on the caller's thread, ``land`` on the publisher's background thread, in
    version order.

    Args:
        max_payload_ratio: see :data:`MAX_PAYLOAD_RATIO` (the default).
        span_bytes: the spans' bytes (default: :data:`SPAN_BYTES` for the torch kernels, whose scratch grows
            with them; whole tensors up to ``MAX_SPAN_ELEMENTS`` for Triton's).
        whole_bytes: see :data:`WHOLE_BYTES` (the default).
        host_compared_ratio: see :data:`HOST_COMPARED_RATIO` (the default).
        ring: the pinned block and its ring (default: 4 x 32 MiB slots; when the first CUDA capture
            lands, the block grows to the largest power of two within ``max_payload_ratio`` of the model's
            bytes, which then also bounds a version's payload).
        kernels: the change kernels (default, per device: ``device_kernels.kernels_for``, Triton's on CUDA).
    """

    def __init__(self, *, max_payload_ratio: float | None = None, span_bytes: int | None = None,
                 whole_bytes: int | None = None, host_compared_ratio: float | None = None,
                 ring: PinnedRing | None = None, kernels: ChangeKernels | None = None):
        self.max_payload_ratio = MAX_PAYLOAD_RATIO if max_payload_ratio is None else max_payload_ratio
        self.span_bytes = span_bytes
        self.whole_bytes = WHOLE_BYTES if whole_bytes is None else whole_bytes
        self.host_compared_ratio = HOST_COMPARED_RATIO if host_compared_ratio is None else host_compared_ratio
        self.ring = ring if ring is not None else PinnedRing()
        self._lock = threading.Lock()
        self._resident: dict[str, torch.Tensor] = {}
        self._version: int | None = None  # the version the resident copies hold
        self._places: dict[str, PieceOf | None] = {}  # the last capture's tensors: where each piece lies in its whole
        self._released: threading.Event | None = None  # the last capture's
        self._mirror: dict[str, torch.Tensor] = {}
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._kernels: dict[torch.device, ChangeKernels] = {}
        self._given_kernels = kernels
        self._warming: threading.Thread | None = None  # compiling the kernels (see _warm_up)
        self.landed: LandedVersion | None = None
        """The last version ``land`` applied (what :class:`DeviceDeltaEncoder` encodes)."""

    @property
    def device_memory_bytes(self) -> int:
        """Device memory held by the snapshot buffer (the resident copies on CUDA devices)."""
        with self._lock:
            return sum(t.numel() * t.element_size() for t in self._resident.values() if t.is_cuda)

    @property
    def pinned_bytes(self) -> int:
        """Pinned host memory held (the block: payload staging and ring)."""
        return self.ring.pinned_bytes

    def reset(self) -> None:
        """Forget the resident copies and the mirror (after a failure, or when the host path takes over):
        the next capture copies every tensor whole."""
        with self._lock:
            self._resident, self._version, self._mirror, self.landed = {}, None, {}, None
            self._places = {}
            self._released = None

    def clear(self) -> None:
        """Release every buffer, device and pinned."""
        self.reset()
        self.ring.clear()

    def take(self, named_tensors: NamedTensors, version: int, pieces: Pieces | None = None) -> DeviceCapture:
        """Record ``version`` of the tensors: their changes against the resident copies, which then hold
        ``version``. ``pieces``: those of the tensors that are pieces of a whole tensor (read once
        ``named_tensors`` is listed), whose changes' checks are taken at positions in the whole; where one
        lies elsewhere than in the previous version, every tensor is copied whole (no changes recorded).
        Returns once the caller may change the tensors (their later kernels on the current stream are
        ordered after the capture's reads). Waits for the back half of the previous capture to have read
        what it needs. Raises as ``SnapshotBuffers.take`` does; after a failure the resident copies are
        forgotten."""
        items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        places = {name: (pieces or {}).get(name) for name, _ in items}
        with self._lock:
            if self._released is not None:
                self._released.wait()  # the back half still reads the resident copies or the pinned block
            previous, old = self._version, self._resident
            if any(name in self._places and self._places[name] != place for name, place in places.items()):
                previous = None  # a resident copy (or the mirror) holds another box than this version's piece
            limit = self.max_payload_ratio * sum(t.numel() * t.element_size() for t in old.values())
            resident: dict[str, torch.Tensor] = {}
            captures: list[_TensorCapture] = []
            compared: list[_Compared] = []
            streams: dict[torch.device, torch.cuda.Stream] = {}
            seen: set[str] = set()
            try:
                on_host = self._host_compared(items)
                for name, tensor in items:
                    check_tensor(name, tensor, seen)
                    live = tensor.detach()
                    with self._on_side_stream(live, streams):
                        live = live.contiguous()
                        if name in on_host:  # staged whole: its changes are found on landing, fresh or not
                            if live.is_cuda:
                                self.ring.reserve(0)
                            capture = _TensorCapture(name, live.dtype, live.shape, None, [], [],
                                                     place=places[name])
                            captures.append(capture)
                            compared.append(_Compared(capture, live, [], whole=True))
                            continue
                        buffer = old.pop(name, None)
                        if buffer is not None and (buffer.dtype, buffer.shape, buffer.device) != (
                                live.dtype, live.shape, live.device):
                            buffer = None
                        if buffer is None or previous is None:
                            if buffer is None:
                                buffer = torch.empty_like(live, memory_format=torch.contiguous_format)
                            buffer.copy_(live)
                            captures.append(_TensorCapture(name, live.dtype, live.shape, buffer,
                                                           place=places[name]))
                        else:
                            capture = _TensorCapture(name, live.dtype, live.shape, buffer, [], [],
                                                     place=places[name])
                            captures.append(capture)
                            if live.numel() * live.element_size() <= self.whole_bytes:
                                compared.append(_Compared(capture, live, [], whole=True))
                            else:
                                compared.append(self._spans(capture, live))
                    resident[name] = buffer
                if previous is None:
                    self._warm_up(resident.values())
                declined = self._record(compared, limit, streams)
            except BaseException:
                self._resident, self._version, self._mirror = {}, None, {}
                raise
            finally:  # the caller's later kernels (which may change the tensors) wait for the capture's reads
                ready = {device: stream.record_event() for device, stream in streams.items()}
                for device, stream in streams.items():
                    torch.cuda.current_stream(device).wait_stream(stream)
            self._resident, self._version = resident, version
            self._places = places
            capture = DeviceCapture(version, previous, declined, captures, ready)
            if not streams and all(item.positions is not None for item in captures):
                capture.released.set()  # on the CPU the back half reads only the payload, in tensors of its own
            self._released = capture.released
            return capture

    def _host_compared(self, items: list[tuple[str, torch.Tensor]]) -> set[str]:
        """The names of the smallest tensors within ``host_compared_ratio`` of the model's bytes and half
        the ring (see :data:`HOST_COMPARED_RATIO`)."""
        sizes = sorted((t.numel() * t.element_size(), n) for n, t in items if isinstance(t, torch.Tensor))
        budget = min(self.host_compared_ratio * sum(size for size, _ in sizes),
                     self.ring.slot_bytes * self.ring.slots // 2)
        names: set[str] = set()
        for size, name in sizes:
            budget -= size
            if budget < 0:
                break
            names.add(name)
        return names

    def _spans(self, capture: _TensorCapture, live: torch.Tensor) -> _Compared:
        """``live`` and its resident copy as integer views, cut in spans."""
        assert capture.resident is not None
        ints = codec.INT_OF_SIZE[live.element_size()]
        old_ints, new_ints = capture.resident.view(-1).view(ints), live.view(-1).view(ints)
        kernels = self._kernels_for(live.device)
        span_bytes = self.span_bytes
        if span_bytes is None and not isinstance(kernels, TritonKernels):
            span_bytes = SPAN_BYTES
        span = MAX_SPAN_ELEMENTS if span_bytes is None else max(1, min(span_bytes // live.element_size(),
                                                                       MAX_SPAN_ELEMENTS))
        if live.numel() <= span:  # one span (most tensors): no slicing
            spans = [(0, old_ints, new_ints)] if live.numel() else []
        else:
            spans = [(start, old_ints[start:start + span], new_ints[start:start + span])
                     for start in range(0, live.numel(), span)]
        return _Compared(capture, live, spans)

    def _warm_up(self, tensors: Iterable[torch.Tensor]) -> None:
        """Prepare the CUDA devices' kernels for these tensors' dtypes, on a thread (Triton's first
        compilation takes seconds: it happens while the first version, which needs no kernels, is written)."""
        dtypes: dict[torch.device, set[torch.dtype]] = {}
        for tensor in tensors:
            if tensor.is_cuda and tensor.numel() * tensor.element_size() > self.whole_bytes:
                dtypes.setdefault(tensor.device, set()).add(codec.INT_OF_SIZE[tensor.element_size()])
        if dtypes and self._warming is None:
            self._warming = threading.Thread(target=self._warm_up_devices, args=(dtypes,), daemon=True,
                                             name="ckptstream-kernels")
            self._warming.start()

    def _warm_up_devices(self, dtypes: dict[torch.device, set[torch.dtype]]) -> None:
        for device, kinds in dtypes.items():
            kernels = self._kernels_for(device, wait=False)
            try:
                with torch.cuda.device(device):
                    kernels.warm_up(kinds, device)
            except Exception as exc:  # a GPU or Triton build the kernels do not compile for: the torch ops
                log.warning("the device encoder's Triton kernels failed on %s (%s); using torch ops", device, exc)
                self._kernels[device] = TorchKernels()

    def _kernels_for(self, device: torch.device, *, wait: bool = True) -> ChangeKernels:
        if wait and self._warming is not None:
            self._warming.join()
            self._warming = None
        if self._given_kernels is not None:
            return self._given_kernels
        kernels = self._kernels.get(device)
        if kernels is None:
            kernels = self._kernels[device] = kernels_for(device)
        return kernels

    def _record(self, compared: list[_Compared], limit: float, streams: dict[torch.device, torch.cuda.Stream]
                ) -> bool:
        """Count the changes of every span block by block (one kernel per span, one buffer per device), read
        the spans' totals (one sync per device), then record every changed span's payload (and stage the
        small tensors whole) and update the resident copies; or, where the payload would outgrow ``limit``
        (or, on CUDA, what is staged the pinned block), copy the tensors whole. Returns whether the payload
        was declined."""
        by_device: dict[torch.device, list[_Compared]] = {}
        for item in compared:
            if item.spans:  # (the kernels of a device are first needed here: the first capture stages only)
                by_device.setdefault(item.live.device, []).append(item)
        # per span: the device's blocks' inclusive prefix sums and counts, its first block, base, changed elements
        counted: dict[int, list[tuple[torch.Tensor, torch.Tensor, int, int, int]]] = {}
        for device, items in by_device.items():
            kernels = self._kernels_for(device)
            with _on_stream(streams, device):
                block_ranges: list[tuple[int, int]] = []
                for item in items:
                    for _, old, _ in item.spans:
                        first = block_ranges[-1][1] if block_ranges else 0
                        block_ranges.append((first, first + device_kernels.blocks(old.numel())))
                total_blocks = block_ranges[-1][1] if block_ranges else 0
                counts = torch.empty(total_blocks, dtype=torch.int32, device=device)
                spans = [(old, new) for item in items for _, old, new in item.spans]
                for (old, new), (first, _) in zip(spans, block_ranges):
                    kernels.count_blocks(old, new, counts, first)
                ends = device_kernels.prefix_sums(counts)
                totals = device_kernels.span_totals(ends, [end - 1 for _, end in block_ranges])  # the one wait
            bases = [0] + totals[:-1]
            numbered = iter(zip(block_ranges, bases, totals))
            for item in items:
                counted[id(item)] = [(ends, counts, first, base, total - base)
                                     for (first, _), base, total in (next(numbered) for _ in item.spans)]
        payload = sum(_aligned(4 * changed) + _aligned(item.live.element_size() * changed)
                      for item in compared for *_, changed in counted.get(id(item), []) if changed)
        # the tensors staged whole are not changes: they count against the pinned block only
        staged = payload + sum(_aligned(item.live.numel() * item.live.element_size()) for item in compared
                               if item.whole)
        on_cuda = any(item.live.is_cuda for item in compared)
        declined = payload > limit or (on_cuda and staged > self.ring.pinned_bytes)
        if declined:  # copied whole from the resident copies; those without one are staged still (they fit)
            for item in compared:
                if item.capture.resident is not None:
                    with _on_stream(streams, item.live.device):
                        item.capture.resident.copy_(item.live)
                    item.capture.positions = None
            compared = [item for item in compared if item.capture.resident is None]
        offset = 0
        grouped: dict[torch.device, list[_Compared]] = {}
        for item in compared:
            grouped.setdefault(item.live.device, []).append(item)
        for device, items in grouped.items():  # (one stream context per device: ~10 us of host time each)
            with _on_stream(streams, device):
                for item in items:
                    if item.whole:
                        offset = self._record_whole(item, offset)
                        continue
                    if not item.spans:  # empty
                        continue
                    kernels = self._kernels_for(device)
                    for (start, old_span, new_span), (ends, counts, first, base, changed) in zip(
                            item.spans, counted[id(item)]):
                        if changed:
                            positions, xor_values = kernels.compact(old_span, new_span, ends, counts, first, base,
                                                                    changed)
                            offset = self._record_span(item.capture, positions, xor_values, start, offset)
        return declined

    def _record_whole(self, item: _Compared, offset: int) -> int:
        """Stage the tensor's new bytes whole (on CUDA in the pinned block at ``offset``) and update its
        resident copy, where it has one. Returns the next free offset."""
        new_ints = item.live.view(-1).view(codec.INT_OF_SIZE[item.live.element_size()])
        if item.capture.resident is not None:
            item.capture.resident.copy_(item.live)
        if item.live.is_cuda:
            assert self.ring.block is not None
            nbytes = new_ints.numel() * new_ints.element_size()
            item.capture.whole = self.ring.block[offset:offset + nbytes].view(new_ints.dtype)
            item.capture.whole.copy_(new_ints, non_blocking=True)
            return offset + _aligned(nbytes)
        item.capture.whole = new_ints.clone()
        return offset

    def _record_span(self, capture: _TensorCapture, positions: torch.Tensor, xor_values: torch.Tensor, start: int,
                     offset: int) -> int:
        """Record the changes of a span (int32 positions relative to ``start``, XOR values); on CUDA they go to
        the pinned block at ``offset``. Returns the next free offset."""
        if positions.is_cuda:
            assert self.ring.block is not None
            staged = []
            for part in (positions, xor_values):
                nbytes = part.numel() * part.element_size()
                host = self.ring.block[offset:offset + nbytes].view(part.dtype)
                host.copy_(part, non_blocking=True)
                staged.append(host)
                offset += _aligned(nbytes)
            positions, xor_values = staged
        assert capture.positions is not None
        capture.positions.append(positions)
        capture.values.append(xor_values)
        capture.starts.append(start)
        return offset

    def _on_side_stream(self, live: torch.Tensor, streams: dict[torch.device, torch.cuda.Stream]
                        ) -> contextlib.AbstractContextManager[object]:
        """For a CUDA tensor: the device's side stream, after the work queued on the current one before
        the capture's first tensor there (the trainer's, which produced them all: one wait per device, not
        one event per tensor), ``live`` kept alive for it; for others, nothing."""
        if not live.is_cuda:
            return contextlib.nullcontext()
        stream = streams.get(live.device)
        if stream is None:
            stream = self._streams.get(live.device)
            if stream is None:
                stream = self._streams[live.device] = torch.cuda.Stream(live.device)
            stream.wait_stream(torch.cuda.current_stream(live.device))
            streams[live.device] = stream
        live.record_stream(stream)
        return torch.cuda.stream(stream)

    def land(self, capture: DeviceCapture, executor: Executor, prepare: Prepare | None = None) -> LandedVersion:
        """Copy ``capture`` to the host and apply it to the mirror, which then holds its version; returns
        it at once (also kept as ``landed``), each tensor landing on ``executor``: its payload applied, its
        hash taken, then ``prepare`` run on its changes, in one task (the phases one after the other, each
        over all tensors, took 1.29 s for a 15 GB delta on 16 threads; in one task per tensor 0.71 s: the
        random writes of the payloads, the hashes' streaming reads and the sparse sections' arithmetic
        overlap). Call in version order, once per capture."""
        tensors: dict[str, Future[LandedTensor]] = {}
        capture.landing = True
        try:
            for event in capture.ready.values():
                event.synchronize()  # the payload is in the pinned block
            mirror = self._mirror
            entries: list[tuple[_TensorCapture, torch.Tensor]] = []
            compared: set[str] = set()  # the tensors whose changes are found (the others land whole)
            for item in capture.tensors:
                host = mirror.get(item.name)
                if host is not None and (host.dtype, host.shape) != (item.dtype, item.shape):
                    host = None
                if host is None:
                    if item.positions is not None and item.whole is None:
                        raise PublishError("the host mirror lacks a tensor the device holds",
                                           version=capture.version, tensor=item.name,
                                           hint="Publish again: the next version is a keyframe")
                    host = torch.empty(item.shape, dtype=item.dtype)
                elif item.positions is not None:
                    compared.add(item.name)
                entries.append((item, host))
            # the payloads first (they are in the block the ring's slots reuse)
            for item, host in entries:
                if item.positions is not None:
                    tensors[item.name] = executor.submit(_land_tensor, item, host, prepare
                                                         if item.name in compared else None, item.name in compared)
            from_resident = [(item, host) for item, host in entries if item.positions is None]
            if from_resident:
                _wait_all(tensors.values())
            if capture.ready:
                model = sum(item.nbytes for item in capture.tensors)
                # once, for the deltas; a power of two: torch's pinned allocator rounds sizes up to one
                self.ring.reserve(1 << max(0, int(self.max_payload_ratio * model).bit_length() - 1))
            for item, host in from_resident:
                assert item.resident is not None
                self.ring.copy(item.resident, host, capture.ready.get(item.resident.device))
                tensors[item.name] = executor.submit(_hash_whole, host)
        except BaseException:
            _wait_all(tensors.values())  # nothing may read the pinned block once it is released
            capture.released.set()
            raise
        _when_all_done([tensors[item.name] for item, _ in entries if item.positions is not None],
                       capture.released.set)
        landed = LandedVersion(capture.version, capture.previous, capture.declined, frozenset(compared),
                               {item.name: tensors[item.name] for item, _ in entries},
                               [(item.name, host) for item, host in entries], prepare is not None)
        with self._lock:
            self._mirror = dict(landed.mirror)
            self.landed = landed
        return landed

    @staticmethod
    def abandon(capture: DeviceCapture) -> None:
        """Release a capture that will not land (the next capture waits for it); one that ``land`` was
        given is released when its last tensor has landed."""
        if not capture.landing:
            capture.released.set()


def _on_stream(streams: dict[torch.device, torch.cuda.Stream], device: torch.device
               ) -> contextlib.AbstractContextManager[object]:
    """The capture's side stream of ``device`` where it has one (CUDA), else nothing."""
    return torch.cuda.stream(streams[device]) if device in streams else contextlib.nullcontext()


def _wait_all(futures: Iterable[Future[LandedTensor]]) -> None:
    for future in futures:
        with contextlib.suppress(Exception):
            future.result()


def _when_all_done(futures: list[Future[LandedTensor]], callback: Callable[[], None]) -> None:
    """Call ``callback`` once every one of ``futures`` is done (at once if there are none)."""
    left = [len(futures)]
    lock = threading.Lock()

    def one_done(_: Future[LandedTensor]) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            callback()

    if not futures:
        callback()
    for future in futures:
        future.add_done_callback(one_done)


def _land_tensor(item: _TensorCapture, host: torch.Tensor, prepare: Prepare | None, compared: bool) -> LandedTensor:
    """Apply one tensor's payload to its host mirror (then drop it: the pinned block is reused), hash the
    mirror, prepare the changes; a tensor new to the mirror (not ``compared``) is copied whole."""
    try:
        if not compared:
            assert item.whole is not None
            host.view(-1).view(item.whole.dtype).copy_(item.whole)
            return _hash_whole(host)
        positions, values = _apply(item, host)
    finally:
        item.values, item.whole = [], None
        item.positions = []
    if prepare is None:
        return LandedTensor((positions, values), codec.tensor_hash(host))
    # (the mirror holds the new values now: the old ones are them XOR the changes; numpy: no thread pool)
    new = host.view(-1).view(values.dtype).numpy()[positions.numpy()]
    place = item.place
    where = positions if place is None else codec.box_positions(positions, place.shape, place.offsets, place.box)
    check = codec.change_check(where, torch.from_numpy(new ^ values.numpy()), torch.from_numpy(new))
    return LandedTensor((positions, values), codec.tensor_hash(host), prepare(host, positions, values), check)


def _hash_whole(host: torch.Tensor) -> LandedTensor:
    """A tensor landed whole: its hash, no changes."""
    return LandedTensor(None, codec.tensor_hash(host))


def _encode_chunk(landed: Future[LandedTensor], number: int, start: int, end: int, itemsize: int, *, shuffle: bool,
                  level: int) -> tuple[bytes, int, str]:
    """Chunk ``number`` (bytes ``start:end``) of a landed tensor's delta, as ``codec.encode_xor_chunk``
    stores it: its sparse frame, or where too many elements changed its dense XOR (rebuilt from the
    changes)."""
    tensor = landed.result()
    chunks = tensor.prepared
    assert isinstance(chunks, codec.SparseChunks) and tensor.changes is not None
    changed = chunks.changed(number)
    elements = (end - start) // itemsize
    if changed <= codec.SPARSE_MAX_DENSITY * elements:
        return chunks.frame(number, level), changed, LAYOUT_SPARSE
    positions, values = tensor.changes
    lo, hi = chunks.bounds[number], chunks.bounds[number + 1]
    return codec.encode_xor_chunk(positions[lo:hi] - start // itemsize, itemsize, values=values[lo:hi],
                                  elements=elements, shuffle=shuffle, level=level)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _apply(item: _TensorCapture, host: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply one tensor's payload to its host mirror; returns it as host tensors of its own (int64
    tensor-relative positions, XOR values)."""
    ints = codec.INT_OF_SIZE[host.element_size()]
    flat = host.view(-1).view(ints)
    if item.whole is not None:  # the changes are found here
        positions = torch.nonzero(flat != item.whole).view(-1)
        values = flat.index_select(0, positions).bitwise_xor_(item.whole.index_select(0, positions))
        flat.copy_(item.whole)
        return positions, values
    assert item.positions is not None
    if not item.positions:
        return torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=ints)
    if len(item.positions) == 1:  # one span (every tensor, with Triton's kernels): no concatenation
        positions = item.positions[0].to(torch.int64)
        if item.starts[0]:
            positions.add_(item.starts[0])
        values = item.values[0].clone()  # out of the pinned block
    else:
        positions = torch.cat([p.to(torch.int64).add_(start) for p, start in zip(item.positions, item.starts)])
        values = torch.cat(item.values)
    flat.index_put_((positions,), flat.index_select(0, positions).bitwise_xor_(values))
    return positions, values


class DeviceDeltaEncoder:
    """Deltas from the changes a :class:`DeviceSnapshot` recorded on the device and landed on the host
    (``tensors`` must be that landed version's mirror): every chunk stored as ``codec.encode_xor_chunk``
    stores it for the host encoder, from the sparse layout of each tensor serialized at once
    (``codec.SparseChunks``, built by :meth:`prepare`, given to ``DeviceSnapshot.land``), compressed
    on ``executor``; a chunk waits only for its own tensor to land. A tensor is a delta on the base's
    tensor that the host encoder takes (``encode.base_tensor``: a piece on the same process's piece of the
    same box), its check taken as the changes land (a piece's at positions in its whole tensor).

    A version whose capture had no previous version (a fresh publisher, or one that failed) is encoded
    by ``fallback``, the host encoder, against the base decoded from the stream. Declines (None) where
    the capture outgrew its payload budget, the base is not the version the changes are against, the
    version landed without :meth:`prepare`, or the stored bytes outgrow ``max_ratio`` of the full bytes.
    """

    def __init__(self, snapshot: DeviceSnapshot, fallback: DeltaEncoder):
        self.snapshot = snapshot
        self.fallback = fallback

    def prepare(self, mirror: torch.Tensor, positions: torch.Tensor, values: torch.Tensor) -> codec.SparseChunks:
        """The sparse sections of every chunk of a tensor's delta (a :data:`Prepare` for ``land``)."""
        itemsize = mirror.element_size()
        return codec.SparseChunks(positions, values, itemsize, elements=mirror.numel(),
                                  chunk_elements=codec.chunk_elements(itemsize, self.fallback.chunk_bytes),
                                  shuffle=self.fallback.shuffle)

    def encode(self, tensors: Snapshot, base: BaseVersion | None, pieces: Pieces | None = None
               ) -> EncodedVersion | None:
        landed = self.snapshot.landed
        if base is None or landed is None or landed.declined or [n for n, _ in tensors] != [
                n for n, _ in landed.mirror] or any(a is not b for (_, a), (_, b) in zip(tensors, landed.mirror)):
            return None
        if landed.previous is None:
            landed.wait()
            mirrored = {id(t) for _, t in landed.mirror}
            if any(id(t) in mirrored for t in base.tensors.values()):
                return None  # the base's tensors were overwritten by this version
            return self.fallback.encode(tensors, base, pieces)
        if landed.previous != base.manifest.version or not landed.prepared:
            return None  # (landed without this encoder's sections: the publisher lands so only keyframes)
        chunk_bytes, host = self.fallback.chunk_bytes, self.fallback
        plans: list[EncodedTensor] = []
        tasks: list[tuple[int, int, Callable[[], tuple[bytes, int, str]]]] = []
        for index, (name, tensor) in enumerate(tensors):
            in_base = base_tensor(base, name, tensor) is not None
            if in_base != (name in landed.compared):
                return None  # the resident copies did not hold the base's tensors
            plans.append(EncodedTensor(name, tensor, ENCODING_XOR_ZSTD if in_base else ENCODING_ZSTD, changed=0))
            new_bytes, itemsize = codec.as_bytes(tensor), tensor.element_size()
            ranges = codec.chunk_ranges(new_bytes.numel(), itemsize, chunk_bytes)
            if not in_base:
                landed.tensors[name].result()  # landed whole (most already, with the capture): its chunks read it
                tasks.extend((index, end - start, partial(codec.encode_chunk, new_bytes[start:end], None, itemsize,
                                                          shuffle=host.shuffle, level=host.zstd_level))
                             for start, end in ranges)
                continue
            tasks.extend((index, end - start, partial(_encode_chunk, landed.tensors[name], number, start, end, itemsize,
                                                      shuffle=host.shuffle, level=host.zstd_level))
                         for number, (start, end) in enumerate(ranges))
        encoded = assemble_delta(plans, tasks, base.manifest, executor=host.executor, chunk_bytes=chunk_bytes,
                                 max_ratio=host.max_ratio, shuffle=host.shuffle)
        for plan in encoded.tensors if encoded is not None else ():
            if plan.encoding == ENCODING_XOR_ZSTD:  # (its tensor landed: its chunks waited for it)
                plan.check = landed.tensors[plan.name].result().check
        return encoded
