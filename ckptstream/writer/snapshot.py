"""Snapshots: host copies of the trainer's tensors in buffers reused from version to version.

Taking the snapshot is the only part of a publish the trainer waits for. Device tensors are copied into
pinned host buffers with ``non_blocking`` copies; buffers of the version that stopped being a delta base
are reused for the next snapshot, so steady-state publishing allocates nothing.
"""

from __future__ import annotations

import threading
from typing import Iterable, Mapping

import torch

from .. import codec
from ..format import tensor_name_problem

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
"""A state dict or (name, tensor) pairs."""

_Key = tuple[tuple[int, ...], torch.dtype]


class SnapshotBuffers:
    """Takes snapshots into reused host buffers. Thread-safe: snapshots are taken on the caller's thread
    while buffers are retired on the publisher's background thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[_Key, list[torch.Tensor]] = {}

    def take(self, named_tensors: NamedTensors) -> list[tuple[str, torch.Tensor]]:
        """Copy the tensors into host buffers (pinned for device tensors) and return (name, copy) pairs.

        ``named_tensors`` is consumed once, so it may produce each tensor just in time (e.g. gathered
        from other ranks). Raises ValueError for an invalid or repeated name, TypeError for a tensor that
        cannot be stored (not a dense tensor, unsupported dtype).
        """
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        snapshot = []
        devices = set()
        seen: set[str] = set()
        with self._lock:
            free, self._free = self._free, {}
        for name, tensor in items:
            check_tensor(name, tensor, seen)
            tensor = tensor.detach()
            key = (tuple(tensor.shape), tensor.dtype)
            on_device = tensor.device.type != "cpu"
            buffers = free.get(key)
            if buffers:
                buffer = buffers.pop()
            else:
                buffer = torch.empty(key[0], dtype=tensor.dtype, pin_memory=on_device and torch.cuda.is_available())
            buffer.copy_(tensor, non_blocking=on_device)
            if on_device:
                devices.add(tensor.device)
            snapshot.append((name, buffer))
        for device in devices:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        return snapshot

    def retire(self, tensors: Iterable[torch.Tensor]) -> None:
        """Offer buffers nobody reads any more (the old delta base) to the next snapshot, in place of
        those offered before."""
        free: dict[_Key, list[torch.Tensor]] = {}
        for tensor in tensors:
            free.setdefault((tuple(tensor.shape), tensor.dtype), []).append(tensor)
        with self._lock:
            self._free = free

    def clear(self) -> None:
        """Release every buffer held for reuse."""
        with self._lock:
            self._free = {}


def check_tensor(name: object, tensor: object, seen: set[str]) -> None:
    """Refuse what a version cannot hold: names breaking the format's tensor-name rule (reserved names
    such as ``__metadata__`` included), repeated names, non-tensors, sparse tensors, unknown dtypes."""
    problem = tensor_name_problem(name)
    if problem is not None:
        raise ValueError(f"{problem}; rename the tensor before publishing it")
    assert isinstance(name, str)
    if name in seen:
        raise ValueError(f"tensor {name!r} is given twice")
    seen.add(name)
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
    if tensor.layout != torch.strided:
        raise TypeError(f"tensor {name!r} has layout {tensor.layout}; only dense tensors can be published")
    codec.dtype_name(tensor.dtype)
