"""Host tensors sent to a GPU by a staging beside a generating engine: through two pinned buffers of the staging's own,
a piece at a time, on the staging's stream.

``tensor.to(device)`` from pageable memory (a change file's windows are views of its memory map) is a copy the CUDA
driver makes itself, through pinned memory of its own, the calling thread inside the driver until the last byte has
left: the page faults of the map and the host's copy are paid there. Here the host copies each piece into a pinned
buffer outside the driver (torch's copy, the interpreter let go), and the driver only queues a transfer from it; the
two buffers take turns, so that the next piece is copied on the host while the last one is in flight.
"""

from __future__ import annotations

import torch

UPLOAD_PIECE_BYTES = 8 << 20
"""Bytes of each of the two pinned buffers: a transfer queued at once (about 0.3 ms over PCIe 5), the staging's pinned
memory 16 MiB."""


class Uploads:
    """Sends host tensors to ``device`` on the stream current at each call (the staging's), through two pinned
    buffers made at the first call and kept; on a CPU ``device`` a tensor is returned as it is. One caller at a time
    (the buffers are shared: ``InPlaceApplier``'s stagings hold its staging lock)."""

    def __init__(self, device: torch.device, piece_bytes: int = UPLOAD_PIECE_BYTES):
        self.device = device
        self.piece_bytes = piece_bytes
        self._buffers: list[torch.Tensor] = []
        self._sent: list[torch.cuda.Event | None] = [None, None]  # per buffer: its last transfer queued

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (on the host) on the device, flat; its transfer queued on the current stream (the caller's
        ops that follow on that stream see it; the host tensor may change once this returns)."""
        if self.device.type != "cuda":
            return tensor.reshape(-1).to(self.device)
        source = tensor.contiguous().reshape(-1).view(torch.uint8)
        out = torch.empty(source.numel(), dtype=torch.uint8, device=self.device)
        if not self._buffers:
            self._buffers = [torch.empty(self.piece_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        stream = torch.cuda.current_stream(self.device)
        for turn, start in enumerate(range(0, source.numel(), self.piece_bytes)):
            k = turn % 2
            end = min(start + self.piece_bytes, source.numel())
            if self._sent[k] is not None:
                self._sent[k].synchronize()  # (its last transfer has left the buffer)
            self._buffers[k][:end - start].copy_(source[start:end])
            out[start:end].copy_(self._buffers[k][:end - start], non_blocking=True)
            self._sent[k] = torch.cuda.Event()
            self._sent[k].record(stream)
        return out.view(tensor.dtype)
