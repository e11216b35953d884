"""Sharded tensors (DTensor: FSDP2's ``fully_shard``, ``distribute_tensor``) as this process's pieces.

A process holding one shard of a tensor writes that shard as a *piece* of it (FORMAT.md, "Tensors in
pieces"): the box ``offsets``/``shape`` of the whole tensor that its local tensor is. No process gathers
anything. A tensor replicated over a mesh dimension is written by one process of it only, chosen from the
tensor's name so that the replicated tensors spread over the processes; a shard that is the whole tensor
(a mesh of one) is written as a whole tensor, as are tensors no process holds a piece of (no element).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, replace
from typing import Any, Iterable, Iterator

import torch

from ..format import ENCODING_PIECES, TensorEntry


@dataclass(frozen=True)
class PieceOf:
    """Where this process's tensor lies in the whole tensor it is a piece of."""

    shape: tuple[int, ...]
    """The whole tensor's shape."""
    offsets: tuple[int, ...]
    """The piece's first element in it, per dimension."""
    box: tuple[int, ...]
    """The piece's own shape (its local tensor's)."""


def owner(name: str, size: int) -> int:
    """Which of ``size`` processes holding ``name`` whole (replicated) writes it: the same on every process,
    spread over them by name."""
    return zlib.crc32(name.encode("utf-8")) % size


def local_pieces(items: Iterable[tuple[str, Any]], pieces: dict[str, PieceOf]) -> Iterator[tuple[str, Any]]:
    """``items`` with each DTensor replaced by what this process writes of it: its local shard (recorded in
    ``pieces`` under its name when it is a piece of the whole), the whole tensor where this process writes
    a replicated one, nothing where another process does or its shard is empty. Other items pass as they are.

    Raises:
        TypeError: a DTensor whose placements are not ``Shard(dim)`` or ``Replicate`` (a ``Partial`` sum, a
            strided shard), or whose mesh this process is not part of.
    """
    dtensor = _dtensor_type()
    for name, tensor in items:
        if dtensor is None or not isinstance(tensor, dtensor):
            yield name, tensor
            continue
        local, piece = _local_piece(name, tensor)
        if local is None:
            continue
        if piece is not None:
            pieces[name] = piece
        yield name, local


def _local_piece(name: str, tensor: Any) -> tuple[torch.Tensor | None, PieceOf | None]:
    """(what this process writes of the DTensor ``name``, its place as a piece or None for a whole tensor)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = tensor.device_mesh, tuple(tensor.placements)
    for placement in placements:
        if type(placement) is not Shard and not isinstance(placement, Replicate):
            raise TypeError(f"tensor {name!r} is a DTensor placed {type(placement).__name__} {placement}: only "
                            "Shard(dim) and Replicate placements can be published without a gather; call "
                            "full_tensor() on it first")
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise TypeError(f"tensor {name!r} is a DTensor of a device mesh this process is not part of")
    shape = tuple(tensor.shape)
    # Along each mesh dimension that replicates the tensor (or along all, for a tensor of no element), one
    # process of it writes.
    replicated = [dim for dim, p in enumerate(placements) if isinstance(p, Replicate)]
    if torch.Size(shape).numel() == 0:
        replicated = list(range(mesh.ndim))
    if any(coordinate[dim] != owner(name, mesh.size(dim)) for dim in replicated):
        return None, None
    local = tensor.to_local()
    if torch.Size(shape).numel() == 0:
        return torch.empty(shape, dtype=local.dtype, device=local.device), None  # no element: written whole, once
    if local.numel() == 0:
        return None, None  # an empty shard (a dimension shorter than the mesh): no piece
    if tuple(local.shape) == shape:
        return local, None  # the whole tensor (replicated, or a mesh of one)
    local_shape, offsets = compute_local_shape_and_global_offset(shape, mesh, placements)
    if tuple(local_shape) != tuple(local.shape):
        raise TypeError(f"tensor {name!r}: its local shard has shape {list(local.shape)}, its placements say "
                        f"{list(local_shape)}; only even-first (torch.chunk) sharding can be published in pieces")
    return local, PieceOf(shape, tuple(offsets), tuple(local_shape))


def _dtensor_type() -> type | None:
    """The DTensor class, or None where torch.distributed is not available."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None
    return DTensor


def as_piece_entries(entries: Iterable[TensorEntry], pieces: dict[str, PieceOf]) -> list[TensorEntry]:
    """This process's manifest entries with those of its pieces turned into entries of the whole tensors
    (encoding ``pieces``, holding this one piece): the committing process joins every process's pieces of a
    tensor (``format.join_pieces``), which gives the tensor its hash."""
    out = []
    for entry in entries:
        piece = pieces.get(entry.name)
        if piece is None:
            out.append(entry)
            continue
        out.append(TensorEntry(name=entry.name, dtype=entry.dtype, shape=piece.shape, hash="",
                               encoding=ENCODING_PIECES, pieces=(replace(entry, offsets=piece.offsets),)))
    return out


def same_layout(base: TensorEntry | None, piece: PieceOf | None) -> bool:
    """Whether a tensor written now (as ``piece`` of a whole, or whole where None) may be a delta on its
    ``base`` entry: stored the same way, a piece on the base's piece of the same box (FORMAT.md, "Tensors
    in pieces")."""
    if base is None:
        return False
    if piece is None:
        return base.encoding != ENCODING_PIECES
    return base.shape == piece.shape and base.piece_at(piece.offsets, piece.box) is not None
