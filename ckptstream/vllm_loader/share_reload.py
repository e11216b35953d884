"""A full reload in which each rank reads only its share of the checkpoint (runs inside a vLLM worker).

vLLM's own ``reload_weights(weights_path=DIR)`` hands every tensor of every file in ``DIR`` to the model's
weight loaders on every rank, and they keep the rank's slice. What a rank reads of the files then is what the
kernel reads around each page fault of safetensors' maps (the device's read-ahead window, 8 MiB on some
disks: every file, on every rank), or every file whole up front (vLLM's prefetch on NFS and Lustre). Here the
same reload gets each tensor as a view of a private memory map of its file (``mapped_weights``) that reads
nothing around a fault (``MADV_RANDOM``): vLLM's loaders ``narrow`` the checkpoint tensor to the rank's slice
and copy that, and the narrow asks the kernel for the slice's pages, in large reads (``MADV_WILLNEED``) — a
column-parallel (dim 0) slice is one contiguous range, a row-parallel (dim 1) slice a part of each row, a
replicated tensor (norms, ...) is read whole, a page at a time.

Everything else is vLLM's own reload (``Worker.reload_weights`` with a weights iterator: the layer-wise
reload, ``process_weights_after_loading``, the caches reset after it), and the model's path is repointed at
``DIR`` as vLLM's reload from a path does, so the result is vLLM's reload of ``DIR`` bit for bit. Where the
worker's vLLM cannot take an iterator, or its load format reads something other than safetensors files,
vLLM's own reload runs (``reload_share`` says which ran).

This module imports torch: the worker extension imports it on first use.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import mmap
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import torch

from ..codec import torch_dtype
from ..errors import IntegrityError
from ..format import DTYPE_SIZES, INDEX_FILE, MAX_SAFETENSORS_HEADER_BYTES, SAFETENSORS_LENGTH
from .load_format import LOAD_FORMAT

SHARE, WHOLE = "share", "whole"
"""What ``reload_share`` answers: this rank read its share through memory maps, or vLLM's own reload ran."""
READ_GAP = 128 << 10
"""Runs of a rank's slice read as one where less than this lies between them (a row-parallel slice's parts of
rows): reading such a gap from a disk costs less than another request (about a disk's latency times its
bandwidth). A rank's parts of rows shorter than this are read with the rows between them, as vLLM's own
reload reads them with a common read-ahead window (128 KiB)."""
READ_AHEAD_CHUNK = 128 << 10
"""Bytes asked per ``MADV_WILLNEED`` where the file's device does not tell its read-ahead window: Linux reads at
most that window per call (``read_ahead_kb``, commonly 128 KiB), and the rest of a larger range not at all."""
_MAPPED_FORMATS = ("auto", "safetensors", LOAD_FORMAT)
"""vLLM load formats whose reload reads the directory's safetensors files with ``safetensors_weights_iterator``
(the only reads ``mapped_weights`` stands in for), or with ``mapped_weights`` (ckptstream's, ``share_loader``)."""


def reload_share(worker: Any, path: str) -> str:
    """Reload every weight of ``worker``'s model from the complete checkpoint directory ``path`` on its node,
    reading only this rank's share of it where the worker's vLLM allows (``SHARE``), else through vLLM's
    own ``reload_weights`` (``WHOLE``). Raises as vLLM's reload does (the caller reloads a good version)."""
    runner_reload = getattr(getattr(worker, "model_runner", None), "reload_weights", None)
    if (runner_reload is None or "weights_iterator" not in inspect.signature(runner_reload).parameters
            or not _mappable(worker.vllm_config, worker.model_runner.get_model(), path)):
        worker.reload_weights(weights_path=path, is_checkpoint_format=True)
        return WHOLE
    with mapped_weights(path) as weights:
        _repoint(worker.vllm_config.model_config, path)
        worker.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
    return SHARE


def reload_model_share(vllm_config: Any, model: torch.nn.Module, path: str) -> str:
    """``reload_share`` through vLLM's reload function itself (``reload_weights`` of vLLM's
    ``model_loader.reload``, as ckptstream's weight-transfer engine calls it), for ``model`` of ``vllm_config``."""
    from vllm.model_executor.model_loader.reload.inplace import reload_weights

    if not _mappable(vllm_config, model, path):
        reload_weights(vllm_config, model, weights_iterator=None, weights_path=path, is_checkpoint_format=True)
        return WHOLE
    with mapped_weights(path) as weights:
        _repoint(vllm_config.model_config, path)
        reload_weights(vllm_config, model, weights_iterator=weights, weights_path=None, is_checkpoint_format=True)
    return SHARE


def _repoint(model_config: Any, path: str) -> None:
    """As vLLM's reload from a path: the model's path is the directory from now on (ckptstream's cache report,
    its hold and the weight-transfer engine read it), and the old one's revision and weights source no longer
    apply."""
    model_config.model = path
    model_config.model_weights = ""
    model_config.revision = None


def _mappable(vllm_config: Any, model: torch.nn.Module, path: str) -> bool:
    """Whether vLLM's reload of ``model`` from ``path`` is taken with ``mapped_weights`` (``unmapped_reason``)."""
    return unmapped_reason(getattr(vllm_config.parallel_config, "world_size", 1), vllm_config.load_config, model,
                           path) is None


def unmapped_reason(world_size: int, load_config: Any, model: torch.nn.Module, path: str) -> str | None:
    """Why loading ``model`` from ``path`` (vLLM's ``load_config``, an engine of ``world_size`` ranks) is not
    taken with ``mapped_weights``, or None where it is: an engine of several ranks (a single rank reads every
    slice anyway), a local directory of safetensors files (not a hub name, nor ``.bin`` files, nor a Mistral
    consolidated checkpoint: vLLM's own loading resolves those), a load format reading them with vLLM's plain
    iterator, and a model loading every file of its primary directory alone."""
    if world_size <= 1:
        return "an engine of one rank (its share is the whole model)"
    directory = Path(path)
    if not directory.is_dir() or not ((directory / INDEX_FILE).is_file() or any(directory.glob("*.safetensors"))):
        return f"{path} is no local directory of safetensors files"
    if any(directory.glob("consolidated*.safetensors")):
        return f"{path} holds a Mistral consolidated checkpoint"
    if str(load_config.load_format).lower() not in _MAPPED_FORMATS:
        return f"load format {load_config.load_format}"
    if getattr(load_config, "safetensors_load_strategy", None) == "torchao":
        return "torchao tensors"  # (tensor subclasses rebuilt from several flat tensors)
    if (getattr(model, "secondary_weights", ()) or getattr(model, "is_unused_checkpoint_weight", None) is not None
            or getattr(model, "allow_patterns_overrides", None) is not None):
        return "the model reads other weight files than its directory's safetensors files"
    return None


@contextlib.contextmanager
def mapped_weights(directory: str | os.PathLike[str]) -> Iterator[Iterator[tuple[str, torch.Tensor]]]:
    """The tensors of the checkpoint directory ``directory`` as vLLM's reload reads them (the files its index
    names, else every ``*.safetensors`` file; in vLLM's order), each a view of a private, random-access memory
    map of its file: nothing is read until a page of it is. The maps are closed on exit (a view still alive
    keeps its map until it is collected). Raises FileNotFoundError for a missing directory or a file its index
    names but it lacks, IntegrityError (as it reaches it) for a file that is no safetensors file."""
    files = checkpoint_files(Path(directory))
    maps: list[mmap.mmap] = []
    try:
        yield _tensors(files, maps)
    finally:
        for mapped in maps:
            with contextlib.suppress(BufferError):  # a view outlived the reload: its map goes with it
                mapped.close()


def checkpoint_files(directory: Path) -> list[Path]:
    """The safetensors files vLLM reads from ``directory``: those its index (``model.safetensors.index.json``)
    names, all of which must be there, or, without an index, every ``*.safetensors`` file, one at least; in
    vLLM's order (natural sort of the names)."""
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: no such checkpoint directory on this node")
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            named = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise IntegrityError(f"malformed index ({exc})", file=str(index),
                                 hint="Materialize the version again") from None
        files = [directory / str(name) for name in named]
        missing = sorted(str(f) for f in files if not f.is_file())
        if missing:
            raise FileNotFoundError(f"weight files its index names but {directory} lacks: {', '.join(missing)}")
    else:
        files = list(directory.glob("*.safetensors"))
        if not files:  # (as vLLM's reload from a path: loading nothing would leave every layer as it was)
            raise FileNotFoundError(f"{directory} holds no weight files (*.safetensors) on this node")
    return sorted(files, key=lambda f: [int(s) if s.isdigit() else s for s in re.split(r"(\d+)", f.name)])


def _tensors(files: list[Path], maps: list[mmap.mmap]) -> Iterator[tuple[str, torch.Tensor]]:
    # Every file's header is checked and every file mapped before the first tensor is handed over: vLLM's
    # layer-wise reload keeps what it was given of a layer it did not finish, so a file refused half-way would
    # leave it holding views of maps closed since.
    opened = []
    for path in files:
        with open(path, "rb") as f:
            data, tensors = _header(path, f)
            try:
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # (private: no write reaches the file)
            except OSError as exc:  # (a private map counts against the commit limit)
                raise OSError(exc.errno, f"mapping {path} for the reload failed: {exc.strerror}") from None
            chunk = _read_ahead_window(f.fileno())
        maps.append(mapped)
        mapped.madvise(mmap.MADV_RANDOM)
        opened.append((mapped, data, tensors, chunk))
    for mapped, data, tensors, chunk in opened:
        for name in sorted(tensors):  # (safetensors' order, as vLLM reads them)
            dtype, shape, offset = tensors[name]
            yield name, _view(mapped, data + offset, torch_dtype(dtype), shape, chunk)


def _header(path: Path, f: BinaryIO) -> tuple[int, dict[str, tuple[str, list[int], int]]]:
    """Where the tensor data of the safetensors file ``f`` starts, and each tensor's dtype, shape and offset
    there; every tensor checked to lie inside the file with its dtype's and shape's size. Read with
    ``pread``, not through a map (safetensors' ``safe_open`` maps the file, and the read-around of its first
    fault reads the file far beyond its header)."""
    size = os.fstat(f.fileno()).st_size

    def refuse(problem: str, tensor: str | None = None) -> IntegrityError:
        return IntegrityError(f"not a readable safetensors file: {problem}", file=str(path), tensor=tensor,
                              hint="Materialize the version again")

    head = os.pread(f.fileno(), SAFETENSORS_LENGTH.size, 0)
    if len(head) < SAFETENSORS_LENGTH.size:
        raise refuse("truncated")
    (length,) = SAFETENSORS_LENGTH.unpack(head)
    data = SAFETENSORS_LENGTH.size + length
    if length > MAX_SAFETENSORS_HEADER_BYTES or data > size:
        raise refuse(f"a header of {length} bytes")
    try:
        header = json.loads(os.pread(f.fileno(), length, SAFETENSORS_LENGTH.size))
    except ValueError as exc:
        raise refuse(f"its header is no JSON ({exc})") from None
    if not isinstance(header, dict):
        raise refuse("its header is no JSON object")
    tensors = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = spec["dtype"], list(spec["shape"]), spec["data_offsets"]
            count = 1
            for dim in shape:
                if not isinstance(dim, int) or dim < 0:
                    raise ValueError(f"shape {shape}")
                count *= dim
            if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end <= size - data):
                raise ValueError(f"data offsets {[begin, end]} outside its {size - data} bytes of data")
            if end - begin != count * DTYPE_SIZES[dtype]:
                raise ValueError(f"{end - begin} bytes for a {dtype} tensor of shape {shape}")
        except (KeyError, TypeError, ValueError) as exc:
            raise refuse(f"a malformed entry ({exc})", name) from None
        tensors[name] = (dtype, shape, begin)
    return data, tensors


def _read_ahead_window(fd: int) -> int:
    """The read-ahead window of the device holding the file ``fd`` (what one ``MADV_WILLNEED`` reads at most), or
    ``READ_AHEAD_CHUNK`` where it tells none (a tmpfs: nothing to read) or a smaller one."""
    device = os.fstat(fd).st_dev
    block = f"/sys/dev/block/{os.major(device)}:{os.minor(device)}"
    for queue in (f"{block}/queue", f"{block}/../queue"):  # (a disk, or a partition of one)
        try:
            with open(f"{queue}/read_ahead_kb") as f:
                return max(READ_AHEAD_CHUNK, int(f.read()) << 10)
        except (OSError, ValueError):
            continue
    return READ_AHEAD_CHUNK


def _view(mapped: mmap.mmap, start: int, dtype: torch.dtype, shape: list[int], chunk: int) -> torch.Tensor:
    """The tensor at ``start`` of ``mapped``, sharing its pages (``_MappedTensor``, whose slices are read ahead
    ``chunk`` bytes per call; a copy where it is not aligned to its items)."""
    count = 1
    for size in shape:
        count *= size
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    if start % dtype.itemsize:
        data = bytearray(mapped[start:start + count * dtype.itemsize])
        return torch.frombuffer(data, dtype=dtype).reshape(shape)
    # (through a memoryview: the map cannot be closed while a view of it lives; torch holds the buffer, not the map)
    tensor = torch.frombuffer(memoryview(mapped), dtype=dtype, count=count, offset=start).reshape(shape).as_subclass(
        _MappedTensor)
    tensor._ckptstream_map, tensor._ckptstream_at, tensor._ckptstream_chunk = mapped, start, chunk
    tensor._ckptstream_asked = set()
    return tensor


class _MappedTensor(torch.Tensor):
    """A tensor viewing a random-access memory map of its file, whose ``narrow`` (how vLLM's weight loaders take
    a rank's slice) asks the kernel to read the slice's pages ahead, in large asynchronous reads
    (``MADV_WILLNEED``): a fault of a random-access map reads its own page only, and waits for it. Every other
    operation, and ``narrow``'s result, is a plain tensor's."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    def narrow(self, dim: Any, start: Any, length: Any) -> torch.Tensor:  # type: ignore[override]
        part = super().narrow(dim, start, length)
        asked = (int(dim), int(start), int(length))
        if asked not in self._ckptstream_asked:  # (vLLM's layer-wise reload narrows each tensor twice)
            self._ckptstream_asked.add(asked)
            _read_ahead(self._ckptstream_map, self._ckptstream_at + part.data_ptr() - self.data_ptr(), part,
                        self._ckptstream_chunk)
        return part


def _read_ahead(mapped: mmap.mmap, at: int, part: torch.Tensor, chunk: int) -> None:
    """Ask for the pages of ``mapped`` holding ``part`` (a strided view whose first element is at offset ``at``):
    its contiguous runs, merged where less than ``READ_GAP`` lies between two, ``chunk`` bytes per call."""
    if part.numel() == 0:
        return
    run, outer = 1, len(part.shape)  # (the innermost dimensions laid out contiguously make one run)
    while outer and (part.shape[outer - 1] == 1 or part.stride(outer - 1) == run):
        run *= part.shape[outer - 1]
        outer -= 1
    starts = torch.zeros(1, dtype=torch.int64)
    for size, stride in zip(part.shape[:outer], part.stride()[:outer]):
        starts = (starts[:, None] + torch.arange(size, dtype=torch.int64) * stride).flatten()
    starts = at + starts.sort().values * part.element_size()
    first = starts // mmap.PAGESIZE
    last = (starts + run * part.element_size() - 1) // mmap.PAGESIZE
    gap = first[1:] > last[:-1] + READ_GAP // mmap.PAGESIZE
    one = torch.ones(1, dtype=torch.bool)
    for begin, end in zip(first[torch.cat([one, gap])].tolist(), last[torch.cat([gap, one])].tolist()):
        for at in range(begin * mmap.PAGESIZE, (end + 1) * mmap.PAGESIZE, chunk):
            mapped.madvise(mmap.MADV_WILLNEED, at, min(chunk, (end + 1) * mmap.PAGESIZE - at))
