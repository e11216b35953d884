"""Run by tests/writer/test_device_kernels.py in Triton's interpreter (``TRITON_INTERPRET=1``): the Triton
kernels on CPU tensors against the torch reference, bit for bit."""

from __future__ import annotations

import os

import pytest
import torch

from ckptstream.writer.device_kernels import BLOCK, TorchKernels, TritonKernels, blocks, prefix_sums

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/writer/test_device_kernels.py"


def _case(case: str, n: int, dtype: torch.dtype, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    info = torch.iinfo(dtype)
    old = torch.randint(max(info.min, -(1 << 40)), min(info.max, 1 << 40), (n,), generator=g, dtype=dtype)
    new = old.clone()
    if case == "all":
        new ^= 1
    elif case == "edges":  # first and last element, and both sides of every block boundary
        for i in [0, n - 1] + [b * BLOCK + d for b in range(1, blocks(n)) for d in (-1, 0)]:
            new[i] ^= -1 if dtype.is_signed else info.max  # every bit
    elif case == "random":
        new[torch.randint(0, n, (max(1, n // 100),), generator=g)] += 1
    return old, new


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32, torch.int64])
@pytest.mark.parametrize("case", ["none", "all", "edges", "random"])
@pytest.mark.parametrize("n", [1, BLOCK - 1, BLOCK, 2 * BLOCK + 77])
def test_counts_and_compaction_match_the_reference(dtype, case, n):
    g = torch.Generator().manual_seed(n)
    old, new = _case(case, n, dtype, g)
    results = []
    for kernels in (TorchKernels(), TritonKernels()):
        # two spans in one counts buffer, the second after another span's blocks (its base is not 0)
        resident = torch.cat([old, old])
        live = torch.cat([new, new])
        spans = [(resident[:n], live[:n]), (resident[n:], live[n:])]
        counts = torch.full((2 * blocks(n),), -1, dtype=torch.int32)
        for number, (o, w) in enumerate(spans):
            kernels.count_blocks(o, w, counts, number * blocks(n))
        ends = prefix_sums(counts)  # as a capture has them (int32)
        out = [counts.clone()]
        for number, (o, w) in enumerate(spans):
            first, end = number * blocks(n), (number + 1) * blocks(n)
            base = int(ends[first - 1]) if first else 0
            changed = int(ends[end - 1]) - base
            positions, values = kernels.compact(o, w, ends, counts, first, base, changed)
            out += [positions, values]
        out.append(resident)
        results.append(out)
    reference, triton = results
    assert torch.equal(reference[0], triton[0])  # block counts
    assert int(reference[0].sum()) == 2 * int((old != new).sum())
    for a, b in zip(reference[1:], triton[1:]):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert torch.equal(reference[-1], torch.cat([new, new]))  # the resident copy now holds the new version
