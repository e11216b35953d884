"""Tensor codecs: raw bytes of tensors, XOR deltas, byte shuffle and zstd chunks (FORMAT.md, "Encodings").

Pure functions over host memory. Codecs never touch storage: the writer hands them tensors and gets
bytes back; the reader hands them stored bytes and gets tensors back. Every chunk is independent, so
callers encode and decode chunks in parallel threads (torch and zstandard release the GIL).
"""

from __future__ import annotations

import ctypes
import struct
import threading
from collections.abc import Sequence

import numpy
import torch
import zstandard

from .format import (CHECK_MASK, CHECK_MIX_A, CHECK_MIX_B, CHECK_SEED, DTYPE_SIZES, ENCODING_PIECES, LAYOUT_DENSE,
                     LAYOUT_SPARSE, MAX_CHUNK_BYTES, ChangeCheck, TensorEntry, content_hash, pieces_hash)

def _torch_dtype_of(name: str) -> torch.dtype | None:
    """The torch dtype of a format dtype name, by the naming rule the two share (``F16`` float16,
    ``U32`` uint32, ``F8_E4M3`` float8_e4m3fn, ...); None where this torch build lacks it."""
    if name in ("BOOL", "BF16"):
        candidates = ("bool" if name == "BOOL" else "bfloat16",)
    elif name.startswith("F8_"):
        candidates = (f"float8_{name[3:].lower()}", f"float8_{name[3:].lower()}fn")
    else:
        candidates = ({"F": "float", "I": "int", "U": "uint"}[name[0]] + name[1:],)
    for candidate in candidates:
        dtype = getattr(torch, candidate, None)
        if isinstance(dtype, torch.dtype) and dtype.itemsize == DTYPE_SIZES[name]:
            return dtype
    return None


DTYPE_TO_TORCH: dict[str, torch.dtype] = {
    name: dtype for name in DTYPE_SIZES if (dtype := _torch_dtype_of(name)) is not None}
"""Format dtype name -> torch dtype, for every dtype of ``format.DTYPE_SIZES`` this torch build has."""
TORCH_TO_DTYPE: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPE_TO_TORCH.items()}

# Integer dtype of each item size: XOR and change counting run on these views.
INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

DEFAULT_CHUNK_BYTES = 16 << 20
"""Writers cut tensors into chunks of this many bytes: the unit of parallel encoding and decoding. 16 MiB
rather than 4: a 1 %-changed bf16 delta then takes 30 % of the calls to zstd (the
Python between them bounded a 16-thread encoder: 0.52 s -> 0.20 s for a 15 GB delta on an H200 host),
and a 15 GB model still has ~1,000 of them."""
assert DEFAULT_CHUNK_BYTES <= MAX_CHUNK_BYTES

_local = threading.local()


def bit_pattern(values: torch.Tensor) -> torch.Tensor:
    """``values`` viewed as same-width integers (floats compared bit for bit: NaN equals itself, -0.0 not 0.0)."""
    return values.view(INT_OF_SIZE[values.element_size()]) if values.is_floating_point() else values


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


def tensor_hash(tensor: torch.Tensor) -> str:
    """The format's hash of a CPU tensor's raw bytes (the manifest's ``hash`` of a decoded tensor)."""
    return content_hash(buffer_of(as_bytes(tensor.contiguous())))


def box_view(raw: torch.Tensor, shape: tuple[int, ...], itemsize: int, offsets: tuple[int, ...],
             box: tuple[int, ...]) -> torch.Tensor:
    """The bytes of the box ``offsets``/``box`` (a piece, FORMAT.md "Tensors in pieces") of a tensor of
    ``shape`` whose raw bytes are ``raw`` (flat uint8, contiguous): a uint8 view of shape ``box`` with its
    last dimension in bytes (strided where the box is not a run of whole rows)."""
    if not shape:
        return raw
    whole = raw.view(*shape[:-1], shape[-1] * itemsize)
    index = tuple(slice(o, o + n) for o, n in zip(offsets[:-1], box[:-1]))
    return whole[(*index, slice(offsets[-1] * itemsize, (offsets[-1] + box[-1]) * itemsize))]


def box_positions(positions: torch.Tensor, shape: tuple[int, ...], offsets: tuple[int, ...],
                  box: tuple[int, ...]) -> torch.Tensor:
    """Element positions (flat, row-major) inside the box ``offsets``/``box`` as positions in the whole
    tensor of ``shape``."""
    out = torch.zeros_like(positions)
    rest = positions
    stride = 1
    for dim in reversed(range(len(shape))):
        out += (rest % box[dim] + offsets[dim]) * stride
        rest = rest // box[dim]
        stride *= shape[dim]
    return out


def entry_hash(entry: TensorEntry, raw: torch.Tensor) -> str:
    """The manifest's ``hash`` of a tensor whose raw bytes are ``raw`` (flat uint8, contiguous), as
    ``entry`` stores it: the hash of the bytes, or for a tensor stored in pieces the hash of its boxes'
    hashes."""
    if entry.encoding != ENCODING_PIECES:
        return content_hash(buffer_of(raw))
    return pieces_hash(content_hash(buffer_of(box_view(raw, entry.shape, entry.itemsize, p.offsets or (),
                                                       p.shape).contiguous()))
                       for p in entry.pieces)


def from_bytes(data: bytes | bytearray, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of ``dtype``/``shape`` over ``data`` (which must have exactly the right size)."""
    byte_tensor = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
    return byte_tensor.view(torch_dtype(dtype)).reshape(shape)


def chunk_elements(itemsize: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Elements per chunk (all but a tensor's last): as many whole elements as fit ``chunk_bytes``, at least one."""
    return max(1, chunk_bytes // itemsize)


def chunk_ranges(nbytes: int, itemsize: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list[tuple[int, int]]:
    """Split ``[0, nbytes)`` into element-aligned ranges of ``chunk_elements`` (the last may be shorter)."""
    step = itemsize * chunk_elements(itemsize, chunk_bytes)
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


def _widest_int_view(n: int, *tensors: torch.Tensor) -> torch.dtype:
    """The widest integer dtype that evenly and alignedly covers ``n`` bytes of every tensor."""
    width = 8
    while width > 1 and (n % width or any(t.data_ptr() % width for t in tensors)):
        width //= 2
    return INT_OF_SIZE[width]


def xor_into(out: torch.Tensor, other: torch.Tensor) -> None:
    """``out ^= other`` for two uint8 tensors of the same length, on the widest integer view."""
    wide = _widest_int_view(out.numel(), out, other)
    out.view(wide).bitwise_xor_(other.view(wide))


def _xor(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a ^ b`` for two uint8 tensors of the same length, as a new uint8 tensor."""
    wide = _widest_int_view(a.numel(), a, b)
    return torch.bitwise_xor(a.view(wide), b.view(wide)).view(torch.uint8)


def _changed_positions(xor: torch.Tensor, itemsize: int) -> torch.Tensor:
    """Indices of the non-zero elements of an XOR chunk (uint8 bytes of ``itemsize``-byte elements).

    Scans 8-byte words first and looks inside the few non-zero ones: about twice as fast as ``nonzero``
    over the elements when changes are sparse.
    """
    if itemsize >= 8 or xor.numel() % 8 or xor.data_ptr() % 8:
        return torch.nonzero(xor.view(INT_OF_SIZE[itemsize])).view(-1)
    lanes = 8 // itemsize
    words = torch.nonzero(xor.view(torch.int64)).view(-1)
    row, lane = torch.nonzero(xor.view(INT_OF_SIZE[itemsize]).view(-1, lanes)[words], as_tuple=True)
    return words[row] * lanes + lane


SPARSE_MAX_DENSITY = 0.125
"""XOR chunks with at most this fraction of changed elements use the sparse layout (FORMAT.md)."""

_SPARSE_HEADER = 8  # u32 count of changed elements, u32 count of escaped gaps
_SPARSE_COUNTS = struct.Struct("<II")
_GAP_ESCAPE = 255


def encode_chunk(new: torch.Tensor, base: torch.Tensor | None, itemsize: int, *, shuffle: bool,
                 level: int) -> tuple[bytes, int, str]:
    """Encode one chunk of a tensor's bytes.

    Args:
        new: uint8 bytes of the chunk in the new version.
        base: uint8 bytes of the same chunk in the base version (``xor-zstd``), or None (``zstd``).
        itemsize: element size, for shuffling and counting changed elements.

    Returns:
        The stored bytes (one zstd frame), the number of elements that differ from the base (for
        ``zstd``: all of them) and the layout, ``LAYOUT_DENSE`` or ``LAYOUT_SPARSE``.
    """
    if base is None:
        payload = _shuffle(new, itemsize) if shuffle else new
        return _compressor(level).compress(buffer_of(payload)), new.numel() // itemsize, LAYOUT_DENSE
    xor = _xor(new, base)
    return encode_xor_chunk(_changed_positions(xor, itemsize), itemsize, xor=xor, shuffle=shuffle, level=level)


def encode_checked_chunk(new: torch.Tensor, base: torch.Tensor, itemsize: int, *, first: int,
                         place: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None, shuffle: bool,
                         level: int) -> tuple[bytes, int, str, ChangeCheck]:
    """:func:`encode_chunk` of an ``xor-zstd`` chunk, and the check of its changes (FORMAT.md, "Change
    checks"): ``first`` is the chunk's first element in its tensor, ``place`` (the whole tensor's shape, the
    box's offsets and shape) that of a piece, whose positions the check takes in the whole tensor."""
    xor = _xor(new, base)
    positions = _changed_positions(xor, itemsize)
    frame, changed, layout = encode_xor_chunk(positions, itemsize, xor=xor, shuffle=shuffle, level=level)
    at = positions.numpy()  # (numpy from here: torch's CPU threads spin on a busy host, ~100 times slower)
    where = at + first
    if place is not None:
        where = box_positions(torch.from_numpy(where), *place).numpy()
    mixed = _host_positions(where)
    ints = INT_OF_SIZE[itemsize]
    old, new_bits = (values.view(ints).numpy()[at] for values in (base, new))
    return frame, changed, layout, ChangeCheck(changed, _host_total(_host_terms(mixed, old)),
                                               _host_total(_host_terms(mixed, new_bits)))


_SIGNED = 1 << 64


def check_positions(positions: torch.Tensor) -> torch.Tensor:
    """The positions' part of their elements' terms of a change check (``mix(p + seed)``, as int64), shared by
    the terms of their old and new values (:func:`check_terms`); on the positions' device."""
    if positions.device.type == "cpu":
        return torch.from_numpy(_host_positions(positions.numpy()).view(numpy.int64))
    return _torch_positions(positions)


def check_terms(mixed: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Each element's term of a change check (``format.check_element``) as int64 (its bits mod 2^64), for
    the :func:`check_positions` of its positions in the whole tensor and the elements' ``values`` (any dtype:
    their bits count), on their device."""
    bits = values.reshape(-1).view(INT_OF_SIZE[values.element_size()])
    if bits.device.type == "cpu":
        return torch.from_numpy(_host_terms(mixed.numpy().view(numpy.uint64), bits.numpy()).view(numpy.int64))
    return _torch_terms(mixed, bits)


def check_total(terms: torch.Tensor) -> int:
    """The sum of check terms mod 2^64, in [0, 2^64)."""
    if terms.device.type == "cpu":
        return _host_total(terms.numpy().view(numpy.uint64))
    return int(terms.sum()) & CHECK_MASK


def change_check(positions: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> ChangeCheck:
    """The check (FORMAT.md, "Change checks") of changes at ``positions`` (int64, in the whole tensor) from
    the values ``old`` to ``new``."""
    mixed = check_positions(positions)
    return ChangeCheck(positions.numel(), check_total(check_terms(mixed, old)), check_total(check_terms(mixed, new)))


def check_sum(positions: torch.Tensor, values: torch.Tensor) -> int:
    """One of a change check's hashes (in [0, 2^64)) of the elements at ``positions`` with ``values``."""
    return check_total(check_terms(check_positions(positions), values))


def _host_positions(positions: numpy.ndarray) -> numpy.ndarray:
    return _check_mix_host_(positions.astype(numpy.uint64) + numpy.uint64(CHECK_SEED))


def _host_terms(mixed: numpy.ndarray, bits: numpy.ndarray) -> numpy.ndarray:
    """The terms (uint64) of elements whose bits are ``bits`` (integers of their item size, any signedness)."""
    unsigned = bits.view(f"u{bits.itemsize}").astype(numpy.uint64)
    unsigned ^= mixed
    return _check_mix_host_(unsigned)


def _host_total(terms: numpy.ndarray) -> int:
    return int(terms.sum(dtype=numpy.uint64))


def _check_mix_host_(u: numpy.ndarray) -> numpy.ndarray:
    """splitmix64's finalizer on uint64 values, in place (numpy's products wrap, its shifts are logical)."""
    for shift, factor in ((30, CHECK_MIX_A), (27, CHECK_MIX_B)):
        u ^= u >> numpy.uint64(shift)
        u *= numpy.uint64(factor)
    u ^= u >> numpy.uint64(31)
    return u


def _torch_positions(positions: torch.Tensor) -> torch.Tensor:
    return _check_mix_torch_(positions.to(torch.int64, copy=True).add_(CHECK_SEED - _SIGNED))


def _torch_terms(mixed: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    wide = bits.to(torch.int64, copy=True)  # (mixed into in place below: never the caller's own int64 tensor)
    if bits.element_size() < 8:
        wide &= (1 << (8 * bits.element_size())) - 1  # (int16 and int32 widen with their sign)
    return _check_mix_torch_(wide.bitwise_xor_(mixed))


def _check_mix_torch_(x: torch.Tensor) -> torch.Tensor:
    """:func:`_check_mix_host_` on int64 values on a device, in place (int64 products wrap to the same low
    64 bits; torch's ``>>`` is arithmetic, so the sign's copies are masked off)."""
    for shift, factor in ((30, CHECK_MIX_A), (27, CHECK_MIX_B)):
        x ^= (x >> shift) & ((1 << (64 - shift)) - 1)
        x *= factor - _SIGNED
    x ^= (x >> 31) & ((1 << 33) - 1)
    return x


def encode_xor_chunk(positions: torch.Tensor, itemsize: int, *, shuffle: bool, level: int,
                     xor: torch.Tensor | None = None, values: torch.Tensor | None = None,
                     elements: int | None = None) -> tuple[bytes, int, str]:
    """Encode one ``xor-zstd`` chunk from its changed elements: the layout decision and serialization
    shared by the host encoder (which has the chunk's XOR bytes) and the device encoder (which has only
    the changed elements, computed on the device).

    Args:
        positions: int64 indices of the chunk's changed elements, ascending.
        itemsize: element size.
        xor: the chunk's XOR bytes (uint8), where the caller has them; else ``values`` and ``elements``.
        values: the XOR values at ``positions`` (the integer dtype of ``itemsize``).
        elements: the chunk's number of elements.

    Returns:
        As :func:`encode_chunk`.
    """
    if xor is not None:
        elements = xor.numel() // itemsize
    assert elements is not None and (xor is not None or values is not None), "give xor, or values and elements"
    changed = positions.numel()
    if changed <= SPARSE_MAX_DENSITY * elements:
        if values is None:
            assert xor is not None
            values = xor.view(INT_OF_SIZE[itemsize])[positions]
        return sparse_frame(positions, values, itemsize, shuffle=shuffle, level=level), changed, LAYOUT_SPARSE
    if xor is None:
        assert values is not None
        xor = torch.zeros(elements, dtype=INT_OF_SIZE[itemsize]).index_put_((positions,), values).view(torch.uint8)
    payload = _shuffle(xor, itemsize) if shuffle else xor
    return _compressor(level).compress(buffer_of(payload)), changed, LAYOUT_DENSE


def sparse_frame(positions: torch.Tensor, values: torch.Tensor, itemsize: int, *, shuffle: bool,
                 level: int) -> bytes:
    """The stored bytes (one zstd frame) of a ``sparse`` chunk: the XOR ``values`` (integers of ``itemsize``
    bytes) of the changed elements at ``positions`` (ascending int64 element indices inside the chunk).

    One chunk of :class:`SparseChunks`, the one serializer of the sparse layout."""
    elements = int(positions[-1]) + 1 if positions.numel() else 1
    return SparseChunks(positions, values, itemsize, elements=elements, chunk_elements=elements,
                        shuffle=shuffle).frame(0, level)


class SparseChunks:
    """The sparse layout (FORMAT.md) of every chunk of one tensor's XOR delta, serialized at once.

    The gaps, escapes and byte planes of all the tensor's changed elements are computed in a dozen
    whole-tensor ops; each chunk's frame is then only slices of them handed to zstd. Per-chunk torch ops
    (a dozen per chunk, on arrays of a few thousand elements) held the GIL for most of a chunk's time and
    serialized the encoding threads: ~1 ms per 4 MiB chunk, of which zstd took a third.

    Args:
        positions: int64 element indices of the changed elements in the tensor, ascending.
        values: the XOR values at ``positions`` (the integer dtype of ``itemsize``).
        itemsize: element size.
        elements: the tensor's number of elements.
        chunk_elements: elements per chunk (the last chunk may be shorter).
        shuffle: whether the values are stored as byte planes.
    """

    def __init__(self, positions: torch.Tensor, values: torch.Tensor, itemsize: int, *, elements: int,
                 chunk_elements: int, shuffle: bool):
        self.itemsize = itemsize
        self.shuffle = shuffle and itemsize > 1
        chunk_starts = torch.arange(0, elements, chunk_elements, dtype=torch.int64)
        bounds = torch.searchsorted(positions, torch.cat([chunk_starts, chunk_starts.new_tensor([elements])]))
        self.bounds: list[int] = bounds.tolist()
        """Per chunk, the index of its first changed element (and the total count at the end)."""
        gaps = torch.empty_like(positions)
        if positions.numel():  # ops with out= and in place: diff(prepend=) is 3x slower
            gaps[0] = positions[0]
            torch.sub(positions[1:], positions[:-1], out=gaps[1:]).sub_(1)
        firsts = bounds[:-1][bounds[:-1] < bounds[1:]]  # each changed chunk's first change: its gap from the start
        gaps[firsts] = positions[firsts] % chunk_elements
        escaped = torch.nonzero(gaps >= _GAP_ESCAPE).view(-1)
        self.big_bounds: list[int] = torch.searchsorted(escaped, bounds).tolist()
        """Per chunk, the index of its first long gap (and the total count at the end)."""
        self._small = buffer_of(gaps.clamp(max=_GAP_ESCAPE).to(torch.uint8))
        self._big = buffer_of(gaps[escaped].to(torch.int32).view(torch.uint8))
        if self.shuffle:  # byte planes by shifts and truncation: ~5x faster than a transposing copy
            ints = values.contiguous().view(INT_OF_SIZE[itemsize])
            self._values = [buffer_of((ints.bitwise_right_shift(8 * j) if j else ints).to(torch.uint8))
                            for j in range(itemsize)]
        else:
            self._values = [buffer_of(values.contiguous().view(torch.uint8))]

    def changed(self, chunk: int) -> int:
        """The number of changed elements of ``chunk``."""
        return self.bounds[chunk + 1] - self.bounds[chunk]

    def sections(self, chunk: int) -> list[list[bytes | memoryview]]:
        """The payload of ``chunk`` as its consecutive sections, each a list of parts: header and gap bytes
        (one gap byte per changed element, 255 escaping to the u32 list), long gaps, then the values, one
        section per byte plane if shuffled."""
        lo, hi = self.bounds[chunk], self.bounds[chunk + 1]
        big_lo, big_hi = self.big_bounds[chunk], self.big_bounds[chunk + 1]
        header = _SPARSE_COUNTS.pack(hi - lo, big_hi - big_lo)
        sections: list[list[bytes | memoryview]] = [[header, self._small[lo:hi]], [self._big[4 * big_lo:4 * big_hi]]]
        if self.shuffle:
            sections.extend([plane[lo:hi]] for plane in self._values)
        else:
            sections.append([self._values[0][lo * self.itemsize:hi * self.itemsize]])
        return sections

    def payload(self, chunk: int) -> bytes:
        """The uncompressed payload of ``chunk`` (what its frame decompresses to)."""
        return b"".join(bytes(part) for section in self.sections(chunk) for part in section)

    def frame(self, chunk: int, level: int) -> bytes:
        """The stored bytes of ``chunk``: one zstd frame declaring its content size, with a block boundary
        after each section. Every section gets entropy tables of its own (gap bytes, long gaps and each
        byte plane of the values have unrelated statistics; one table for a block mixing them costs ~14 %
        of a 1 %-changed bf16 chunk). Decoders see one ordinary frame."""
        sections = self.sections(chunk)
        compressor = _compressor(level).compressobj(size=sum(len(part) for section in sections for part in section))
        parts = []
        for section in sections:
            if any(len(part) for part in section):
                parts.extend(compressor.compress(part) for part in section)
                parts.append(compressor.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK))
        parts.append(compressor.flush(zstandard.COMPRESSOBJ_FLUSH_FINISH))
        return b"".join(parts)


_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"  # a zstd frame; skippable frames have other magic numbers


def _decompress(stored: bytes | memoryview, max_bytes: int, *, exact: bool) -> bytearray:
    """The content of a chunk's one zstd frame (FORMAT.md, "zstd frames"): a single frame, nothing before
    or after it, declaring its content size (equal to ``max_bytes`` if ``exact``, at most it otherwise),
    without a dictionary; a content checksum, if present, is verified."""
    if bytes(stored[:4]) != _ZSTD_MAGIC:
        raise ValueError("chunk does not start with a zstd frame (skippable frames and other data are refused)")
    try:
        params = zstandard.get_frame_parameters(stored)
        if params.content_size == zstandard.CONTENTSIZE_UNKNOWN:
            raise ValueError("zstd frame does not declare its content size")
        if params.dict_id:
            raise ValueError(f"zstd frame needs dictionary {params.dict_id}; the format uses none")
        if params.content_size > max_bytes or (exact and params.content_size != max_bytes):
            raise ValueError(f"frame declares {params.content_size} bytes, "
                             f"{'not' if exact else 'more than'} the {max_bytes} of its chunk")
        return bytearray(_decompressor().decompress(stored, max_output_size=max_bytes, allow_extra_data=False))
    except zstandard.ZstdError as exc:
        raise ValueError(f"corrupt zstd frame ({exc})") from exc


def apply_chunk(target: torch.Tensor, stored: bytes | memoryview, itemsize: int, *, shuffle: bool,
                layout: str = LAYOUT_DENSE, xor: bool = False) -> None:
    """Decode one stored chunk into ``target``, the chunk's uint8 bytes: ``target ^= decoded`` for XOR
    chunks (a sparse chunk touches only its changed elements), ``target[:] = decoded`` otherwise.

    Raises ValueError if the frame is malformed or does not decode to exactly the chunk's size.
    """
    raw_bytes = target.numel()
    if raw_bytes > MAX_CHUNK_BYTES:
        raise ValueError(f"chunk of {raw_bytes} bytes exceeds the format's limit")
    if layout == LAYOUT_SPARSE:
        if not xor:
            raise ValueError("the sparse layout is only valid for XOR chunks")
        xor_at(target, *sparse_changes([(0, raw_bytes, stored)], itemsize, shuffle))
        return
    chunk = _dense_chunk(stored, raw_bytes, itemsize, shuffle=shuffle)
    if not raw_bytes:
        return
    if xor:
        xor_into(target, chunk)
    else:
        target.copy_(chunk)


def _dense_chunk(stored: bytes | memoryview, raw_bytes: int, itemsize: int, *, shuffle: bool) -> torch.Tensor:
    """The uint8 bytes a dense chunk's frame decodes to (ValueError if malformed or not ``raw_bytes`` long)."""
    data = _decompress(stored, raw_bytes, exact=True)
    if len(data) != raw_bytes:  # zstd checks the declared size; kept as the invariant the copy relies on
        raise ValueError(f"chunk decoded to {len(data)} bytes, expected {raw_bytes}")
    if not raw_bytes:
        return torch.empty(0, dtype=torch.uint8)
    chunk = torch.frombuffer(data, dtype=torch.uint8)
    return _unshuffle(chunk, itemsize) if shuffle else chunk


def dense_xor_changes(stored: bytes | memoryview, raw_bytes: int, itemsize: int, *,
                      shuffle: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The changed elements of one dense XOR chunk: ascending int64 element indices within the chunk and
    their XOR values (the integer dtype of ``itemsize``), as :func:`sparse_changes` gives a sparse chunk's.
    Raises ValueError if the frame is malformed."""
    chunk = _dense_chunk(stored, raw_bytes, itemsize, shuffle=shuffle)
    if raw_bytes % itemsize:
        raise ValueError(f"chunk of {raw_bytes} bytes is not a whole number of {itemsize}-byte elements")
    positions = _changed_positions(chunk, itemsize)
    return positions, chunk.view(INT_OF_SIZE[itemsize])[positions]


def _sparse_payload(stored: bytes | memoryview, raw_bytes: int, itemsize: int) -> tuple[bytearray, int, int]:
    """The payload of a sparse chunk and its counts of changed elements and long gaps, its header and size
    checked against each other and the chunk's size."""
    n = raw_bytes // itemsize
    data = _decompress(stored, _SPARSE_HEADER + n * (1 + 4 + itemsize), exact=False)
    if len(data) < _SPARSE_HEADER:
        raise ValueError("sparse chunk is shorter than its header")
    count, n_big = _SPARSE_COUNTS.unpack_from(data)
    if not 0 <= count <= n or not 0 <= n_big <= count:
        raise ValueError(f"sparse chunk claims {count} changes / {n_big} long gaps for {n} elements")
    if len(data) != _SPARSE_HEADER + count * (1 + itemsize) + 4 * n_big:
        raise ValueError("sparse chunk size does not match its header")
    return data, count, n_big


class ChunkError(ValueError):
    """A malformed chunk among several decoded together; ``index`` is its place in the sequence given."""

    def __init__(self, index: int, message: str):
        super().__init__(message)
        self.index = index


def sparse_changes(chunks: Sequence[tuple[int, int, bytes | memoryview]], itemsize: int,
                   shuffle: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The changed elements of several sparse chunks of one tensor, decoded together and validated.

    Args:
        chunks: per chunk, its first byte in the tensor (a multiple of ``itemsize``), its raw size and its
            stored frame, in ascending order of position.

    Returns:
        The ascending int64 element indices of the changes in the tensor, and their XOR values (the integer
        dtype of ``itemsize``).

    Raises:
        ChunkError: naming the first malformed chunk found (its index in ``chunks``).

    Each chunk's frame is decompressed on its own (zstd releases the GIL); its sections are then joined
    with the other chunks' and decoded in a dozen whole-batch ops. Per chunk, those ops held the GIL for
    most of the chunk's time (~0.4 ms of 0.5 ms per 4 MiB chunk at 1 % changed) and serialized the
    decoding threads.
    """
    int_dtype = INT_OF_SIZE[itemsize]
    planes = itemsize if shuffle and itemsize > 1 else 1
    small: list[memoryview] = []
    big: list[memoryview] = []
    values: list[list[memoryview]] = [[] for _ in range(planes)]
    index_of: list[int] = []  # per non-empty chunk, its index in ``chunks``
    counts: list[int] = []
    n_bigs: list[int] = []
    starts: list[int] = []  # first element of each non-empty chunk
    sizes: list[int] = []  # elements of each non-empty chunk
    for index, (raw_start, raw_bytes, stored) in enumerate(chunks):
        try:
            data, count, n_big = _sparse_payload(stored, raw_bytes, itemsize)
        except ValueError as exc:
            raise ChunkError(index, str(exc)) from None
        if not count:
            continue
        view = memoryview(data)
        big_end = _SPARSE_HEADER + count + 4 * n_big
        small.append(view[_SPARSE_HEADER:_SPARSE_HEADER + count])
        big.append(view[_SPARSE_HEADER + count:big_end])
        plane_bytes = count * itemsize // planes
        for j in range(planes):
            values[j].append(view[big_end + j * plane_bytes:big_end + (j + 1) * plane_bytes])
        index_of.append(index)
        counts.append(count)
        n_bigs.append(n_big)
        starts.append(raw_start // itemsize)
        sizes.append(raw_bytes // itemsize)
    if not counts:
        return torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=int_dtype)
    # Sections are joined with Python's memcpy (into aligned buffers for the integer views): small torch
    # copies fork an OpenMP team each, which costs milliseconds on a busy machine.
    bounds = [0]
    for count in counts:
        bounds.append(bounds[-1] + count)
    gaps = torch.frombuffer(bytearray().join(small), dtype=torch.uint8).to(torch.int64)
    escaped = torch.nonzero(gaps == _GAP_ESCAPE).view(-1)
    per_chunk = torch.searchsorted(escaped, torch.tensor(bounds)).diff()
    bad = torch.nonzero(per_chunk != torch.tensor(n_bigs)).view(-1)
    if bad.numel():
        raise ChunkError(index_of[int(bad[0])], "sparse chunk's escaped gaps do not match its header")
    if escaped.numel():
        long_gaps = torch.frombuffer(bytearray().join(big), dtype=torch.int32).to(torch.int64)
        invalid = torch.nonzero(long_gaps < _GAP_ESCAPE).view(-1)
        if invalid.numel():
            big_bounds = torch.tensor(n_bigs).cumsum(0)
            chunk = int(torch.searchsorted(big_bounds, invalid[:1], right=True)[0])
            raise ChunkError(index_of[chunk], "sparse chunk has an invalid long gap")
        gaps.scatter_(0, escaped, long_gaps)
    ends = gaps.add_(1).cumsum_(0)  # per change: its position + 1, counted from its chunk's first element...
    last = ends[torch.tensor(bounds[1:]) - 1]
    before = torch.cat([last.new_zeros(1), last[:-1]])  # ... plus the changes' steps of the chunks before it
    beyond = torch.nonzero(last - before > torch.tensor(sizes)).view(-1)
    if beyond.numel():
        raise ChunkError(index_of[int(beyond[0])], "sparse chunk points past the end of its chunk")
    # Each chunk's changes from its first element on, to the tensor's: a view each (repeat_interleave of
    # the per-chunk shifts costs a gather over all the changes, ~4x more).
    positions = ends
    for lo, hi, shift in zip(bounds, bounds[1:], torch.tensor(starts).sub_(before).sub_(1).tolist()):
        positions[lo:hi].add_(shift)
    value_bytes = [torch.frombuffer(bytearray().join(plane), dtype=torch.uint8) for plane in values]
    if planes == 1:
        return positions, value_bytes[0].view(int_dtype)
    # Byte planes to integers by shifts (~3x faster than a transposing copy for a few thousand elements).
    changes = value_bytes[0].to(int_dtype)
    for j in range(1, itemsize):
        changes.bitwise_or_(value_bytes[j].to(int_dtype).bitwise_left_shift_(8 * j))
    return positions, changes


def xor_at(target: torch.Tensor, positions: torch.Tensor, values: torch.Tensor) -> None:
    """``target[positions] ^= values`` for the uint8 bytes ``target`` of a tensor whose elements have the
    integer dtype of ``values``, with ``positions`` distinct (as :func:`sparse_changes` gives them)."""
    if not positions.numel():
        return
    ints = target.view(values.dtype)
    ints.scatter_(0, positions, ints.gather(0, positions).bitwise_xor_(values))
