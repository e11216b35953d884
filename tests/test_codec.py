"""Chunk codecs: dense and sparse layouts round-trip; corrupt frames are refused."""

from __future__ import annotations

import pytest
import torch
import zstandard

from ckptstream import codec
from ckptstream.format import LAYOUT_DENSE, LAYOUT_SPARSE


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("density", [0.0, 0.001, 0.05, 0.5])
@pytest.mark.parametrize("shuffle", [True, False])
def test_xor_chunk_round_trip(dtype, density, shuffle):
    g = torch.Generator().manual_seed(0)
    base = torch.randint(0, 256, (40_000,), dtype=torch.uint8, generator=g)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    new = base.clone()
    n = new.numel() // itemsize
    changed = torch.randperm(n, generator=g)[: int(n * density)]
    new.view(n, itemsize)[changed, 0] ^= 0x5A
    if density == 0.0 and itemsize == 8:
        new.view(n, itemsize)[n - 1, 7] ^= 1  # a single change at the very end
    frame, count, layout = codec.encode_chunk(new, base, itemsize, shuffle=shuffle, level=3)
    assert count == int((new.view(n, itemsize) != base.view(n, itemsize)).any(1).sum())
    assert layout == (LAYOUT_SPARSE if count <= codec.SPARSE_MAX_DENSITY * n else LAYOUT_DENSE)
    restored = base.clone()
    codec.apply_chunk(restored, frame, itemsize, shuffle=shuffle, layout=layout, xor=True)
    assert torch.equal(restored, new)
    if layout == LAYOUT_DENSE:
        full, _, _ = codec.encode_chunk(new, None, itemsize, shuffle=shuffle, level=3)
        decoded = torch.zeros_like(new)
        codec.apply_chunk(decoded, full, itemsize, shuffle=shuffle)
        assert torch.equal(decoded, new)


def test_corrupt_frames_are_refused():
    data = torch.arange(4096, dtype=torch.int32).view(torch.uint8)
    frame, _, _ = codec.encode_chunk(data, None, 4, shuffle=True, level=3)
    with pytest.raises(ValueError):
        codec.apply_chunk(torch.empty_like(data), frame[:-3], 4, shuffle=True)
    with pytest.raises(ValueError, match="declares"):
        codec.apply_chunk(torch.empty_like(data)[:-4], frame, 4, shuffle=True)
    base = data.clone()
    new = data.clone()
    new[100] ^= 1
    sparse, _, layout = codec.encode_chunk(new, base, 4, shuffle=True, level=3)
    assert layout == LAYOUT_SPARSE
    with pytest.raises(ValueError):  # a sparse payload read as dense is a size mismatch, not garbage
        codec.apply_chunk(base.clone(), sparse, 4, shuffle=True, layout=LAYOUT_DENSE, xor=True)
    with pytest.raises(ValueError):
        codec.apply_chunk(base.clone()[:64], sparse, 4, shuffle=True, layout=LAYOUT_SPARSE, xor=True)
    with pytest.raises(ValueError, match="only valid for XOR"):
        codec.apply_chunk(base.clone(), sparse, 4, shuffle=True, layout=LAYOUT_SPARSE)


def _dense_frame(data: torch.Tensor, **compressor) -> bytes:
    return zstandard.ZstdCompressor(**compressor).compress(codec.buffer_of(data))


def test_zstd_frame_rules():
    """FORMAT.md, "zstd frames": one frame declaring its size, no dictionary, nothing before or after it;
    a content checksum is allowed and verified."""
    data = torch.arange(1024, dtype=torch.int32).view(torch.uint8)
    good = _dense_frame(data, write_content_size=True)

    def decode(frame: bytes) -> torch.Tensor:
        out = torch.empty_like(data)
        codec.apply_chunk(out, frame, 4, shuffle=False)
        return out

    assert torch.equal(decode(good), data)
    checksummed = _dense_frame(data, write_content_size=True, write_checksum=True)
    assert torch.equal(decode(checksummed), data)
    damaged = bytearray(checksummed)
    damaged[-1] ^= 1  # the checksum itself
    with pytest.raises(ValueError, match="checksum"):
        decode(bytes(damaged))
    half = data.numel() // 2
    halves = _dense_frame(data[:half], write_content_size=True) + _dense_frame(data[half:], write_content_size=True)
    with pytest.raises(ValueError, match="declares 2048 bytes, not the 4096"):
        decode(halves)
    with pytest.raises(ValueError, match="unused data"):  # before: the second frame was ignored
        decode(good + good)
    with pytest.raises(ValueError, match="unused data"):
        decode(good + b"\0\0\0\0")
    skippable = (0x184D2A50).to_bytes(4, "little") + (4).to_bytes(4, "little") + b"note"
    for frame in (skippable + good, skippable, good + skippable):
        with pytest.raises(ValueError, match="skippable|unused data"):
            decode(frame)
    with pytest.raises(ValueError, match="does not declare its content size"):
        decode(_dense_frame(data, write_content_size=False))
    samples = [bytes([i % 7, i % 13, i % 5]) * 50 for i in range(500)]
    dictionary = zstandard.train_dictionary(1024, samples)
    with pytest.raises(ValueError, match="needs dictionary"):
        decode(_dense_frame(data, write_content_size=True, dict_data=dictionary))


def test_sparse_chunk_frame_rules():
    base = torch.zeros(4096, dtype=torch.uint8)
    new = base.clone()
    new[100] = 1
    sparse, _, layout = codec.encode_chunk(new, base, 4, shuffle=True, level=3)
    assert layout == LAYOUT_SPARSE
    with pytest.raises(ValueError, match="unused data"):
        codec.apply_chunk(base.clone(), sparse + sparse, 4, shuffle=True, layout=LAYOUT_SPARSE, xor=True)
    payload = zstandard.ZstdDecompressor().decompress(sparse)
    unsized = zstandard.ZstdCompressor(write_content_size=False).compress(payload)
    with pytest.raises(ValueError, match="does not declare its content size"):
        codec.apply_chunk(base.clone(), unsized, 4, shuffle=True, layout=LAYOUT_SPARSE, xor=True)


def test_dtype_maps_derive_from_the_format():
    from ckptstream.format import DTYPE_SIZES

    assert set(codec.DTYPE_TO_TORCH) == set(DTYPE_SIZES)  # this torch build has every dtype of the format
    for name, dtype in codec.DTYPE_TO_TORCH.items():
        assert dtype.itemsize == DTYPE_SIZES[name] and codec.dtype_name(dtype) == name
    assert codec.torch_dtype("F8_E4M3") == torch.float8_e4m3fn and codec.torch_dtype("U16") == torch.uint16


def _sparse_case(case: str, n: int, itemsize: int, g: torch.Generator) -> torch.Tensor:
    """Positions of the changed elements of an ``n``-element chunk for a named adversarial case."""
    if case == "none":
        return torch.empty(0, dtype=torch.int64)
    if case == "all":
        return torch.arange(n)
    if case == "edges":  # the first and the last element only
        return torch.tensor([0, n - 1])
    if case == "long-gaps":  # gaps of 254, 255, 256, 65 535 and beyond: escapes and their neighbours
        return torch.tensor([254, 254 + 256, 254 + 256 + 257, 70_000, n - 1])
    return torch.unique(torch.randint(0, n, (n // 100,), generator=g))  # random, ~1 %


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("case", ["none", "all", "edges", "long-gaps", "random"])
@pytest.mark.parametrize("shuffle", [True, False])
def test_sparse_frame_round_trips_bit_exactly(dtype, case, shuffle):
    """``sparse_frame`` (one block per section) decodes, through the reader, to exactly its input: also
    for values with every bit set (the top byte of a plane shifted into the sign bit)."""
    g = torch.Generator().manual_seed(1)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    n = (1 << 20) // itemsize
    base = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=g)
    positions = _sparse_case(case, n, itemsize, g)
    values = torch.randint(1, 256, (positions.numel(), itemsize), dtype=torch.uint8, generator=g)
    values[::3] = 255
    values = values.view(codec.INT_OF_SIZE[itemsize]).view(-1)
    frame = codec.sparse_frame(positions, values, itemsize, shuffle=shuffle, level=3)
    params = zstandard.get_frame_parameters(frame)
    payload = codec.SparseChunks(positions, values, itemsize, elements=n, chunk_elements=n,
                                 shuffle=shuffle).payload(0)
    assert params.content_size == len(payload)
    # One ordinary frame holding exactly the sparse layout's payload (FORMAT.md), whatever its blocks.
    assert zstandard.ZstdDecompressor().decompress(frame) == payload
    restored = base.clone()
    codec.apply_chunk(restored, frame, itemsize, shuffle=shuffle, layout=LAYOUT_SPARSE, xor=True)
    expected = base.clone()
    ints = expected.view(codec.INT_OF_SIZE[itemsize])
    ints[positions] ^= values
    assert torch.equal(restored, expected)


def test_sparse_frames_are_smaller_than_one_pass():
    """At 1 % of bf16 elements changed by a few ulps, per-section blocks store less than one zstd pass
    over the same payload (the figure behind FORMAT.md's note)."""
    from ckptstream.testing.models import rl_like_step

    g = torch.Generator().manual_seed(0)
    base = (torch.randn(1 << 21, generator=g) * 0.02).to(torch.bfloat16)
    new = base.clone()
    rl_like_step({"w": new}, fraction=0.01, generator=g)
    a, b = codec.as_bytes(new), codec.as_bytes(base)
    frame, _, layout = codec.encode_chunk(a, b, 2, shuffle=True, level=3)
    assert layout == LAYOUT_SPARSE
    xor = codec._xor(a, b)
    positions = codec._changed_positions(xor, 2)
    one_pass = codec._compressor(3).compress(codec.SparseChunks(
        positions, xor.view(torch.int16)[positions], 2, elements=a.numel() // 2, chunk_elements=a.numel() // 2,
        shuffle=True).payload(0))
    assert len(frame) < 0.9 * len(one_pass)
    assert len(frame) < 0.008 * a.numel()


@pytest.mark.parametrize("itemsize", [1, 2, 4])
def test_sparse_chunks_of_a_tensor_equal_each_chunk_alone(itemsize):
    """``SparseChunks`` (every chunk of a tensor serialized at once) stores each chunk as ``sparse_frame``
    of that chunk alone: gaps restart at chunk boundaries (also after a long gap across one, or after
    empty chunks), escapes are counted per chunk, the last chunk is shorter."""
    g = torch.Generator().manual_seed(3)
    chunk = 4096
    n = 6 * chunk + 100
    dtype = codec.INT_OF_SIZE[itemsize]
    positions = torch.unique(torch.cat([
        torch.randint(0, chunk, (60,), generator=g),  # chunk 0: dense-ish
        torch.tensor([chunk - 1, 3 * chunk + 300, 3 * chunk + 300 + 256]),  # a long gap over two empty chunks
        torch.randint(4 * chunk, n, (40,), generator=g)]))
    values = torch.randint(1, 100, (positions.numel(),), generator=g).to(dtype)
    chunks = codec.SparseChunks(positions, values, itemsize, elements=n, chunk_elements=chunk, shuffle=True)
    for number, start in enumerate(range(0, n, chunk)):
        inside = (positions >= start) & (positions < start + chunk)
        assert chunks.changed(number) == int(inside.sum())
        alone = codec.sparse_frame(positions[inside] - start, values[inside], itemsize, shuffle=True, level=3)
        assert chunks.frame(number, 3) == alone, number
        restored = torch.zeros(min(chunk, n - start) * itemsize, dtype=torch.uint8)
        codec.apply_chunk(restored, alone, itemsize, shuffle=True, layout=LAYOUT_SPARSE, xor=True)
        expected = torch.zeros(min(chunk, n - start), dtype=dtype)
        expected[positions[inside] - start] = values[inside]
        assert torch.equal(restored.view(dtype), expected)


@pytest.mark.parametrize("itemsize", [1, 2, 4])
def test_sparse_chunks_decode_together_as_alone(itemsize):
    """``sparse_changes`` over several chunks (some without changes, long gaps, a short last chunk) gives the
    tensor's changes, as each chunk applied alone does; a malformed chunk among them is named by index."""
    g = torch.Generator().manual_seed(3)
    chunk_bytes = 3000 * itemsize
    base = torch.randint(0, 256, (4 * chunk_bytes + 10 * itemsize,), dtype=torch.uint8, generator=g)
    new = base.clone()
    n = new.numel() // itemsize
    changed = torch.randperm(n, generator=g)[: n // 100]
    changed = changed[(changed < 3000) | (changed >= 6000)]  # the second chunk unchanged
    new.view(n, itemsize)[changed, 0] ^= 0x21
    new.view(n, itemsize)[2 * 3000 + 2, 0] ^= 1  # a gap of more than 255 elements in the third chunk
    chunks, alone = [], base.clone()
    for start, end in codec.chunk_ranges(new.numel(), itemsize, chunk_bytes):
        frame, _, layout = codec.encode_chunk(new[start:end], base[start:end], itemsize, shuffle=True, level=3)
        assert layout == LAYOUT_SPARSE
        chunks.append((start, end - start, frame))
        codec.apply_chunk(alone[start:end], frame, itemsize, shuffle=True, layout=layout, xor=True)
    positions, values = codec.sparse_changes(chunks, itemsize, shuffle=True)
    together = base.clone()
    codec.xor_at(together, positions, values)
    assert torch.equal(together, new) and torch.equal(alone, new)
    assert torch.equal(positions, positions.sort().values)
    broken = list(chunks)
    broken[2] = (broken[2][0], broken[2][1], zstandard.ZstdCompressor(write_content_size=True).compress(
        b"\x01\x00\x00\x00\x00\x00\x00\x00" + bytes([255]) + bytes(itemsize)))  # an escape without its long gap
    with pytest.raises(codec.ChunkError, match="escaped gaps do not match") as info:
        codec.sparse_changes(broken, itemsize, shuffle=True)
    assert info.value.index == 2
