"""The device encoder: deltas of CUDA tensors computed where the tensors live.

Front half, ``DeviceSnapshot.take`` (what ``publish`` waits for): the snapshot buffer is a device-resident
copy of the last version (1x the model's bytes, on the tensors' devices). Per tensor, on a side CUDA
stream, span by span: the changed elements are found by ``nonzero(resident != live)`` on integer views,
their XOR values gathered, and the resident copy updated at those positions. Only this compact payload
(positions, XOR values) is kept for the back half. A tensor without a resident copy (the first version, a
new tensor, a payload over its budget) is copied device-to-device instead.

Back half, on the publisher's background thread: ``DeviceSnapshot.land`` copies the payload (or, for
full tensors, the resident copies) to the host through a small ring of reused pinned buffers and applies it
to a host mirror of the last version (pageable memory; the hashes and keyframes are computed from it).
``DeviceDeltaEncoder`` then serializes and compresses every chunk on host threads with the host encoder's
own function, ``codec.encode_xor_chunk``, so both encoders store the same bytes for the same tensors.

Everything is written with torch ops that run on any device: the CPU run of the same code is the reference
tested against the host encoder. The CUDA-only parts (side streams, events, the pinned ring) are guarded
by ``is_cuda``.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from concurrent.futures import Executor
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Mapping

import torch

from .. import codec
from ..errors import PublishError
from ..format import ENCODING_XOR_ZSTD, ENCODING_ZSTD
from .encode import BaseVersion, DeltaEncoder, EncodedTensor, EncodedVersion, Snapshot, assemble_delta
from .snapshot import NamedTensors, check_tensor

MAX_PAYLOAD_RATIO = 0.1
"""A version's compact payload (positions and XOR values, on the device until the back half copies it)
may reach this fraction of the model's bytes; beyond it the version becomes a keyframe. Bounds the extra
device memory next to the snapshot buffer, and the delta would hardly pay anyway (more than ~3 % of bf16
elements changed)."""

SPAN_BYTES = 64 << 20
"""Change detection runs over spans of at most this many bytes of a tensor: bounds the device memory of
one ``nonzero`` (its int64 output is 4x a fully changed bf16 span)."""

RING_SLOT_BYTES = 32 << 20
RING_SLOTS = 4
"""The pinned ring through which device bytes reach the host: 4 x 32 MiB of pinned memory."""


@dataclass
class _TensorCapture:
    """One tensor of a capture: its resident copy (holding this version) and its changes since the
    previous one, span by span (``positions`` None: nothing recorded, the tensor is copied whole)."""

    name: str
    resident: torch.Tensor
    positions: list[torch.Tensor] | None = None  # tensor-relative element indices, ascending
    values: list[torch.Tensor] = field(default_factory=list)  # XOR values at those positions

    @property
    def payload_bytes(self) -> int:
        """Bytes of the compact payload (positions and values) held on the device."""
        return sum(p.numel() * p.element_size() for p in (self.positions or []) + self.values)


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
    """Per CUDA device, an event after the capture's last kernel."""
    released: threading.Event = field(default_factory=threading.Event)
    """Set once the back half no longer reads the resident copies (the next capture waits for it)."""


@dataclass
class LandedVersion:
    """A capture applied to the host mirror: per tensor, the changes as host tensors (int64 positions,
    XOR values), or None for a tensor copied whole."""

    version: int
    previous: int | None
    declined: bool
    changes: dict[str, tuple[torch.Tensor, torch.Tensor] | None]
    mirror: list[tuple[str, torch.Tensor]]


class PinnedRing:
    """Copies device bytes into host tensors through ``slots`` reused pinned buffers of ``slot_bytes``,
    on a copy stream of its own: the pinned memory stays small whatever the size of the copy. Used from
    one thread at a time (the publisher's background thread)."""

    def __init__(self, slot_bytes: int = RING_SLOT_BYTES, slots: int = RING_SLOTS):
        self.slot_bytes = slot_bytes
        self.slots = slots
        self._buffers: list[torch.Tensor] = []
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    @property
    def pinned_bytes(self) -> int:
        """Pinned host memory held."""
        return sum(b.numel() for b in self._buffers)

    def copy(self, src: torch.Tensor, dst: torch.Tensor, after: torch.cuda.Event | None = None) -> None:
        """``dst[:] = src`` for a contiguous ``src`` on any device and a contiguous host ``dst`` of the same
        bytes; for a CUDA ``src``, once ``after`` (an event of the stream that wrote it) has passed."""
        src_bytes, dst_bytes = codec.as_bytes(src), codec.as_bytes(dst)
        if not src.is_cuda:
            dst_bytes.copy_(src_bytes)
            return
        stream = self._streams.get(src.device)
        if stream is None:
            stream = self._streams[src.device] = torch.cuda.Stream(src.device)
        if not self._buffers:
            self._buffers = [torch.empty(self.slot_bytes, dtype=torch.uint8, pin_memory=True)
                             for _ in range(self.slots)]
        if after is not None:
            stream.wait_event(after)
        pending: deque[tuple[torch.cuda.Event, torch.Tensor, int, int]] = deque()
        with torch.cuda.stream(stream):
            for number, start in enumerate(range(0, src_bytes.numel(), self.slot_bytes)):
                end = min(start + self.slot_bytes, src_bytes.numel())
                if len(pending) == self.slots:
                    _drain(pending.popleft(), dst_bytes)
                buffer = self._buffers[number % self.slots]
                buffer[:end - start].copy_(src_bytes[start:end], non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
                pending.append((event, buffer, start, end))
        while pending:
            _drain(pending.popleft(), dst_bytes)

    def clear(self) -> None:
        """Release the pinned buffers."""
        self._buffers = []


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
        span_bytes: see :data:`SPAN_BYTES` (the default).
        ring: the pinned ring (default 4 x 32 MiB).
    """

    def __init__(self, *, max_payload_ratio: float | None = None, span_bytes: int | None = None,
                 ring: PinnedRing | None = None):
        self.max_payload_ratio = MAX_PAYLOAD_RATIO if max_payload_ratio is None else max_payload_ratio
        self.span_bytes = SPAN_BYTES if span_bytes is None else span_bytes
        self.ring = ring if ring is not None else PinnedRing()
        self._lock = threading.Lock()
        self._resident: dict[str, torch.Tensor] = {}
        self._version: int | None = None  # the version the resident copies hold
        self._released: threading.Event | None = None  # the last capture's
        self._mirror: dict[str, torch.Tensor] = {}
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self.landed: LandedVersion | None = None
        """The last version ``land`` applied (what :class:`DeviceDeltaEncoder` encodes)."""

    @property
    def device_memory_bytes(self) -> int:
        """Device memory held by the snapshot buffer (the resident copies on CUDA devices)."""
        with self._lock:
            return sum(t.numel() * t.element_size() for t in self._resident.values() if t.is_cuda)

    @property
    def pinned_bytes(self) -> int:
        """Pinned host memory held (the ring)."""
        return self.ring.pinned_bytes

    def reset(self) -> None:
        """Forget the resident copies and the mirror (after a failure, or when the host path takes over):
        the next capture copies every tensor whole."""
        with self._lock:
            self._resident, self._version, self._mirror, self.landed = {}, None, {}, None
            self._released = None

    def clear(self) -> None:
        """Release every buffer, device and pinned."""
        self.reset()
        self.ring.clear()

    def take(self, named_tensors: NamedTensors, version: int) -> DeviceCapture:
        """Record ``version`` of the tensors: their changes against the resident copies, which then hold
        ``version``. Returns once the caller may change the tensors (their later kernels on the current
        stream are ordered after the capture's reads). Raises as ``SnapshotBuffers.take`` does; after a
        failure the resident copies are forgotten."""
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        with self._lock:
            if self._released is not None:
                self._released.wait()  # the back half of a full capture still reads the resident copies
            previous, old = self._version, self._resident
            limit = self.max_payload_ratio * sum(t.numel() * t.element_size() for t in old.values())
            resident: dict[str, torch.Tensor] = {}
            captures: list[_TensorCapture] = []
            streams: dict[torch.device, torch.cuda.Stream] = {}
            seen: set[str] = set()
            payload, declined = 0, False
            try:
                for name, tensor in items:
                    check_tensor(name, tensor, seen)
                    live = tensor.detach()
                    with self._on_side_stream(live, streams):
                        live = live.contiguous()
                        buffer = old.pop(name, None)
                        if buffer is not None and (buffer.dtype, buffer.shape, buffer.device) != (
                                live.dtype, live.shape, live.device):
                            buffer = None
                        if buffer is None or previous is None or declined:
                            if buffer is None:
                                buffer = torch.empty_like(live, memory_format=torch.contiguous_format)
                            buffer.copy_(live)
                            captures.append(_TensorCapture(name, buffer))
                        else:
                            capture = self._changes(name, buffer, live)
                            captures.append(capture)
                            payload += capture.payload_bytes
                            if payload > limit:  # drop the payload: the resident copies are right already
                                declined = True
                                for item in captures:
                                    item.positions, item.values = None, []
                    resident[name] = buffer
            except BaseException:
                self._resident, self._version, self._mirror = {}, None, {}
                raise
            finally:  # the caller's later kernels (which may change the tensors) wait for the capture's reads
                ready = {device: stream.record_event() for device, stream in streams.items()}
                for device, stream in streams.items():
                    torch.cuda.current_stream(device).wait_stream(stream)
            self._resident, self._version = resident, version
            capture = DeviceCapture(version, previous, declined, captures, ready)
            if all(item.positions is not None for item in captures):
                capture.released.set()  # the back half reads only the payload
            self._released = capture.released
            return capture

    def _on_side_stream(self, live: torch.Tensor, streams: dict[torch.device, torch.cuda.Stream]
                        ) -> contextlib.AbstractContextManager[object]:
        """For a CUDA tensor: the device's side stream, after the work queued so far on the current one
        (``live`` is kept alive for it); for others, nothing."""
        if not live.is_cuda:
            return contextlib.nullcontext()
        stream = self._streams.get(live.device)
        if stream is None:
            stream = self._streams[live.device] = torch.cuda.Stream(live.device)
        stream.wait_stream(torch.cuda.current_stream(live.device))
        live.record_stream(stream)
        streams[live.device] = stream
        return torch.cuda.stream(stream)

    def _changes(self, name: str, buffer: torch.Tensor, live: torch.Tensor) -> _TensorCapture:
        """The changed elements of ``live`` against ``buffer`` (which is updated to ``live``), span by span."""
        ints = codec.INT_OF_SIZE[live.element_size()]
        old_ints, new_ints = buffer.view(-1).view(ints), live.view(-1).view(ints)
        count = new_ints.numel()
        index_dtype = torch.int32 if count < 2 ** 31 else torch.int64
        span = max(1, self.span_bytes // live.element_size())
        capture = _TensorCapture(name, buffer, [], [])
        for start in range(0, count, span):
            old_span, new_span = old_ints[start:start + span], new_ints[start:start + span]
            positions = torch.nonzero(old_span != new_span).view(-1)  # waits for the count
            if not positions.numel():
                continue
            # index_select/index_copy_ rather than indexing: the same kernels, half the time per call in Python
            new_values = new_span.index_select(0, positions)
            xor_values = old_span.index_select(0, positions).bitwise_xor_(new_values)
            old_span.index_copy_(0, positions, new_values)
            assert capture.positions is not None
            capture.positions.append((positions + start if start else positions).to(index_dtype))
            capture.values.append(xor_values)
        return capture

    def land(self, capture: DeviceCapture, executor: Executor) -> LandedVersion:
        """Copy ``capture`` to the host and apply it to the mirror, which then holds its version; returns
        it (also kept as ``landed``). Call in version order, once per capture."""
        try:
            mirror = self._mirror
            copied: list[tuple[_TensorCapture, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]] = []
            for item in capture.tensors:
                after = capture.ready.get(item.resident.device)
                host = mirror.get(item.name)
                if host is not None and (host.dtype, host.shape) != (item.resident.dtype, item.resident.shape):
                    host = None
                if item.positions is None:
                    if host is None:
                        host = torch.empty(item.resident.shape, dtype=item.resident.dtype)
                    self.ring.copy(item.resident, host, after)
                    copied.append((item, host, None))
                    continue
                if host is None:
                    raise PublishError("the host mirror lacks a tensor the device holds", version=capture.version,
                                       tensor=item.name, hint="Publish again: the next version is a keyframe")
                copied.append((item, host, (self._to_host(item.positions, torch.int64, after),
                                            self._to_host(item.values, item.values[0].dtype if item.values else
                                                          codec.INT_OF_SIZE[host.element_size()], after))))
        finally:
            capture.released.set()
            for item in capture.tensors:  # the device payload is on the host now: free it
                item.values = []
                if item.positions is not None:
                    item.positions = []

        def apply(entry: tuple[_TensorCapture, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]) -> None:
            _, host, change = entry
            if change is not None and change[0].numel():
                ints = host.view(-1).view(codec.INT_OF_SIZE[host.element_size()])
                ints.index_put_((change[0],), ints[change[0]].bitwise_xor_(change[1]))

        list(executor.map(apply, copied))
        landed = LandedVersion(capture.version, capture.previous, capture.declined,
                               {item.name: change for item, _, change in copied},
                               [(item.name, host) for item, host, _ in copied])
        with self._lock:
            self._mirror = dict(landed.mirror)
            self.landed = landed
        return landed

    def _to_host(self, parts: list[torch.Tensor], dtype: torch.dtype, after: torch.cuda.Event | None) -> torch.Tensor:
        """The concatenation of device ``parts`` as one host tensor of ``dtype``, through the ring."""
        out = []
        for part in parts:
            host = torch.empty(part.shape, dtype=part.dtype)
            self.ring.copy(part, host, after)
            out.append(host)
        return torch.cat(out).to(dtype) if out else torch.empty(0, dtype=dtype)


class DeviceDeltaEncoder:
    """Deltas from the changes a :class:`DeviceSnapshot` recorded on the device and landed on the host
    (``tensors`` must be that landed version's mirror): every chunk serialized by
    ``codec.encode_xor_chunk`` and compressed on ``executor``, as the host encoder does.

    A version whose capture had no previous version (a fresh publisher, or one that failed) is encoded
    by ``fallback``, the host encoder, against the base decoded from the stream. Declines (None) where
    the capture outgrew its payload budget, the base is not the version the changes are against, or the
    stored bytes outgrow ``max_ratio`` of the full bytes.
    """

    def __init__(self, snapshot: DeviceSnapshot, fallback: DeltaEncoder):
        self.snapshot = snapshot
        self.fallback = fallback

    def encode(self, tensors: Snapshot, base: BaseVersion | None) -> EncodedVersion | None:
        landed = self.snapshot.landed
        if base is None or landed is None or landed.declined or [n for n, _ in tensors] != [
                n for n, _ in landed.mirror] or any(a is not b for (_, a), (_, b) in zip(tensors, landed.mirror)):
            return None
        if landed.previous is None:
            mirrored = {id(t) for _, t in landed.mirror}
            if any(id(t) in mirrored for t in base.tensors.values()):
                return None  # the base's tensors were overwritten by this version
            return self.fallback.encode(tensors, base)
        if landed.previous != base.manifest.version:
            return None
        entries = base.manifest.tensor_map()
        chunk_bytes, host = self.fallback.chunk_bytes, self.fallback
        plans: list[EncodedTensor] = []
        tasks: list[tuple[int, int, Callable[[], tuple[bytes, int, str]]]] = []
        for index, (name, tensor) in enumerate(tensors):
            change = landed.changes[name]
            entry = entries.get(name)
            in_base = entry is not None and (entry.dtype, entry.shape) == (codec.dtype_name(tensor.dtype),
                                                                            tuple(tensor.shape))
            if in_base != (change is not None):
                return None  # the resident copies did not hold the base's tensors
            plans.append(EncodedTensor(name, tensor, ENCODING_XOR_ZSTD if in_base else ENCODING_ZSTD, changed=0))
            new_bytes, itemsize = codec.as_bytes(tensor), tensor.element_size()
            ranges = codec.chunk_ranges(new_bytes.numel(), itemsize, chunk_bytes)
            if change is None:
                tasks.extend((index, end - start, partial(codec.encode_chunk, new_bytes[start:end], None, itemsize,
                                                          shuffle=host.shuffle, level=host.zstd_level))
                             for start, end in ranges)
                continue
            positions, values = change
            bounds = torch.searchsorted(positions, torch.tensor([start // itemsize for start, _ in ranges]
                                                                + [new_bytes.numel() // itemsize]))
            for number, (start, end) in enumerate(ranges):
                lo, hi = int(bounds[number]), int(bounds[number + 1])
                first = start // itemsize
                tasks.append((index, end - start, partial(
                    codec.encode_xor_chunk, positions[lo:hi] - first, itemsize, values=values[lo:hi],
                    elements=(end - start) // itemsize, shuffle=host.shuffle, level=host.zstd_level)))
        return assemble_delta(plans, tasks, base.manifest, executor=host.executor, chunk_bytes=chunk_bytes,
                              max_ratio=host.max_ratio, shuffle=host.shuffle)

