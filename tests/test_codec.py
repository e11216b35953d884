"""Chunk codecs: dense and sparse layouts round-trip; corrupt frames are refused."""

from __future__ import annotations

import pytest
import torch

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
