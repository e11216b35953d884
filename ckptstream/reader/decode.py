"""Decoding tensors of a version: reading stored bytes, checking hashes, applying delta chains.

Each tensor is decoded on its own (its stored ranges are read directly), so tensors decode in parallel
and memory stays bounded by the tensors in flight.
"""

from __future__ import annotations

import threading
from typing import Callable, Protocol

import torch

from .. import codec
from ..errors import IntegrityError
from ..format import (CHUNKED_ENCODINGS, ENCODING_RAW, ENCODING_UNCHANGED, ENCODING_XOR_ZSTD, ENCODING_ZSTD,
                      LAYOUT_SPARSE, Manifest, TensorEntry, data_path)
from .files import DataFiles

SPARSE_BATCH_BYTES = 64 << 20
"""Sparse chunks of one tensor are decoded together up to this many raw bytes: enough to amortize the
per-op cost, few enough that the changes' positions (8 bytes each) stay a small buffer."""


class BaseTensors(Protocol):
    """Already-decoded tensors of one version (e.g. a materialized directory) to start decoding from."""

    version: int

    def load(self, name: str) -> torch.Tensor | None:
        """A fresh, writable copy of the tensor, or None if this base does not hold it."""

    def read_into(self, entry: TensorEntry, out: torch.Tensor) -> bool:
        """Fill ``out`` (uint8, ``entry.nbytes``) with the bytes of the tensor ``entry`` names; False if this
        base does not hold it. Raises IntegrityError if it holds it with another dtype or shape. The bytes
        are not hash-checked here: the decoded tensor's hash covers them."""


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
    steps: list[tuple[Manifest, TensorEntry]] = []
    manifest, current = target, entry
    start: torch.Tensor | None = None
    base_entry: TensorEntry | None = None
    while True:
        steps.append((manifest, current))
        if current.encoding in (ENCODING_RAW, ENCODING_ZSTD):
            break
        assert manifest.base_version is not None
        base_manifest = manifests(manifest.base_version)
        try:
            previous = base_manifest.tensor(current.name)
        except KeyError:
            raise IntegrityError(f"delta refers to tensor missing from its base version {base_manifest.version}",
                                 version=manifest.version, tensor=current.name) from None
        if (previous.dtype, previous.shape) != (current.dtype, current.shape):
            raise IntegrityError(f"delta has dtype/shape {current.dtype}{list(current.shape)} but its base "
                                 f"version {base_manifest.version} has {previous.dtype}{list(previous.shape)}",
                                 version=manifest.version, tensor=current.name)
        if base is not None and base.version == base_manifest.version:
            start = _take(pool, previous.nbytes)
            if base.read_into(previous, start):
                base_entry = previous
                break
            if pool is not None:
                pool.give(start)
            start = None
        manifest, current = base_manifest, previous
    out = start
    verified: str | None = None  # the hash ``out`` is known to have, if a stored-hash check showed it
    for manifest, current in reversed(steps):
        out = apply_entry(files, manifest, current, out, pool)
        if current.encoding != ENCODING_UNCHANGED:
            verified = current.stored_hash if current.encoding == ENCODING_RAW else None
    assert out is not None
    # A keyframe's bytes (unchanged since) were checked as they were read: no second pass over them.
    actual = verified if verified is not None else codec.tensor_hash(out)
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
    if codec.tensor_hash(raw) != entry.hash:
        raise IntegrityError("the given base copy differs from the base version", version=base.version,
                             tensor=entry.name,
                             hint="The local base directory is stale or corrupt; materialize it again")
    return raw
