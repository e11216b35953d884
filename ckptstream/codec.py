"""Tensor codecs: raw bytes of tensors, XOR deltas, byte shuffle and zstd chunks (FORMAT.md, "Encodings").

Pure functions over host memory. Codecs never touch storage: the writer hands them tensors and gets
bytes back; the reader hands them stored bytes and gets tensors back. Every chunk is independent, so
callers encode and decode chunks in parallel threads (torch and zstandard release the GIL).
"""

from __future__ import annotations

import ctypes
import threading

import torch
import zstandard

from .format import MAX_CHUNK_BYTES

TORCH_TO_DTYPE: dict[torch.dtype, str] = {
    torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.int32: "I32",
    torch.int64: "I64", torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32",
    torch.float64: "F64",
}
for _name, _st in (("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64"),
                   ("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        TORCH_TO_DTYPE[getattr(torch, _name)] = _st
DTYPE_TO_TORCH: dict[str, torch.dtype] = {v: k for k, v in TORCH_TO_DTYPE.items()}

# Integer dtype of each item size: XOR and change counting run on these views.
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

DEFAULT_CHUNK_BYTES = 4 << 20
assert DEFAULT_CHUNK_BYTES <= MAX_CHUNK_BYTES

_local = threading.local()


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype; TypeError for dtypes the format cannot hold."""
    try:
        return TORCH_TO_DTYPE[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} cannot be stored (supported: "
                        f"{', '.join(sorted(TORCH_TO_DTYPE.values()))})") from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a safetensors dtype name."""
    try:
        return DTYPE_TO_TORCH[name]
    except KeyError:
        raise TypeError(f"dtype {name} is not supported by this torch build") from None


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous CPU tensor's memory (no copy)."""
    if not tensor.is_contiguous():
        raise ValueError("tensor must be contiguous")
    return tensor.reshape(-1).view(torch.uint8)


def buffer_of(byte_tensor: torch.Tensor) -> memoryview:
    """A writable memoryview over a contiguous CPU uint8 tensor, keeping the tensor alive (no copy)."""
    n = byte_tensor.numel()
    if n == 0:
        return memoryview(bytearray())
    array = (ctypes.c_ubyte * n).from_address(byte_tensor.data_ptr())
    array.owner = byte_tensor  # the memoryview holds the array, the array holds the tensor
    return memoryview(array).cast("B")


def from_bytes(data: bytes | bytearray, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of ``dtype``/``shape`` over ``data`` (which must have exactly the right size)."""
    byte_tensor = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
    return byte_tensor.view(torch_dtype(dtype)).reshape(shape)


def chunk_ranges(nbytes: int, itemsize: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list[tuple[int, int]]:
    """Split ``[0, nbytes)`` into element-aligned ranges of at most ``chunk_bytes``."""
    step = max(itemsize, chunk_bytes - chunk_bytes % itemsize)
    return [(start, min(start + step, nbytes)) for start in range(0, nbytes, step)]


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache = getattr(_local, "compressors", None)
    if cache is None:
        cache = _local.compressors = {}
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return cache[level]


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "decompressor", None)
    if d is None:
        d = _local.decompressor = zstandard.ZstdDecompressor()
    return d


def _shuffle(chunk: torch.Tensor, itemsize: int) -> torch.Tensor:
    """Byte planes: all first bytes of the elements, then all second bytes, ... (helps zstd)."""
    if itemsize == 1:
        return chunk
    return chunk.view(-1, itemsize).t().contiguous().view(-1)


def _unshuffle(chunk: torch.Tensor, itemsize: int) -> torch.Tensor:
    if itemsize == 1:
        return chunk
    return chunk.view(itemsize, -1).t().contiguous().view(-1)


def xor_into(out: torch.Tensor, other: torch.Tensor) -> None:
    """``out ^= other`` for two uint8 tensors of the same length, on the widest integer view."""
    n = out.numel()
    width = 8
    while width > 1 and (n % width or out.data_ptr() % width or other.data_ptr() % width):
        width //= 2
    out.view(_INT_OF_SIZE[width]).bitwise_xor_(other.view(_INT_OF_SIZE[width]))


def encode_chunk(new: torch.Tensor, base: torch.Tensor | None, itemsize: int, *, shuffle: bool,
                 level: int) -> tuple[bytes, int]:
    """Encode one chunk of a tensor's bytes.

    Args:
        new: uint8 bytes of the chunk in the new version.
        base: uint8 bytes of the same chunk in the base version (``xor-zstd``), or None (``zstd``).
        itemsize: element size, for shuffling and counting changed elements.

    Returns:
        The stored bytes (one zstd frame) and the number of elements that differ from the base
        (for ``zstd``: the number of elements).
    """
    if base is None:
        payload, changed = new, new.numel() // itemsize
    else:
        payload = new.clone()
        xor_into(payload, base)
        changed = int(torch.count_nonzero(payload.view(_INT_OF_SIZE[itemsize])))
    if shuffle:
        payload = _shuffle(payload, itemsize)
    return _compressor(level).compress(buffer_of(payload)), changed


def decode_chunk(stored: bytes | memoryview, raw_bytes: int, itemsize: int, *, shuffle: bool) -> torch.Tensor:
    """Decode one stored chunk back to its raw (or, for ``xor-zstd``, XOR) bytes as a uint8 tensor.

    Raises ValueError if the frame is malformed or does not decode to exactly ``raw_bytes`` bytes.
    """
    if raw_bytes > MAX_CHUNK_BYTES:
        raise ValueError(f"chunk of {raw_bytes} bytes exceeds the format's limit")
    try:
        params = zstandard.get_frame_parameters(stored)
        if params.content_size != raw_bytes:
            raise ValueError(f"frame declares {params.content_size} bytes, manifest says {raw_bytes}")
        data = _decompressor().decompress(stored, max_output_size=raw_bytes)
    except zstandard.ZstdError as exc:
        raise ValueError(f"corrupt zstd frame ({exc})") from exc
    if len(data) != raw_bytes:
        raise ValueError(f"chunk decoded to {len(data)} bytes, expected {raw_bytes}")
    chunk = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return _unshuffle(chunk, itemsize) if shuffle else chunk

