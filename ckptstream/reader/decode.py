"""Decoding tensors of a version: reading stored bytes, checking hashes, applying delta chains.

Each tensor is decoded on its own (its stored ranges are read directly), so tensors decode in parallel
and memory stays bounded by the tensors in flight.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from .. import codec
from ..errors import IntegrityError
from ..format import (CHUNKED_ENCODINGS, ENCODING_PIECES, ENCODING_RAW, ENCODING_UNCHANGED, ENCODING_XOR_ZSTD,
                      ENCODING_ZSTD, FULL_ENCODINGS, LAYOUT_SPARSE, Hasher, Manifest, TensorEntry, data_path)
from .files import DataFiles

SPARSE_BATCH_BYTES = 64 << 20
"""Sparse chunks of one tensor are decoded together up to this many raw bytes: enough to amortize the
per-op cost, few enough that the changes' positions (8 bytes each) stay a small buffer."""


class BaseTensors(Protocol):
    """Already-decoded tensors of one version (e.g. a materialized directory) to start decoding from."""

    version: int

    def load(self, name: str) -> torch.Tensor | None:
        """A fresh, writable copy of the tensor, or None if this base does not hold it."""

    def read_into(self, entry: TensorEntry, out: torch.Tensor, offset: int = 0) -> bool:
        """Fill ``out`` (uint8) with the bytes ``[offset, offset + out.numel())`` of the tensor ``entry``
        names; False if this base does not hold it. Raises IntegrityError if it holds it with another dtype
        or shape. The bytes are not hash-checked here: the decoded tensor's hash covers them."""


class BufferPool:
    """Decode buffers given back once their tensor is written out, and handed out again (thread-safe).

    Fresh memory costs a page fault per page on first touch (~0.8 s per GB on a small VM, more than a copy):
    a directory build that reuses buffers touches fresh memory once per buffer, not once per tensor. A free
    buffer is reused for a tensor of at least half its size, so memory stays within twice the bytes in
    flight plus ``max_free_bytes``.
    """

    def __init__(self, max_free_bytes: int):
        self._max_free = max_free_bytes
        self._free: list[torch.Tensor] = []
        self._lent: dict[int, torch.Tensor] = {}  # data pointer -> whole buffer
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of ``nbytes`` (contents undefined)."""
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if nbytes <= b.numel() <= 2 * nbytes]
            if fits:
                buffer = self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
                self._lent[buffer.data_ptr()] = buffer
                return buffer[:nbytes]
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes:
            with self._lock:
                self._lent[buffer.data_ptr()] = buffer
        return buffer

    def give(self, tensor: torch.Tensor) -> None:
        """Hand back a tensor from :meth:`take` (or a view of it); other tensors are ignored. Nothing may use
        it afterwards."""
        with self._lock:
            buffer = self._lent.pop(tensor.data_ptr(), None)
            if buffer is not None and buffer.numel() + sum(b.numel() for b in self._free) <= self._max_free:
                self._free.append(buffer)


def _take(pool: BufferPool | None, nbytes: int) -> torch.Tensor:
    return pool.take(nbytes) if pool is not None else torch.empty(nbytes, dtype=torch.uint8)


def apply_entry(files: DataFiles, manifest: Manifest, entry: TensorEntry, out: torch.Tensor | None,
                pool: BufferPool | None = None) -> torch.Tensor:
    """Apply one version's encoding of a tensor: returns its raw bytes (uint8), ``out`` being the base's.
    Buffers come from ``pool`` if given (and the stored bytes of a chunked entry go back to it)."""
    if entry.encoding == ENCODING_UNCHANGED:
        assert out is not None
        return out
    assert entry.file is not None
    files.check(manifest, entry.file, entry.name)  # before allocating what its sizes say
    stored = files.read(manifest, entry, out=_take(pool, entry.length))
    if entry.encoding == ENCODING_RAW:
        return stored
    try:
        if entry.encoding == ENCODING_ZSTD:
            if out is not None and pool is not None:
                pool.give(out)
            out = _take(pool, entry.nbytes)
        assert out is not None and entry.encoding in CHUNKED_ENCODINGS
        xor = entry.encoding == ENCODING_XOR_ZSTD
        sparse: list[tuple[int, int, memoryview]] = []  # sparse chunks waiting to be decoded together
        sparse_bytes = 0
        raw_pos = stored_pos = 0
        stored_view = codec.buffer_of(stored)
        for raw_len, stored_len, layout in entry.chunks:
            frame = stored_view[stored_pos:stored_pos + stored_len]
            if layout == LAYOUT_SPARSE and xor:
                sparse.append((raw_pos, raw_len, frame))
                sparse_bytes += raw_len
                if sparse_bytes >= SPARSE_BATCH_BYTES:
                    _apply_sparse(manifest, entry, out, sparse)
                    sparse, sparse_bytes = [], 0
            else:
                try:
                    codec.apply_chunk(out[raw_pos:raw_pos + raw_len], frame, entry.itemsize,
                                      shuffle=entry.shuffle, layout=layout, xor=xor)
                except ValueError as exc:
                    raise _chunk_error(manifest, entry, raw_pos, exc) from None
            raw_pos += raw_len
            stored_pos += stored_len
        _apply_sparse(manifest, entry, out, sparse)
    finally:
        if pool is not None:
            pool.give(stored)
    return out


def _apply_sparse(manifest: Manifest, entry: TensorEntry, out: torch.Tensor,
                  chunks: list[tuple[int, int, memoryview]]) -> None:
    """``out ^=`` the sparse ``chunks`` (first byte, raw size, frame) of ``entry``, decoded together."""
    if not chunks:
        return
    try:
        codec.xor_at(out, *codec.sparse_changes(chunks, entry.itemsize, entry.shuffle))
    except codec.ChunkError as exc:
        raise _chunk_error(manifest, entry, chunks[exc.index][0], exc) from None


def _chunk_error(manifest: Manifest, entry: TensorEntry, raw_pos: int, exc: ValueError) -> IntegrityError:
    return IntegrityError(f"cannot decode chunk at byte {raw_pos}: {exc}", version=manifest.version,
                          file=data_path(manifest.version, entry.file or ""), tensor=entry.name)


def _chain_steps(manifests: Callable[[int], Manifest], target: Manifest, entry: TensorEntry,
                 base: BaseTensors | None) -> tuple[list[tuple[Manifest, TensorEntry]], TensorEntry | None]:
    """The steps of ``entry``'s delta chain, newest first, down to a full encoding or to the version of
    ``base`` if it holds the tensor (its entry there is returned too, else None)."""
    steps: list[tuple[Manifest, TensorEntry]] = []
    manifest, current = target, entry
    nothing = torch.empty(0, dtype=torch.uint8)
    while True:
        steps.append((manifest, current))
        if current.encoding in (ENCODING_RAW, ENCODING_ZSTD):
            return steps, None
        base_manifest, previous = _step_down(manifests, manifest, current)
        if base is not None and base.version == base_manifest.version and base.read_into(previous, nothing):
            return steps, previous  # (an empty read: does the base hold it, with this dtype and shape?)
        manifest, current = base_manifest, previous


def _step_down(manifests: Callable[[int], Manifest], manifest: Manifest,
               entry: TensorEntry) -> tuple[Manifest, TensorEntry]:
    """The base version of the delta ``manifest`` and its entry of the tensor ``entry`` (of ``manifest``),
    checked to exist with the same dtype and shape."""
    assert manifest.base_version is not None
    base_manifest = manifests(manifest.base_version)
    try:
        previous = base_manifest.tensor(entry.name)
    except KeyError:
        raise IntegrityError(f"delta refers to tensor missing from its base version {base_manifest.version}",
                             version=manifest.version, tensor=entry.name) from None
    if (previous.dtype, previous.shape) != (entry.dtype, entry.shape):
        raise IntegrityError(f"delta has dtype/shape {entry.dtype}{list(entry.shape)} but its base "
                             f"version {base_manifest.version} has {previous.dtype}{list(previous.shape)}",
                             version=manifest.version, tensor=entry.name)
    if (previous.encoding == ENCODING_PIECES) != (entry.encoding == ENCODING_PIECES):
        raise IntegrityError(f"delta stores the tensor {'in pieces' if entry.pieces else 'whole'}, its base version "
                             f"{base_manifest.version} {'in pieces' if previous.pieces else 'whole'}: a delta applies "
                             "to a tensor stored the same way", version=manifest.version, tensor=entry.name,
                             hint="The writer did not follow the ckptstream format; refusing this version")
    return base_manifest, previous


def _piece_steps(manifests: Callable[[int], Manifest], target: Manifest, entry: TensorEntry, piece: TensorEntry,
                 stop: int | None = None) -> tuple[list[tuple[Manifest, TensorEntry]], TensorEntry | None]:
    """The delta chain of ``piece`` (of ``entry``, a tensor of ``target`` stored in pieces), newest first, down
    to a full encoding (at each step the base's piece with the same box, FORMAT.md "Tensors in pieces"), or
    to version ``stop`` (then the tensor's entry there is returned too, else None)."""
    steps: list[tuple[Manifest, TensorEntry]] = []
    manifest, whole, current = target, entry, piece
    while True:
        steps.append((manifest, current))
        if current.encoding in FULL_ENCODINGS:
            return steps, None
        base_manifest, previous = _step_down(manifests, manifest, whole)
        found = previous.piece_at(current.offsets or (), current.shape)
        if found is None:
            raise IntegrityError(f"the delta's piece at {list(current.offsets or ())} of shape {list(current.shape)} "
                                 f"has no piece of the same box in its base version {base_manifest.version}",
                                 version=manifest.version, tensor=entry.name,
                                 hint="The writer did not follow the ckptstream format; refusing this version")
        if base_manifest.version == stop:
            return steps, previous
        manifest, whole, current = base_manifest, previous, found


def _apply_steps(files: DataFiles, steps: list[tuple[Manifest, TensorEntry]], start: torch.Tensor | None,
                 pool: BufferPool | None) -> tuple[torch.Tensor, str]:
    """``start`` (None: nothing yet) with a delta chain's ``steps`` (newest first) applied oldest first; the
    result and its hash. A keyframe's bytes (unchanged since) were checked against their stored hash as they
    were read: that hash is the result's, with no second pass over them."""
    out = start
    verified: str | None = None  # the hash ``out`` is known to have, if a stored-hash check showed it
    for manifest, current in reversed(steps):
        out = apply_entry(files, manifest, current, out, pool)
        if current.encoding != ENCODING_UNCHANGED:
            verified = current.stored_hash if current.encoding == ENCODING_RAW else None
    assert out is not None
    return out, verified if verified is not None else codec.tensor_hash(out)


def _decode_pieces(files: DataFiles, manifests: Callable[[int], Manifest], target: Manifest, entry: TensorEntry,
                   base: BaseTensors | None, pool: BufferPool | None) -> torch.Tensor:
    """The raw bytes (uint8) of a tensor stored in pieces: each piece decoded down its own chain (to a full
    encoding, or to the version of ``base``, whose copy of the whole tensor gives the piece's box), checked
    against its hash and copied into its box (the tensor's hash is that of the pieces' hashes, checked when
    the manifest was parsed). Holds the tensor and one piece at a time."""
    chains = [(piece, *_piece_steps(manifests, target, entry, piece, None if base is None else base.version))
              for piece in entry.pieces]
    out = _take(pool, entry.nbytes)
    try:
        # The base copy fills the whole tensor: read before any piece is written into its box, so that a piece
        # decoded from a full encoding is never overwritten by the base's bytes.
        base_entry = next((found for _, _, found in chains if found is not None), None)
        if base is not None and base_entry is not None and not base.read_into(base_entry, out):
            raise IntegrityError("the local base copy lost the tensor while it was read", version=base.version,
                                 tensor=entry.name, hint="Materialize this version without the base directory")
        for piece, steps, base_entry in chains:
            box = piece.shape[:-1] + (piece.shape[-1] * entry.itemsize,) if piece.shape else (entry.itemsize,)
            where = codec.box_view(out, entry.shape, entry.itemsize, piece.offsets or (), piece.shape)
            data: torch.Tensor | None = None
            if base is not None and base_entry is not None:
                data = _take(pool, piece.nbytes)
                data.view(box).copy_(where)
            data, actual = _apply_steps(files, steps, data, pool)
            if actual != piece.hash:
                if base is not None and base_entry is not None:
                    load_checked(base, base_entry)  # the local base copy is what differs? (raises, naming it)
                raise IntegrityError(f"decoded piece at {list(piece.offsets or ())} hashes to {actual}, expected "
                                     f"{piece.hash}", version=target.version, tensor=entry.name,
                                     hint="A version in its delta chain is corrupt; run `ckptstream verify`")
            where.copy_(data.view(box))
            if pool is not None:
                pool.give(data)
    except BaseException:
        if pool is not None:
            pool.give(out)
        raise
    return out


def decode_tensor(files: DataFiles, manifests: Callable[[int], Manifest], target: Manifest, entry: TensorEntry,
                  base: BaseTensors | None = None, pool: BufferPool | None = None) -> torch.Tensor:
    """Decode one tensor of ``target``, following its delta chain back to a full encoding or to ``base``.

    Args:
        manifests: looks up the manifest of a version (MissingBaseError if it is gone).
        base: decoded tensors of a version in the chain to start from instead of the keyframe.
        pool: where the decode buffers come from (the caller gives the result back once written out).

    Returns:
        The tensor with the entry's dtype and shape, its bytes checked against the entry's hash.
    """
    if entry.encoding == ENCODING_PIECES:
        raw = _decode_pieces(files, manifests, target, entry, base, pool)
        return raw.view(codec.torch_dtype(entry.dtype)).reshape(entry.shape)
    steps, base_entry = _chain_steps(manifests, target, entry, base)
    start: torch.Tensor | None = None
    if base is not None and base_entry is not None:
        start = _take(pool, base_entry.nbytes)
        if not base.read_into(base_entry, start):
            raise IntegrityError("the local base copy lost the tensor while it was read", version=base.version,
                                 tensor=entry.name, hint="Materialize this version without the base directory")
    out, actual = _apply_steps(files, steps, start, pool)
    if actual != entry.hash:
        if base is not None and base_entry is not None:
            load_checked(base, base_entry)  # the local base copy is what differs? (raises, naming it)
        raise IntegrityError(f"decoded tensor hash mismatch (expected {entry.hash}, got {actual})",
                             version=target.version, tensor=entry.name,
                             hint="A version in its delta chain is corrupt; run `ckptstream verify`")
    return out.view(codec.torch_dtype(entry.dtype)).reshape(entry.shape)


def load_checked(base: BaseTensors, entry: TensorEntry) -> torch.Tensor | None:
    """The bytes of a tensor held by ``base`` (None if it lacks it), checked against ``entry``: dtype, shape
    and hash of the version ``entry`` belongs to."""
    tensor = base.load(entry.name)
    if tensor is None:
        return None
    if tensor.dtype != codec.torch_dtype(entry.dtype) or tuple(tensor.shape) != entry.shape:
        raise IntegrityError(f"the given base copy has {tensor.dtype}{list(tensor.shape)}, the base version "
                             f"{entry.dtype}{list(entry.shape)}", version=base.version, tensor=entry.name,
                             hint="The local base directory is stale or foreign; materialize it again")
    raw = codec.as_bytes(tensor.contiguous())
    if codec.entry_hash(entry, raw) != entry.hash:
        raise IntegrityError("the given base copy differs from the base version", version=base.version,
                             tensor=entry.name,
                             hint="The local base directory is stale or corrupt; materialize it again")
    return raw


class Writer(Protocol):
    """Writes bytes of a decoded tensor (all of it, or a segment) at byte ``at`` inside it, on the decoding
    threads, and returns their count; keeps no reference to them (their buffer is reused)."""

    def __call__(self, entry: TensorEntry, data: torch.Tensor | memoryview, at: int = 0) -> int: ...


SEGMENT_BYTES = 4 << 20
"""A streamed tensor (see :func:`plan_tensor`) goes through in segments of this size, read, patched, hashed
and written while in cache: one pass instead of a tensor-sized buffer read, patched (a random access per
change), hashed and written (measured on this 2-core VM, 1.34 GB, one delta of 1 % changed: 0.66-0.80 s
of CPU against 0.94-1.01 s; 256 KiB segments cost more in per-segment calls than they gain)."""
STREAM_MAX_CHANGES_BYTES = 256 << 20
"""Above this many bytes of decoded changes (8-byte position and the value of each) a tensor is decoded
whole instead: the changes of every delta are held while the segments pass. Planned from the manifests'
``changed`` counts (a delta without one is decoded whole), and enforced as the changes are decoded: more
changes than counted is refused as a lying manifest."""


READ_AHEAD_BYTES = 32 << 20
"""A streamed tensor's stored bytes are asked of the storage (``Storage.will_read``) up to this far beyond
the segment just read (in pieces of at least a quarter of it), so that the storage has each decoding
thread's next reads queued while the thread patches, hashes and writes. On a 16-core host (4.2 GB model,
5 deltas, one run, medians of 3, the raw cold read varying 2.3-3.4 s within it) a cold materialize took
4.45 s with one segment (4 MiB) ahead, 3.89 s with 32 MiB and with 128 MiB; on a 2-core VM 32 MiB was
5-10 % slower than one segment (docs/BENCHMARKS.md, decode, fourth round)."""


class _ReadAhead:
    """Hints of one stored entry's bytes, ahead of its sequential reads (see :data:`READ_AHEAD_BYTES`)."""

    def __init__(self, files: DataFiles, manifest: Manifest, entry: TensorEntry):
        self._files, self._manifest, self._entry = files, manifest, entry
        self._hinted = 0  # bytes [0, _hinted) of the entry hinted or read

    def after(self, position: int) -> None:
        """The bytes before ``position`` are being read: hint those up to ``READ_AHEAD_BYTES`` beyond it,
        in pieces of at least a quarter of that depth (fewer calls)."""
        self._hinted = max(self._hinted, position)
        end = min(position + READ_AHEAD_BYTES, self._entry.length)
        if end - self._hinted >= min(READ_AHEAD_BYTES // 4, self._entry.length - self._hinted) > 0:
            self._files.will_read(self._manifest, self._entry, self._hinted, end - self._hinted)
            self._hinted = end


@dataclass(frozen=True)
class Segments:
    """Where a streamed tensor's bytes before its deltas come from: segment ``i`` is the bytes
    ``[bounds[i], bounds[i + 1])``, filled by ``fill(part, i, pool)``, which holds at most ``fill_bytes``
    of buffers of its own meanwhile."""

    bounds: tuple[int, ...]
    fill: Callable[[torch.Tensor, int, BufferPool | None], None]
    fill_bytes: int = 0

    @property
    def largest(self) -> int:
        return max(b - a for a, b in zip(self.bounds, self.bounds[1:]))


@dataclass(frozen=True)
class TensorPlan:
    """How :func:`decode_tensor_to` decodes one tensor of a version (see :func:`plan_tensor`)."""

    entry: TensorEntry
    steps: tuple[tuple[Manifest, TensorEntry], ...]
    """Its delta chain, newest first (as ``_chain_steps`` gives it)."""
    base_entry: TensorEntry | None
    """Its entry in the version of the base copy, where the chain stops there."""
    segments: Segments | None
    """Streamed segment by segment from these, or (None) decoded whole."""

    @property
    def deltas(self) -> list[tuple[Manifest, TensorEntry]]:
        """The entries applied on top of the segments' bytes, oldest first."""
        applied = self.steps if self.base_entry is not None else self.steps[:-1]
        return list(reversed(applied))

    @property
    def stored_root(self) -> tuple[int, str, int] | None:
        """Where the stored full encoding its segments are read from lies (version, file, byte offset), or
        None where they come from the base copy or the tensor is decoded whole."""
        if self.segments is None or self.base_entry is not None:
            return None
        manifest, root = self.steps[-1]
        assert root.file is not None  # (a full encoding is stored in a file)
        return manifest.version, root.file, root.offset

    @property
    def memory_bytes(self) -> int:
        """The decode buffers it holds at most: a streamed tensor its segment, what filling one takes and
        its deltas' changes, as their manifests count them (more is refused); a tensor decoded whole its
        bytes."""
        if self.segments is None:
            return self.entry.nbytes
        return (self.segments.largest + self.segments.fill_bytes
                + _planned_changes_bytes(self.entry, self.deltas))


def plan_tensor(files: DataFiles, manifests: Callable[[int], Manifest], target: Manifest, entry: TensorEntry,
                base: BaseTensors | None = None) -> TensorPlan:
    """Plan the decode of one tensor of ``target``: streamed in segments when every delta since its start is
    sparse (or it is unchanged) and the start is either the ``base`` copy or, on a POSIX file system, a full
    encoding read range by range; otherwise decoded whole (:func:`decode_tensor`).

    Raises:
        IntegrityError, MissingBaseError: the chain is broken (as :func:`decode_tensor`).
    """
    if entry.encoding == ENCODING_PIECES:  # decoded whole, piece by piece
        for piece in entry.pieces:
            _piece_steps(manifests, target, entry, piece, None if base is None else base.version)  # (checked now)
        return TensorPlan(entry, ((target, entry),), None, None)
    steps, base_entry = _chain_steps(manifests, target, entry, base)
    plan = TensorPlan(entry, tuple(steps), base_entry, None)
    deltas = plan.deltas
    sparse = all(e.encoding == ENCODING_UNCHANGED
                 or (e.encoding == ENCODING_XOR_ZSTD and e.changed is not None
                     and all(c[2] == LAYOUT_SPARSE for c in e.chunks))
                 for _, e in deltas)
    if not entry.nbytes or not sparse or _planned_changes_bytes(entry, deltas) > STREAM_MAX_CHANGES_BYTES:
        return plan
    if base is not None and base_entry is not None:
        segments = _base_segments(base, base_entry)
    elif files.storage.is_posix:  # (an object store serves one tensor-sized ranged read faster than segments)
        segments = _stored_segments(files, *steps[-1])
    else:
        segments = None
    return TensorPlan(entry, tuple(steps), base_entry, segments)


def decode_order(plan: TensorPlan) -> tuple[int | str, ...]:
    """Sort key of the order in which tensors are decoded to a writer: first those read from the base copy
    or decoded whole, largest first (a tensor of a fifth of the model then runs beside the others instead
    of alone at the end); then those streamed from storage, in the order of their stored bytes, so that
    the decoding threads read neighbouring ranges of each file. On a 16-core host (4.2 GB model, 5 deltas,
    4 cold runs each, alternated) a cold materialize took 2.35 s in storage order and 2.83 s largest first,
    the raw cold read of the same files 1.98 s (docs/BENCHMARKS.md, decode, fifth round)."""
    where = plan.stored_root
    return (0, -plan.entry.nbytes) if where is None else (1, *where)


def _planned_changes_bytes(entry: TensorEntry, deltas: list[tuple[Manifest, TensorEntry]]) -> int:
    return sum((e.changed or 0) * (8 + entry.itemsize) for _, e in deltas if e.encoding != ENCODING_UNCHANGED)


def _fixed_bounds(nbytes: int, itemsize: int) -> tuple[int, ...]:
    segment = max(itemsize, SEGMENT_BYTES - SEGMENT_BYTES % itemsize)
    return (*range(0, nbytes, segment), nbytes)


def _base_segments(base: BaseTensors, base_entry: TensorEntry) -> Segments:
    """Segments read from the base copy."""
    bounds = _fixed_bounds(base_entry.nbytes, base_entry.itemsize)

    def fill(part: torch.Tensor, index: int, pool: BufferPool | None) -> None:
        if not base.read_into(base_entry, part, bounds[index]):
            raise IntegrityError("the local base copy lost the tensor while it was read", version=base.version,
                                 tensor=base_entry.name, hint="Materialize this version without the base directory")

    return Segments(bounds, fill)


def _stored_segments(files: DataFiles, manifest: Manifest, root: TensorEntry) -> Segments | None:
    """Segments of a full encoding read from storage: raw bytes in fixed segments, a chunked one chunk by
    chunk. Their stored hash is not checked here (that takes the whole entry): the decoded hash covers
    them, and a mismatch is diagnosed by a whole decode (see :func:`decode_tensor_to`)."""
    if root.encoding == ENCODING_RAW:
        bounds = _fixed_bounds(root.nbytes, root.itemsize)

        ahead = _ReadAhead(files, manifest, root)

        def fill_raw(part: torch.Tensor, index: int, pool: BufferPool | None) -> None:
            files.read_range(manifest, root, bounds[index], part)
            ahead.after(bounds[index + 1])  # (after the read: the first one does not queue behind its hints)

        return Segments(bounds, fill_raw)
    if root.encoding != ENCODING_ZSTD:  # (its chunks are dense: the format allows sparse ones for XOR only)
        return None
    bounds, stored_starts = [0], [0]
    for raw_len, stored_len, _ in root.chunks:
        bounds.append(bounds[-1] + raw_len)
        stored_starts.append(stored_starts[-1] + stored_len)

    ahead = _ReadAhead(files, manifest, root)

    def fill_chunk(part: torch.Tensor, index: int, pool: BufferPool | None) -> None:
        _, stored_len, layout = root.chunks[index]
        assert root.file is not None
        files.check(manifest, root.file, root.name)  # before allocating what its sizes say
        stored = _take(pool, stored_len)
        try:
            files.read_range(manifest, root, stored_starts[index], stored)
            ahead.after(stored_starts[index + 1])
            try:
                codec.apply_chunk(part, codec.buffer_of(stored), root.itemsize, shuffle=root.shuffle, layout=layout)
            except ValueError as exc:
                raise _chunk_error(manifest, root, bounds[index], exc) from None
        finally:
            if pool is not None:
                pool.give(stored)

    # what filling one holds: its stored chunk, and the decompressed and unshuffled copies of its raw bytes
    fill_bytes = max(stored_len for _, stored_len, _ in root.chunks) + 2 * max(raw for raw, _, _ in root.chunks)
    return Segments(tuple(bounds), fill_chunk, fill_bytes)


def decode_tensor_to(files: DataFiles, manifests: Callable[[int], Manifest], target: Manifest, plan: TensorPlan,
                     write: Writer, base: BaseTensors | None = None, pool: BufferPool | None = None) -> int:
    """Decode one tensor of ``target`` as :func:`decode_tensor` does and ``write`` its bytes, as ``plan``
    (:func:`plan_tensor`) says; returns their count.

    A streamed tensor goes through in segments (:data:`SEGMENT_BYTES`, or a keyframe's chunks): each is
    read from the base copy or the stored full encoding, patched with every delta's changes in it, added to
    the tensor's hash and written; others are decoded whole, checked, then written.

    In segments, the tensor's hash is checked once its bytes are written, not before: ``write`` goes to a
    directory that nobody sees until it is complete (``build_directory`` renames it into place, and
    ``write_into``'s callers do the same, the follower's cache among them) and that a failed check
    abandons. The stored bytes of every delta are checked against their stored hash before they are
    decoded, as always; a mismatch of the decoded hash is then traced to the base copy or to the stored
    entry that differs, as :func:`decode_tensor` names it.

    Raises:
        IntegrityError: as :func:`decode_tensor`.
    """
    entry, segments = plan.entry, plan.segments
    changes: list[tuple[torch.Tensor, torch.Tensor]] = []
    if segments is not None:
        budget = [STREAM_MAX_CHANGES_BYTES]
        try:
            changes = [_changes(files, manifest, e, pool, budget) for manifest, e in plan.deltas
                       if e.encoding == ENCODING_XOR_ZSTD]
        except TooManyChanges:  # planned from the manifests' counts: one of them lies
            raise IntegrityError("the deltas change more elements than their manifests count",
                                 version=target.version, tensor=entry.name,
                                 hint="A version in its delta chain is forged or damaged; run `ckptstream verify`"
                                 ) from None
    if segments is None:
        tensor = decode_tensor(files, manifests, target, entry, base, pool)
        try:
            write(entry, tensor)
        finally:
            if pool is not None:
                pool.give(tensor)
        return entry.nbytes
    buffer = _take(pool, segments.largest)
    try:
        actual = _stream_segments(entry, changes, buffer, write, segments, pool)
    finally:
        if pool is not None:
            pool.give(buffer)
    if actual != entry.hash:
        if base is not None and plan.base_entry is not None:
            load_checked(base, plan.base_entry)  # the local base copy is what differs? (raises, naming it)
            raise IntegrityError(f"decoded tensor hash mismatch (expected {entry.hash}, got {actual})",
                                 version=target.version, tensor=entry.name,
                                 hint="A version in its delta chain is corrupt; run `ckptstream verify`")
        decode_tensor(files, manifests, target, entry)  # which stored entry differs? (raises, naming it)
        raise IntegrityError(f"the tensor decoded in segments hashes to {actual}, decoded whole to its hash: the "
                             "storage returned other bytes on a second read", version=target.version,
                             tensor=entry.name, hint="Check the storage, then materialize again")
    return entry.nbytes


class TooManyChanges(Exception):
    """A tensor's deltas change more bytes (8-byte position and value per element) than the budget given."""


def changes_since(files: DataFiles, manifests: Callable[[int], Manifest], target: Manifest, entry: TensorEntry,
                  base_version: int, budget: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The elements of ``entry`` (a tensor of ``target``) whose bits differ from those of version
    ``base_version`` (an older version of ``target``'s delta chain), read from the deltas between them
    without decoding the tensor: ascending int64 positions and XOR values (the integer dtype of its
    itemsize), folded across the deltas (an element changed and changed back is no change). None where a
    version between them stores the tensor whole (only a decode tells what changed).

    The stored bytes are checked against their stored hashes; the tensor's own hash needs all its bytes and
    is not checked here.

    Raises:
        TooManyChanges: the changes of its deltas outgrow ``budget`` bytes together.
        IntegrityError, MissingBaseError: a chunk cannot be decoded, or the chain is broken.
    """
    left = [budget]
    if entry.encoding == ENCODING_PIECES and target.version != base_version:
        parts = []
        for piece in entry.pieces:
            steps, at_base = _piece_steps(manifests, target, entry, piece, base_version)
            if at_base is None:
                return None  # a piece stored whole since
            found = [_changes(files, m, e, None, left) for m, e in steps
                     if m.version > base_version and e.encoding == ENCODING_XOR_ZSTD]
            positions, values = _fold(found, entry.itemsize)
            parts.append((codec.box_positions(positions, entry.shape, piece.offsets or (), piece.shape), values))
        positions, values = torch.cat([p for p, _ in parts]), torch.cat([v for _, v in parts])
        order = torch.argsort(positions)
        return positions[order], values[order]
    found = []
    manifest, current = target, entry
    while manifest.version != base_version:
        if current.encoding in (ENCODING_RAW, ENCODING_ZSTD):
            return None
        if current.encoding == ENCODING_XOR_ZSTD:
            found.append(_changes(files, manifest, current, None, left))
        manifest, current = _step_down(manifests, manifest, current)
    return _fold(found, entry.itemsize)


def sparse_delta(entry: TensorEntry) -> bool:
    """Whether ``entry`` is a delta entry whose every chunk is ``sparse`` (what ``changes_of_sparse`` takes)."""
    return (entry.encoding == ENCODING_XOR_ZSTD and bool(entry.chunks)
            and all(layout == LAYOUT_SPARSE for _, _, layout in entry.chunks))


def changes_of_sparse(files: DataFiles, manifest: Manifest, entries: list[TensorEntry],
                      budget: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``changes_since`` of several ``entries`` of the delta ``manifest`` on its own base, each a ``sparse_delta``
    of one item size and byte order, decoded together: their chunks are decoded as one tensor's, at the place
    each would have if the tensors were laid end to end, then split. What is done once per tensor otherwise
    (a dozen small ops, each taking the GIL from the other decoding threads) is done once per batch: the
    change of a model of many small tensors (one per expert) costs what its changed elements cost.

    Raises:
        TooManyChanges: their changes outgrow ``budget`` bytes together.
        IntegrityError: a chunk cannot be decoded (naming its tensor), a stored hash differs.
    """
    itemsize, shuffle = entries[0].itemsize, entries[0].shuffle
    assert all(sparse_delta(e) and e.itemsize == itemsize and e.shuffle == shuffle for e in entries)
    chunks: list[tuple[int, int, memoryview]] = []
    placed: list[tuple[TensorEntry, int]] = []  # per chunk: its tensor and its first byte in it
    firsts = [0]  # per tensor: its first element laid end to end
    for entry, stored in zip(entries, files.read_batch(manifest, entries)):
        view = codec.buffer_of(stored)
        raw_pos = stored_pos = 0
        for raw_len, stored_len, _ in entry.chunks:
            chunks.append((firsts[-1] * itemsize + raw_pos, raw_len, view[stored_pos:stored_pos + stored_len]))
            placed.append((entry, raw_pos))
            raw_pos += raw_len
            stored_pos += stored_len
        firsts.append(firsts[-1] + entry.numel)
    try:
        positions, values = codec.sparse_changes(chunks, itemsize, shuffle)
    except codec.ChunkError as exc:
        entry, raw_pos = placed[exc.index]
        raise _chunk_error(manifest, entry, raw_pos, exc) from None
    if positions.numel() * (8 + itemsize) > budget:
        raise TooManyChanges
    kept = values != 0  # (as _fold: a zero "change" changes nothing)
    if not bool(kept.all()):
        positions, values = positions[kept], values[kept]
    bounds = torch.searchsorted(positions, torch.tensor(firsts)).tolist()
    return [(positions[lo:hi].sub_(first), values[lo:hi])
            for lo, hi, first in zip(bounds, bounds[1:], firsts)]


def _fold(found: list[tuple[torch.Tensor, torch.Tensor]], itemsize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The changes of several deltas of one tensor (each ascending positions, XOR values) as one: ascending
    positions, values XORed together where they meet, elements changed back dropped."""
    int_dtype = codec.INT_OF_SIZE[itemsize]
    if not found:
        return torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=int_dtype)
    if len(found) == 1:
        positions, values = found[0]
    else:
        positions, inverse = torch.unique(torch.cat([p for p, _ in found]), sorted=True, return_inverse=True)
        values = torch.zeros(positions.numel(), dtype=int_dtype)
        start = 0
        for p, v in found:  # (a delta's positions are distinct: no two of its values meet in one element)
            where = inverse[start:start + p.numel()]
            values[where] = values[where].bitwise_xor_(v)
            start += p.numel()
    kept = values != 0
    return positions[kept], values[kept]


def _changes(files: DataFiles, manifest: Manifest, entry: TensorEntry, pool: BufferPool | None,
             budget: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The changed elements (positions, XOR values) of a delta entry, its sparse chunks decoded together in
    batches of ``SPARSE_BATCH_BYTES``; raises TooManyChanges once they outgrow ``budget[0]`` bytes (what the
    manifest's ``changed`` promised is not trusted for memory)."""
    stored = files.read(manifest, entry, out=_take(pool, entry.length))
    itemsize = entry.itemsize
    try:
        view = codec.buffer_of(stored)
        batches: list[tuple[torch.Tensor, torch.Tensor]] = []
        chunks: list[tuple[int, int, memoryview]] = []  # sparse chunks waiting to be decoded together
        batch_bytes = 0

        def add(positions: torch.Tensor, values: torch.Tensor) -> None:
            budget[0] -= positions.numel() * (8 + itemsize)
            if budget[0] < 0:
                raise TooManyChanges
            batches.append((positions, values))

        def flush() -> None:
            nonlocal chunks, batch_bytes
            if chunks:
                try:
                    add(*codec.sparse_changes(chunks, itemsize, entry.shuffle))
                except codec.ChunkError as exc:
                    raise _chunk_error(manifest, entry, chunks[exc.index][0], exc) from None
            chunks, batch_bytes = [], 0

        raw_pos = stored_pos = 0
        for raw_len, stored_len, layout in entry.chunks:
            frame = view[stored_pos:stored_pos + stored_len]
            if layout == LAYOUT_SPARSE:
                chunks.append((raw_pos, raw_len, frame))
                batch_bytes += raw_len
                if batch_bytes >= SPARSE_BATCH_BYTES:
                    flush()
            else:
                flush()  # (the batches stay in ascending order of position)
                try:
                    positions, values = codec.dense_xor_changes(frame, raw_len, itemsize, shuffle=entry.shuffle)
                except ValueError as exc:
                    raise _chunk_error(manifest, entry, raw_pos, exc) from None
                add(positions.add_(raw_pos // itemsize), values)
            raw_pos += raw_len
            stored_pos += stored_len
        flush()
    finally:
        if pool is not None:
            pool.give(stored)
    if len(batches) == 1:
        return batches[0]
    if not batches:
        return torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=codec.INT_OF_SIZE[itemsize])
    return torch.cat([p for p, _ in batches]), torch.cat([v for _, v in batches])


def _stream_segments(entry: TensorEntry, changes: list[tuple[torch.Tensor, torch.Tensor]], buffer: torch.Tensor,
                     write: Writer, segments: Segments, pool: BufferPool | None) -> str:
    """Fill ``entry``'s bytes segment by segment into ``buffer``, patch, hash and write each; returns their
    hash."""
    itemsize, bounds = entry.itemsize, segments.bounds
    # Per delta: where each segment's changes begin (the positions are ascending).
    starts = torch.tensor([b // itemsize for b in bounds], dtype=torch.int64)
    local = [(positions, values, torch.searchsorted(positions, starts).tolist()) for positions, values in changes]
    view = codec.buffer_of(buffer)
    hasher = Hasher()
    for index, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        part, data = buffer[:hi - lo], view[:hi - lo]
        segments.fill(part, index, pool)
        for positions, values, cuts in local:
            a, b = cuts[index], cuts[index + 1]
            if b > a:
                codec.xor_at(part, positions[a:b] - lo // itemsize, values[a:b])
        hasher.update(data)
        write(entry, data, lo)
    return hasher.digest()
