"""Tiny PEFT LoRA adapters over the tiny models of :mod:`ckptstream.testing.models`, and their training
steps: the fixtures of adapter streams' tests (no hub downloads). Needs transformers and peft (the ``lora``
extra).

Example::

    base = write_tiny_model(tmp / "base", TinyModelSpec(arch="llama"))
    peft_dir = write_tiny_adapter(tmp / "adapter", base, rank=8)   # adapter_config.json + adapter_model.safetensors
    adapter_step(peft_dir)                                         # a "training step", in place
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from ..errors import CkptStreamError
from ..format import ADAPTER_WEIGHTS_FILE
from .models import rl_like_step

__all__ = ["DEFAULT_TARGETS", "adapter_step", "lora_tensors", "tiny_peft_model", "write_tiny_adapter"]

DEFAULT_TARGETS = ("q_proj", "v_proj")


def tiny_peft_model(base_dir: str | os.PathLike[str], *, rank: int = 8, seed: int = 0,
                    targets: Sequence[str] = DEFAULT_TARGETS) -> Any:
    """A ``peft.PeftModel``: the model of ``base_dir`` (``transformers.AutoModelForCausalLM``, in its config's
    dtype) with a LoRA adapter of ``rank`` on ``targets``, every LoRA weight drawn from a generator seeded with
    ``seed`` (``lora_B`` too, which PEFT initializes to zero, so the adapter changes the model's outputs)."""
    try:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM
    except ImportError as exc:
        raise CkptStreamError(f"a LoRA adapter needs {exc.name}, which is not installed",
                              hint="pip install 'ckptstream[lora]'") from None

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype="auto")
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=rank, target_modules=list(targets)))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in sorted(peft_model.named_parameters()):
            if ".lora_A." in name:  # (rank, in): scaled so that B @ A is about as large as the base's weights
                parameter.copy_(torch.randn(parameter.shape, generator=generator) / parameter.shape[1] ** 0.5)
            elif ".lora_B." in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    return peft_model


def write_tiny_adapter(out_dir: str | os.PathLike[str], base_dir: str | os.PathLike[str], *, rank: int = 8,
                       seed: int = 0, targets: Sequence[str] = DEFAULT_TARGETS) -> Path:
    """Write the adapter of :func:`tiny_peft_model` with ``PeftModel.save_pretrained``: ``out_dir`` then holds
    ``adapter_config.json`` (``base_model_name_or_path`` is ``base_dir``), ``adapter_model.safetensors`` and
    PEFT's README.md. Returns ``out_dir``."""
    out = Path(out_dir)
    tiny_peft_model(base_dir, rank=rank, seed=seed, targets=targets).save_pretrained(str(out))
    return out


def lora_tensors(model: Any) -> dict[str, torch.Tensor]:
    """The LoRA parameters of a ``PeftModel`` under their module names (adapter name included), as the
    tensors themselves: changing them changes the model."""
    return {name: parameter.data for name, parameter in model.named_parameters() if ".lora_" in name}


def adapter_step(target: str | os.PathLike[str] | Mapping[str, torch.Tensor] | Any, *, fraction: float = 0.1,
                 max_ulps: int = 3, seed: int = 0) -> int:
    """A "training step" of an adapter, in place: ``fraction`` of the elements of every LoRA tensor change by
    1..``max_ulps`` units in the last place (:func:`ckptstream.testing.models.rl_like_step`).

    Args:
        target: a PEFT directory (its ``adapter_model.safetensors`` is rewritten), a ``PeftModel`` (its LoRA
            parameters change) or a mapping of tensors (changed in place).
        seed: seeds the choice of elements (one step per seed).

    Returns:
        The number of elements changed.
    """
    generator = torch.Generator().manual_seed(seed)
    if isinstance(target, (str, os.PathLike)):
        from safetensors.torch import load_file, save_file

        path = Path(target) / ADAPTER_WEIGHTS_FILE
        state = load_file(str(path))
        changed = rl_like_step(state, fraction=fraction, max_ulps=max_ulps, generator=generator)
        save_file(state, str(path), metadata={"format": "pt"})
        return changed
    if isinstance(target, Mapping):
        return rl_like_step(target, fraction=fraction, max_ulps=max_ulps, generator=generator)
    with torch.no_grad():
        return rl_like_step(lora_tensors(target), fraction=fraction, max_ulps=max_ulps, generator=generator)
