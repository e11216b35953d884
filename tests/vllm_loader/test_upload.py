"""``inplace.upload.Uploads``: host tensors sent to a GPU through two pinned buffers, a piece at a time (run where a
GPU is: the device machine's run of this file; on a CPU a tensor is returned as it is)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckptstream.codec import bit_pattern
from ckptstream.vllm_loader.inplace.upload import Uploads

_DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


@pytest.mark.parametrize("device", _DEVICES)
def test_uploads_equal_the_host_tensors_whatever_their_size_and_dtype(tmp_path: Path, device: str):
    """Tensors of none, one, a few pieces and more than both buffers (pieces of 1,000 bytes here), of each dtype a
    change file holds, from memory and from a file's memory map (a change file's windows), arrive bit for bit;
    the host tensor changed once the call returned leaves the upload as it was (the buffers are the uploader's)."""
    uploads = Uploads(torch.device(device), piece_bytes=1000)
    generator = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (10_000,), generator=generator, dtype=torch.uint8)
    path = tmp_path / "window.bin"
    path.write_bytes(raw.numpy().tobytes())
    mapped = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage.from_file(str(path), shared=False,
                                                                                 nbytes=raw.numel()))
    sent = []
    for source in (raw, mapped):
        for dtype in (torch.uint8, torch.int32, torch.int64, torch.bfloat16):
            whole = source.view(dtype)
            for low, high in ((0, 0), (3, 4), (10, 200), (0, whole.numel())):
                host = whole[low:high].clone()
                sent.append((host.clone(), host, uploads(host)))
    if device == "cpu":
        assert all(upload is host for _, host, upload in sent)
        return
    for expected, host, upload in sent:
        host.zero_()  # (after the call: what was sent stays)
        assert upload.device.type == "cuda" and upload.dtype == expected.dtype
        assert torch.equal(bit_pattern(upload.cpu()), bit_pattern(expected))
