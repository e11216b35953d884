"""Encoders: a version's tensors as a keyframe or as a delta against a base version, on the host.

An encoder turns a snapshot into an ``EncodedVersion`` (what to store per tensor) and never touches
storage. ``KeyframeEncoder`` and ``DeltaEncoder`` share the small ``Encoder`` interface, so another
implementation (a device-side delta encoder running beside the trainer) can take the place of the host
one. ``VersionEncoder`` holds the one keyframe-or-delta decision.
"""

from __future__ import annotations

import logging
from concurrent.futures import Executor
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Mapping, Protocol, Sequence

import torch

from .. import codec
from ..format import (DELTA, ENCODING_RAW, ENCODING_UNCHANGED, ENCODING_XOR_ZSTD, ENCODING_ZSTD, KEYFRAME,
                      ChangeCheck, Manifest)
from ..parallel import ordered_parallel
from .pieces import PieceOf

log = logging.getLogger("ckptstream.publish")

Snapshot = Sequence[tuple[str, torch.Tensor]]


@dataclass
class BaseVersion:
    """A committed version with its tensors in host memory: what a delta is encoded against."""

    manifest: Manifest
    tensors: dict[str, torch.Tensor]


@dataclass
class EncodedTensor:
    """How one tensor of a version is stored.

    ``frames`` are the zstd frames of a chunked encoding (one per chunk, described by ``chunks``); a
    ``raw`` tensor stores the snapshot's bytes themselves and an ``unchanged`` one stores nothing.
    ``changed`` counts elements whose bits differ from the base (deltas only); ``check`` is the check of
    those changes (FORMAT.md, "Change checks") of an ``xor-zstd`` tensor.
    """

    name: str
    tensor: torch.Tensor
    encoding: str
    frames: list[bytes] = field(default_factory=list)
    chunks: list[tuple[int, int, str]] = field(default_factory=list)
    changed: int | None = None
    check: ChangeCheck | None = None


@dataclass
class EncodedVersion:
    """A version's tensors, encoded: a keyframe (``base`` None) or a delta against ``base``."""

    kind: str
    base: Manifest | None
    tensors: list[EncodedTensor]
    shuffle: bool = False


Pieces = Mapping[str, PieceOf]
"""The tensors of a snapshot that are pieces of a whole tensor, by name: where each lies in its whole."""


class Encoder(Protocol):
    """Encodes a snapshot, or declines (None) where its encoding would not pay."""

    def encode(self, tensors: Snapshot, base: BaseVersion | None, pieces: Pieces | None = None
               ) -> EncodedVersion | None:
        """The encoded version of ``tensors`` (against ``base`` where the encoding uses one; ``pieces``: those
        of them that are pieces of a whole tensor, whose change checks are taken at positions in the whole)."""
        ...


def base_tensor(base: BaseVersion, name: str, tensor: torch.Tensor) -> torch.Tensor | None:
    """The base's tensor that ``tensor`` is a delta on: the one of the same name, dtype and shape (a piece's
    base is the same process's piece of the same box: the publisher leaves the others out of ``base``), else
    None. Shared by the host and the device encoders, so that both write the same encodings."""
    previous = base.tensors.get(name)
    if previous is not None and (previous.dtype, previous.shape) != (tensor.dtype, tensor.shape):
        return None
    return previous


class KeyframeEncoder:
    """Keyframes: every tensor stored raw, as a plain safetensors file holds it."""

    def encode(self, tensors: Snapshot, base: BaseVersion | None = None, pieces: Pieces | None = None
               ) -> EncodedVersion:
        return EncodedVersion(KEYFRAME, None, [EncodedTensor(name, tensor, ENCODING_RAW) for name, tensor in tensors])


class DeltaEncoder:
    """Deltas on the host: per tensor, the XOR against the base's tensor of the same name (or the tensor
    itself where the base has none of that dtype and shape), byte-shuffled and zstd-compressed in
    independent chunks, encoded in parallel on ``executor``. Each XOR gets its check (FORMAT.md, "Change
    checks"), taken at positions in the whole tensor for a piece (``pieces``).

    Declines (None) as soon as the stored bytes outgrow ``max_ratio`` of the full bytes.
    """

    def __init__(self, executor: Executor, *, chunk_bytes: int = codec.DEFAULT_CHUNK_BYTES, zstd_level: int = 1,
                 shuffle: bool = True, max_ratio: float = 0.5):
        self.executor = executor
        self.chunk_bytes = chunk_bytes
        self.zstd_level = zstd_level
        self.shuffle = shuffle
        self.max_ratio = max_ratio

    def encode(self, tensors: Snapshot, base: BaseVersion | None, pieces: Pieces | None = None
               ) -> EncodedVersion | None:
        if base is None:
            return None
        plans: list[EncodedTensor] = []
        tasks: list[ChunkTask] = []
        for index, (name, tensor) in enumerate(tensors):
            previous = base_tensor(base, name, tensor)
            new_bytes = codec.as_bytes(tensor)
            base_bytes = codec.as_bytes(previous) if previous is not None else None
            plans.append(EncodedTensor(name, tensor, ENCODING_XOR_ZSTD if previous is not None else ENCODING_ZSTD,
                                       changed=0, check=ChangeCheck() if previous is not None else None))
            itemsize = tensor.element_size()
            piece = (pieces or {}).get(name)
            place = None if piece is None else (piece.shape, piece.offsets, piece.box)
            for start, end in codec.chunk_ranges(new_bytes.numel(), itemsize, self.chunk_bytes):
                if base_bytes is None:
                    task = partial(codec.encode_chunk, new_bytes[start:end], None, itemsize, shuffle=self.shuffle,
                                   level=self.zstd_level)
                else:
                    task = partial(codec.encode_checked_chunk, new_bytes[start:end], base_bytes[start:end], itemsize,
                                   first=start // itemsize, place=place, shuffle=self.shuffle, level=self.zstd_level)
                tasks.append((index, end - start, task))
        return assemble_delta(plans, tasks, base.manifest, executor=self.executor, chunk_bytes=self.chunk_bytes,
                              max_ratio=self.max_ratio, shuffle=self.shuffle)


ChunkTask = tuple[int, int, Callable[[], tuple[bytes, int, str] | tuple[bytes, int, str, ChangeCheck]]]
"""One chunk to encode: the index of its tensor's plan, its raw bytes, and the call returning its stored
frame, changed elements, layout and (the host encoder's ``xor-zstd`` chunks) the check of its changes."""


def assemble_delta(plans: list[EncodedTensor], tasks: list[ChunkTask], base: Manifest, *, executor: Executor,
                   chunk_bytes: int, max_ratio: float, shuffle: bool) -> EncodedVersion | None:
    """Run the chunk tasks on ``executor`` (in order, bounded memory) and fill their tensors' plans: the
    delta on ``base``, or None as soon as the stored bytes outgrow ``max_ratio`` of the full bytes. A delta
    plan without changes becomes ``unchanged``; a plan's check is the sum of its chunks' where each gave one
    (the device encoder's chunks give none: it takes its tensors' checks as they land). Shared by the host
    and the device encoders."""
    limit = max_ratio * sum(plan.tensor.numel() * plan.tensor.element_size() for plan in plans)
    stored = 0
    results = ordered_parallel(tasks, lambda task: (task[0], task[1], *task[2]()), lambda task: task[1],
                               executor=executor, max_cost=max(chunk_bytes, 64 << 20) * 4)
    try:
        for index, raw_len, frame, changed, layout, *check in results:
            plan = plans[index]
            plan.frames.append(frame)
            plan.chunks.append((raw_len, len(frame), layout))
            plan.changed = (plan.changed or 0) + changed
            plan.check = plan.check + check[0] if plan.check is not None and check else None
            stored += len(frame)
            if stored > limit:
                log.info("delta exceeds %.0f%% of the full size; writing a keyframe", 100 * max_ratio)
                return None
    finally:
        results.close()
    for plan in plans:
        if plan.encoding == ENCODING_XOR_ZSTD and plan.changed == 0:
            plan.encoding, plan.frames, plan.chunks, plan.check = ENCODING_UNCHANGED, [], [], None
    return EncodedVersion(DELTA, base, plans, shuffle=shuffle)


class VersionEncoder:
    """The keyframe-or-delta decision: a delta where one is allowed and pays, else a keyframe.

    A delta is allowed when there is a base, no keyframe is forced and the chain stays shorter than
    ``keyframe_every``.
    """

    def __init__(self, delta: Encoder, keyframe: Encoder | None = None, *, keyframe_every: int = 10):
        self.delta = delta
        self.keyframe_encoder = keyframe if keyframe is not None else KeyframeEncoder()
        self.keyframe_every = keyframe_every

    def allows_delta(self, base: BaseVersion | None, *, force_keyframe: bool = False) -> bool:
        """Whether a delta against ``base`` may be tried (else the version is a keyframe)."""
        return not force_keyframe and base is not None and base.manifest.chain_length + 1 < self.keyframe_every

    def try_delta(self, tensors: Snapshot, base: BaseVersion | None, *, force_keyframe: bool = False,
                  pieces: Pieces | None = None) -> EncodedVersion | None:
        """The delta against ``base``, or None where this version is to be a keyframe. ``pieces``: the tensors
        that are pieces of a whole (see ``Encoder.encode``)."""
        if not self.allows_delta(base, force_keyframe=force_keyframe):
            return None
        assert base is not None
        return self.delta.encode(tensors, base, pieces)

    def keyframe(self, tensors: Snapshot) -> EncodedVersion:
        """The keyframe of ``tensors``."""
        encoded = self.keyframe_encoder.encode(tensors, None)
        assert encoded is not None, "a keyframe encoder never declines"
        return encoded

    def encode(self, tensors: Snapshot, base: BaseVersion | None, *, force_keyframe: bool = False) -> EncodedVersion:
        """A delta where one is allowed and pays, else a keyframe."""
        return self.try_delta(tensors, base, force_keyframe=force_keyframe) or self.keyframe(tensors)
