"""Whether a rank's runtime parameters hold a checkpoint's values exactly. Where one rounds them (an FP8 weight of a
bf16 stream, bf16 served as fp16), the checkpoint's old bits that a change from the deltas alone is XORed from are
not in it: that rank stages the change with its old values instead (``unverifiable``), and names the tensors it
rounds once its loaders are traced (``InPlaceApplier.prepare``: ``Traced``), so that the follower builds that change
from the first update that changes one of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

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


def rounding_reason(runtime: torch.dtype, checkpoint: torch.dtype, param: str | None = None) -> str:
    """Why a parameter (``param``, where named) cannot give back a checkpoint tensor's bits (``holds_exactly`` is
    False), in one sentence."""
    held, stored = (str(d).removeprefix("torch.") for d in (runtime, checkpoint))
    return (f"{param or 'a parameter'} holds its values as {held}, which cannot hold every {stored} value of the "
            "checkpoint")


@dataclass(frozen=True)
class Traced:
    """A rank's answer to ``prepare``: whether its trace went through every tensor (``done``), and then the
    checkpoint tensors its parameters round, by reason (``rounding_reason`` of their dtypes: a few groups)."""

    done: bool
    rounded: dict[str, list[str]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"traced": self.done, "rounded": self.rounded}

    @classmethod
    def from_json(cls, value: Any) -> Traced | None:
        """The answer ``to_json`` gave, or None where a rank said nothing of its trace (an older extension)."""
        if not isinstance(value, dict) or not isinstance(value.get("rounded", {}), dict):
            return None
        return cls(bool(value.get("traced")), {str(why): [str(n) for n in names]
                                               for why, names in (value.get("rounded") or {}).items()})

    @classmethod
    def of_plans(cls, plans: Mapping[str, TensorPlan], dtypes: Mapping[str, torch.dtype],
                 params: Mapping[str, torch.Tensor]) -> Traced:
        """The answer of a rank whose trace is done: each tensor of ``plans`` (of dtype ``dtypes[name]``) that loads
        into a parameter not holding its values exactly, under the reason."""
        rounded: dict[str, list[str]] = {}
        for name, plan in plans.items():
            for runtime in {params[target.param].dtype for target in plan.targets} if name in dtypes else ():
                if not holds_exactly(runtime, dtypes[name]):
                    rounded.setdefault(rounding_reason(runtime, dtypes[name]), []).append(name)
        return cls(True, rounded)
