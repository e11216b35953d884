"""The identity of a base model directory, as adapter streams record it (FORMAT.md, "Base model hash"): a hash
of its tensors' names, dtypes, shapes and a sample of each, read from the headers of its safetensors files
and one small range per tensor, never the whole weights. No torch."""

from __future__ import annotations

import json
import os
import struct

from .errors import IntegrityError, SourceNotFoundError
from .format import (BASE_HASH_SAMPLE_BYTES, MAX_FILE_BYTES, MAX_SAFETENSORS_HEADER_BYTES, SAFETENSORS_LENGTH,
                     Hasher)


def base_model_hash(directory: str | os.PathLike[str]) -> str:
    """A stable identity of a base model directory (FORMAT.md, "Base model hash"), computed cheaply: the
    tensors of its top-level ``*.safetensors`` files, in name order, each by its name, dtype, shape and the
    ``BASE_HASH_SAMPLE_BYTES`` bytes at its middle. It reads the files' headers and one small range per
    tensor, never the whole weights (a 15 GB model hashes in milliseconds), and does not depend on how the
    tensors are split into files.

    Raises:
        SourceNotFoundError: the directory holds no safetensors file.
        IntegrityError: a file is not a readable safetensors file, or a tensor is in two files (naming it).
    """
    root = os.fspath(directory)
    try:
        names = sorted(n for n in os.listdir(root) if n.endswith(".safetensors") and not n.startswith(".")
                       and os.path.isfile(os.path.join(root, n)))
    except OSError as exc:
        raise SourceNotFoundError(f"cannot list the base model directory {root} ({exc})",
                                  hint="Give the directory the base model is loaded from") from None
    if not names:
        raise SourceNotFoundError(f"no *.safetensors files in {root}",
                                  hint="Give the directory the base model is loaded from (its weights as safetensors)")
    tensors: dict[str, tuple[str, list[int], bytes]] = {}
    for name in names:
        path = os.path.join(root, name)
        for tensor, spec in _sampled_tensors(path).items():
            if tensor in tensors:
                raise IntegrityError("the tensor is in two files of the base model", file=path, tensor=tensor)
            tensors[tensor] = spec
    hasher = Hasher()
    for tensor in sorted(tensors, key=lambda t: t.encode("utf-8", "surrogatepass")):
        dtype, shape, sample = tensors[tensor]
        encoded = tensor.encode("utf-8", "surrogatepass")
        hasher.update(struct.pack("<I", len(encoded)) + encoded + struct.pack("<I", len(dtype)) + dtype.encode()
                      + struct.pack(f"<I{len(shape)}Q", len(shape), *shape) + struct.pack("<I", len(sample)) + sample)
    return hasher.digest()


def _sampled_tensors(path: str) -> dict[str, tuple[str, list[int], bytes]]:
    """Name -> (dtype, shape, the bytes at the middle of its data) of every tensor of a safetensors file."""
    def refuse(problem: str) -> IntegrityError:
        return IntegrityError(f"not a readable safetensors file ({problem})", file=path,
                              hint="The base model directory is damaged")

    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        prefix = os.pread(fd, SAFETENSORS_LENGTH.size, 0)
        if len(prefix) < SAFETENSORS_LENGTH.size:
            raise refuse("shorter than its header length")
        (length,) = SAFETENSORS_LENGTH.unpack(prefix)
        if length > min(MAX_SAFETENSORS_HEADER_BYTES, size - SAFETENSORS_LENGTH.size):
            raise refuse(f"a header of {length} bytes")
        try:
            header = json.loads(os.pread(fd, length, SAFETENSORS_LENGTH.size))
        except (ValueError, RecursionError) as exc:
            raise refuse(f"its header is not JSON: {exc}") from None
        if not isinstance(header, dict):
            raise refuse("its header is not an object")
        data_start = SAFETENSORS_LENGTH.size + length
        out = {}
        for tensor, spec in header.items():
            if tensor == "__metadata__":
                continue
            dtype, shape, offsets = (spec.get(k) for k in ("dtype", "shape", "data_offsets")) if isinstance(
                spec, dict) else (None, None, None)
            if (not isinstance(dtype, str) or not isinstance(shape, list) or not isinstance(offsets, list)
                    or len(offsets) != 2 or not all(_is_count(x) for x in [*shape, *offsets])
                    or not offsets[0] <= offsets[1] <= size - data_start):
                raise refuse(f"tensor {tensor[:80]!r} has no dtype, shape and data offsets inside the file")
            begin, end = offsets
            count = min(BASE_HASH_SAMPLE_BYTES, end - begin)
            out[tensor] = (dtype, shape, os.pread(fd, count, data_start + begin + (end - begin - count) // 2))
        return out
    finally:
        os.close(fd)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_FILE_BYTES
