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
    change file holds, from memory and from a file's memory map (a change file's windows), and one not contiguous,
    arrive bit for bit (flat); the host tensor changed once the call returned leaves the upload as it was (the
    buffers are the uploader's)."""
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
                sent.append((whole[low:high].clone(), uploads(whole[low:high])))  # (a view of the map, as staged)
        sent.append((source[:4000].view(40, 100)[:, ::3].reshape(-1), uploads(source[:4000].view(40, 100)[:, ::3])))
    for expected, upload in sent:
        assert upload.device.type == device and upload.dtype == expected.dtype
        assert torch.equal(bit_pattern(upload.cpu()), bit_pattern(expected))
    if device == "cpu":
        return
    host = raw[:3000].clone()  # (changed once the call returned: what was sent stays)
    upload = uploads(host)
    host.zero_()
    assert torch.equal(upload.cpu(), raw[:3000])
