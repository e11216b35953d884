"""Reading a Megatron ``torch_dist`` checkpoint as Hugging Face tensors, without importing megatron.

A ``torch_dist`` checkpoint is a PyTorch Distributed Checkpoint directory: ``.metadata`` (a pickle listing
every tensor's global shape and the chunks each rank wrote) and ``__<rank>_<n>.distcp`` files holding each
chunk as a ``torch.save`` record. Megatron stacks the layers of a tensor along a leading axis
(``decoder.layers.mlp.linear_fc1.weight`` is [layers, ...]) and, for grouped experts, the experts along
the next one. This reader assembles one layer of one tensor at a time from its chunks, so memory stays
bounded by the largest layer tensor, and converts it with :mod:`.megatron_hf`.

The metadata pickle is read with an unpickler that only builds PyTorch's checkpoint metadata classes, and
chunks with ``torch.load(weights_only=True)``: a foreign or malicious checkpoint is refused, never run.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from ..errors import ConversionError, IntegrityError
from ..parallel import ordered_parallel
from .megatron_hf import HFArchitecture, check_complete, to_hf

LATEST_FILE = "latest_checkpointed_iteration.txt"
_MODEL_KEY = re.compile(r"(?:embedding\.word_embeddings\.weight|output_layer\.weight|decoder\..+)")
_STACKED_EXPERTS = re.compile(r"mlp\.experts\.experts\.linear_fc([12])\.weight")
_ALLOWED_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")}


def resolve_iteration_dir(path: str | os.PathLike[str]) -> Path:
    """The iteration directory of a Megatron save directory (through ``latest_checkpointed_iteration.txt``)
    or ``path`` itself when it is an iteration directory (``iter_0000100/``)."""
    root = Path(path)
    latest = root / LATEST_FILE
    if latest.is_file():
        text = latest.read_text().strip()
        if text == "release":
            return root / "release"
        if not text.isdigit():
            raise ConversionError(f"{latest} holds {text!r}, not an iteration number")
        return root / f"iter_{int(text):07d}"
    if (root / ".metadata").is_file():
        return root
    raise ConversionError(f"{root} is neither a Megatron save directory (with {LATEST_FILE}) nor a torch_dist "
                          "iteration directory (with .metadata)",
                          hint="Pass the --save directory of the trainer or one iter_XXXXXXX/ inside it")


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only PyTorch distributed-checkpoint metadata (and the torch types it refers to)."""

    def find_class(self, module: str, name: str) -> Any:
        checkpoint_module = module.startswith("torch.distributed.checkpoint.")
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if not ((module, name) in _ALLOWED_GLOBALS or dtype or (checkpoint_module and not name.startswith("__"))):
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")
        found = super().find_class(module, name)
        if checkpoint_module and not isinstance(found, type):
            raise pickle.UnpicklingError(f"{module}.{name} is not a metadata class")
        return found


@dataclass(frozen=True)
class _Chunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    start: int
    length: int


class TorchDistCheckpoint:
    """The model tensors of one iteration of a Megatron ``torch_dist`` checkpoint.

    Args:
        path: a Megatron save directory (the newest iteration is read) or an ``iter_XXXXXXX`` directory.
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.directory = resolve_iteration_dir(path)
        backend_file = self.directory / "metadata.json"
        if backend_file.is_file():
            backend = json.loads(backend_file.read_text()).get("sharded_backend")
            if backend != "torch_dist":
                raise ConversionError(f"{self.directory} is a {backend!r} checkpoint; only torch_dist is supported",
                                      file=str(backend_file))
        metadata_file = self.directory / ".metadata"
        try:
            with open(metadata_file, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except FileNotFoundError:
            raise ConversionError(f"{self.directory} has no .metadata: not a finished torch_dist checkpoint",
                                  file=str(metadata_file)) from None
        except Exception as exc:  # noqa: BLE001 - any unpickling failure means a foreign or damaged file
            raise IntegrityError(f"unreadable checkpoint metadata: {exc}", file=str(metadata_file)) from exc
        iteration = re.fullmatch(r"iter_(\d+)", self.directory.name)
        self.iteration = int(iteration.group(1)) if iteration else None
        self._tensors: dict[str, tuple[torch.Size, torch.dtype, list[_Chunk]]] = {}
        storage = metadata.storage_data
        for key, entry in metadata.state_dict_metadata.items():
            if not _MODEL_KEY.fullmatch(key) or not hasattr(entry, "chunks"):
                continue  # optimizer state, RNG state, _extra_state bytes
            chunks = []
            for chunk in entry.chunks:
                info = storage[_index(storage, key, chunk.offsets)]
                if getattr(info, "transform_descriptors", None):
                    raise ConversionError("chunks stored with transforms (compression) are not supported", tensor=key)
                chunks.append(_Chunk(tuple(chunk.offsets), tuple(chunk.sizes), info.relative_path, info.offset,
                                     info.length))
            self._tensors[key] = (entry.size, entry.properties.dtype, chunks)
        if not self._tensors:
            raise ConversionError(f"{self.directory} holds no Megatron model tensors")

    @property
    def nbytes(self) -> int:
        """Bytes of the model tensors, as stored."""
        return sum(size.numel() * dtype.itemsize for size, dtype, _ in self._tensors.values())

    def iter_megatron(self, *, workers: int = 4, max_bytes: int = 1 << 30) -> Iterator[tuple[str, torch.Tensor]]:
        """(global Megatron name, whole tensor), one layer (and one expert) at a time, in checkpoint order.

        Layers are read by ``workers`` threads ahead of the consumer, at most ``max_bytes`` of them at
        once (and always one)."""
        pieces = []  # (key, size, dtype, chunks, layer or None: the whole tensor)
        for key, (size, dtype, chunks) in self._tensors.items():
            stacked = key.startswith("decoder.layers.") and not key.split(".")[2].isdigit()
            pieces += [(key, size, dtype, chunks, layer) for layer in (range(size[0]) if stacked else [None])]

        def read(piece: tuple[str, torch.Size, torch.dtype, list[_Chunk], int | None]) -> tuple[str, torch.Tensor]:
            key, size, dtype, chunks, layer = piece
            name = key if layer is None else f"decoder.layers.{layer}.{key[len('decoder.layers.'):]}"
            return name, self._assemble(key, size, dtype, chunks, layer)

        def cost(piece: tuple[str, torch.Size, torch.dtype, list[_Chunk], int | None]) -> int:
            _, size, dtype, _, layer = piece
            return size.numel() // (1 if layer is None else size[0]) * dtype.itemsize

        for name, tensor in ordered_parallel(pieces, read, cost, max_cost=max_bytes, workers=workers):
            yield from _split_experts(name, tensor)

    def iter_hf(self, arch: HFArchitecture, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, tensor) of every model tensor, cast to ``dtype`` if given. Raises
        ConversionError after the last one if a tensor of ``arch`` had no source in the checkpoint (so a
        publisher consuming it commits nothing)."""
        produced = set()
        for name, tensor in self.iter_megatron():
            for hf_name, hf_tensor in to_hf(name, tensor, arch):
                produced.add(hf_name)
                yield hf_name, hf_tensor if dtype is None else hf_tensor.to(dtype)
        check_complete(produced, arch)

    def _assemble(self, key: str, size: torch.Size, dtype: torch.dtype, chunks: list[_Chunk],
                  layer: int | None) -> torch.Tensor:
        """The whole tensor of ``key`` (or its slice ``layer`` of the leading axis) from its chunks."""
        shape = tuple(size) if layer is None else tuple(size[1:])
        if layer is not None:
            chunks = [c for c in chunks if c.offsets[0] <= layer < c.offsets[0] + c.sizes[0]]
        parts = []  # (offsets, tensor) within ``shape``
        for chunk in chunks:
            part = self._read(key, chunk, dtype)
            if layer is None:
                parts.append((chunk.offsets, part))
            else:
                parts.append((chunk.offsets[1:], part[layer - chunk.offsets[0]]))
        covered = sum(part.numel() for _, part in parts)
        if covered != torch.Size(shape).numel():
            raise IntegrityError(f"the checkpoint's chunks cover {covered} of {torch.Size(shape).numel()} elements",
                                 tensor=key if layer is None else f"{key} (layer {layer})",
                                 file=str(self.directory))
        if len(parts) == 1:  # one chunk holds it all (a checkpoint without tensor parallelism): no copy
            return parts[0][1]
        whole = torch.empty(shape, dtype=dtype)
        for offsets, part in parts:
            whole[tuple(slice(o, o + n) for o, n in zip(offsets, part.shape))] = part
        return whole

    def _read(self, key: str, chunk: _Chunk, dtype: torch.dtype) -> torch.Tensor:
        path = self.directory / chunk.file
        if Path(chunk.file).name != chunk.file:
            raise IntegrityError("a chunk names a file outside the checkpoint directory", file=chunk.file, tensor=key)
        with open(path, "rb") as f:
            f.seek(chunk.start)
            data = f.read(chunk.length)
        try:
            tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001
            raise IntegrityError(f"unreadable chunk at offset {chunk.start}: {exc}", file=str(path),
                                 tensor=key) from exc
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != chunk.sizes or tensor.dtype != dtype:
            raise IntegrityError(f"chunk at offset {chunk.start} is not a {dtype} tensor of shape {chunk.sizes}",
                                 file=str(path), tensor=key)
        return tensor


def _index(storage: dict[Any, Any], key: str, offsets: Any) -> Any:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    index = MetadataIndex(key, torch.Size(offsets))
    if index not in storage:
        raise IntegrityError(f"the checkpoint metadata lists a chunk at {tuple(offsets)} that no file stores",
                             tensor=key)
    return index


def _split_experts(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """Grouped experts are stacked along the leading axis: one tensor per expert, under SequentialMLP names."""
    prefix, _, suffix = name.rpartition("mlp.experts.experts.")
    match = _STACKED_EXPERTS.fullmatch("mlp.experts.experts." + suffix) if prefix else None
    if match is None:
        yield name, tensor
        return
    for expert in range(tensor.shape[0]):
        yield f"{prefix}mlp.experts.local_experts.{expert}.linear_fc{match.group(1)}.weight", tensor[expert]
