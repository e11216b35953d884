"""Decoding tensors of a version: reading stored bytes, checking hashes, applying delta chains.

Each tensor is decoded on its own (its stored ranges are read directly), so tensors decode in parallel
and memory stays bounded by the tensors in flight.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from .. import codec
from ..errors import IntegrityError
from ..format import (CHUNKED_ENCODINGS, ENCODING_RAW, ENCODING_UNCHANGED, ENCODING_XOR_ZSTD, ENCODING_ZSTD,
                      Manifest, TensorEntry, data_path)
from .files import DataFiles


class BaseTensors(Protocol):
    """Already-decoded tensors of one version (e.g. a materialized directory) to start decoding from."""

    version: int

    def load(self, name: str) -> torch.Tensor | None:
        """A fresh, writable copy of the tensor, or None if this base does not hold it."""


def apply_entry(files: DataFiles, manifest: Manifest, entry: TensorEntry, out: torch.Tensor | None) -> torch.Tensor:
    """Apply one version's encoding of a tensor: returns its raw bytes (uint8), ``out`` being the base's."""
    if entry.encoding == ENCODING_UNCHANGED:
        assert out is not None
        return out
    stored = files.read(manifest, entry)
    if entry.encoding == ENCODING_RAW:
        return stored
    if entry.encoding == ENCODING_ZSTD:
        out = torch.empty(entry.nbytes, dtype=torch.uint8)
    assert out is not None and entry.encoding in CHUNKED_ENCODINGS
    raw_pos = stored_pos = 0
    for raw_len, stored_len, layout in entry.chunks:
        try:
            frame = codec.buffer_of(stored[stored_pos:stored_pos + stored_len])
            codec.apply_chunk(out[raw_pos:raw_pos + raw_len], frame, entry.itemsize, shuffle=entry.shuffle,
                              layout=layout, xor=entry.encoding == ENCODING_XOR_ZSTD)
        except ValueError as exc:
            raise IntegrityError(f"cannot decode chunk at byte {raw_pos}: {exc}", version=manifest.version,
                                 file=data_path(manifest.version, entry.file or ""), tensor=entry.name) from None
        raw_pos += raw_len
        stored_pos += stored_len
    return out


def decode_tensor(files: DataFiles, manifests: Callable[[int], Manifest], target: Manifest, entry: TensorEntry,
                  base: BaseTensors | None = None) -> torch.Tensor:
    """Decode one tensor of ``target``, following its delta chain back to a full encoding or to ``base``.

    Args:
        manifests: looks up the manifest of a version (MissingBaseError if it is gone).
        base: decoded tensors of a version in the chain to start from instead of the keyframe.

    Returns:
        The tensor with the entry's dtype and shape, its bytes checked against the entry's hash.
    """
    steps: list[tuple[Manifest, TensorEntry]] = []
    manifest, current = target, entry
    start: torch.Tensor | None = None
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
            start = load_checked(base, previous)
            if start is not None:
                break
        manifest, current = base_manifest, previous
    out = start
    for manifest, current in reversed(steps):
        out = apply_entry(files, manifest, current, out)
    assert out is not None
    actual = codec.tensor_hash(out)
    if actual != entry.hash:
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
