"""The change between two cached versions, in checkpoint names and coordinates: what workers apply in place.

Per checkpoint tensor that differs: the flat positions of the differing elements (int64, ascending) and
their old and new values in the checkpoint's dtype, compared bit for bit (a NaN that stays NaN is no
change; -0.0 and 0.0 differ). One safetensors file per (base, version) pair, written once per host in the
shared cache (``VersionCache.change``) and read by every worker of the host from there: never sent over
HTTP. The file's metadata names the stream, both versions and each tensor's shape.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from ..codec import bit_pattern
from ..hf import tensor_specs
from ..reader.materialize import MaterializedBase

_POSITIONS, _OLD, _NEW = "::positions", "::old", "::new"


@dataclass(frozen=True)
class ChangeSummary:
    """What a change holds: elements changed, of how many, in how many tensors; or why none was built."""

    changed: int
    total: int
    tensors: int
    problem: str | None = None


def build_change(base_dir: Path, target_dir: Path, out: Path, *, stream_id: str, base: int, version: int,
                 max_fraction: float) -> ChangeSummary:
    """Write the change from the materialized ``base_dir`` to ``target_dir`` to ``out``; none (``problem``
    set, nothing written) where the tensors differ in names, dtypes or shapes, or more than
    ``max_fraction`` of the elements changed (a full reload is then cheaper)."""
    old_tensors, new_tensors = MaterializedBase(base_dir, stream_id), MaterializedBase(target_dir, stream_id)
    try:
        names = new_tensors.names()
        if sorted(names) != sorted(old_tensors.names()):
            return ChangeSummary(0, 0, 0, problem="the versions hold different tensors")
        total = sum(math.prod(shape) for _, shape in tensor_specs(target_dir).values())
        tensors: dict[str, torch.Tensor] = {}
        shapes: dict[str, list[int]] = {}
        changed = 0
        for name in names:
            old, new = old_tensors.load(name), new_tensors.load(name)
            assert old is not None and new is not None
            if old.dtype != new.dtype or old.shape != new.shape:
                return ChangeSummary(0, 0, 0, problem=f"{name} changed its dtype or shape")
            flat_old, flat_new = old.reshape(-1), new.reshape(-1)
            positions = torch.nonzero(bit_pattern(flat_old) != bit_pattern(flat_new)).reshape(-1)
            if not positions.numel():
                continue
            changed += positions.numel()
            if changed > max_fraction * total:
                return ChangeSummary(changed, total, len(shapes), problem="too many elements changed")
            tensors[name + _POSITIONS] = positions
            tensors[name + _OLD] = flat_old[positions].contiguous()
            tensors[name + _NEW] = flat_new[positions].contiguous()
            shapes[name] = list(new.shape)
    finally:
        old_tensors.close()
        new_tensors.close()
    from safetensors.torch import save_file

    metadata = {"stream_id": stream_id, "base": str(base), "version": str(version), "shapes": json.dumps(shapes)}
    save_file(tensors, str(out), metadata=metadata)
    return ChangeSummary(changed, total, len(shapes))


def read_change(handle: Any) -> Iterator[tuple[str, tuple[tuple[int, ...], torch.Tensor, torch.Tensor,
                                                      torch.Tensor]]]:
    """Per changed tensor of an open change file (``safetensors.safe_open``): its name and (shape,
    positions, old values, new values)."""
    shapes = json.loads(handle.metadata()["shapes"])
    for name, shape in shapes.items():
        yield name, (tuple(shape), handle.get_tensor(name + _POSITIONS), handle.get_tensor(name + _OLD),
                     handle.get_tensor(name + _NEW))
