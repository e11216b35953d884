"""Whether a rank's runtime parameters hold a checkpoint's values exactly. Where one rounds them (an FP8 weight of a
bf16 stream, bf16 served as fp16), the checkpoint's old bits that a change from the deltas alone is XORed from are
not in it: that rank stages the change with its old values instead (``unverifiable``), and names the tensors it
rounds once its loaders are traced (``InPlaceApplier.prepare``), so that the follower builds that change from the
first update that changes one of them.
"""

from __future__ import annotations

from typing import Mapping

import torch

from .trace import TensorPlan


def holds_exactly(runtime: torch.dtype, checkpoint: torch.dtype) -> bool:
    """Whether a runtime parameter of dtype ``runtime`` holds every value of a ``checkpoint`` dtype exactly, so
    that casting it back gives the checkpoint's bits: the same dtype, or a float one wider in every respect
    (bf16 or fp16 served as fp32; not bf16 as fp16, nor fp32 as bf16)."""
    if runtime == checkpoint:
        return True
    if not (runtime.is_floating_point and checkpoint.is_floating_point):
        return False
    wide, narrow = torch.finfo(runtime), torch.finfo(checkpoint)
    return (wide.bits > narrow.bits and wide.eps <= narrow.eps and wide.max >= narrow.max
            and wide.smallest_normal <= narrow.smallest_normal)


def rounding(param: str, runtime: torch.dtype, checkpoint: torch.dtype) -> str:
    """Why ``param`` cannot give back a checkpoint tensor's bits (``holds_exactly`` is False), in one sentence."""
    held, stored = (str(d).removeprefix("torch.") for d in (runtime, checkpoint))
    return f"{param} holds its values as {held}, which cannot hold every {stored} value of the checkpoint"


def rounded_tensors(plans: Mapping[str, TensorPlan], dtypes: Mapping[str, torch.dtype],
                    params: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Per checkpoint tensor of ``plans`` (of dtype ``dtypes[name]``) that loads into a parameter that does not hold
    its values exactly: ``rounding``'s reason."""
    return {name: rounding(target.param, params[target.param].dtype, dtypes[name])
            for name, plan in plans.items() if name in dtypes for target in plan.targets
            if not holds_exactly(params[target.param].dtype, dtypes[name])}
