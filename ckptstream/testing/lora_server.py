"""LoRA adapters for tests of vLLM servers serving adapters: real PEFT directories of a tiny base model, and
the entry point of ckptstream's alias resolver for a vLLM started from a checkout that was installed before
the entry point existed.

``write_peft_adapter`` makes the adapter with PEFT itself (transformers and peft must be installed):
``peft.get_peft_model`` on the base, its LoRA matrices random (PEFT starts ``lora_B`` at zero, which would
change nothing), ``save_pretrained``.
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path
from typing import Sequence

from ..lora_aliases import PLUGIN_NAME

PLUGIN_DIST = "ckptstream_lora_aliases_entry_point"
"""The distribution ``resolver_plugin_path`` declares (not ``ckptstream``: it would hide the installed one's
other entry points)."""


def write_peft_adapter(out_dir: str | os.PathLike[str], base_dir: str | os.PathLike[str], *, rank: int = 8,
                       seed: int = 0, targets: Sequence[str] = ("q_proj", "v_proj")) -> Path:
    """A PEFT LoRA directory (``adapter_config.json``, ``adapter_model.safetensors``) for the model in
    ``base_dir`` (e.g. ``models.write_tiny_model``'s), of rank ``rank`` on the modules ``targets``, its
    weights drawn from ``seed`` (large enough to change greedy outputs). Returns ``out_dir``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.bfloat16)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets)))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    model.save_pretrained(out_dir)
    return Path(out_dir)


def resolver_plugin_path(directory: str | os.PathLike[str]) -> Path | None:
    """Where the installed ckptstream lacks the ``vllm.general_plugins`` entry point of its alias resolver
    (pyproject.toml declares it; an editable install made before it existed lacks it): a directory, to put on
    vLLM's ``PYTHONPATH``, holding a distribution that declares it. None where it is installed."""
    if any(ep.name == PLUGIN_NAME for ep in importlib.metadata.entry_points(group="vllm.general_plugins")):
        return None
    info = Path(directory) / f"{PLUGIN_DIST}-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {PLUGIN_DIST}\nVersion: 0\n")
    (info / "entry_points.txt").write_text(
        f"[vllm.general_plugins]\n{PLUGIN_NAME} = ckptstream.lora_aliases:register_resolver\n")
    return Path(directory)
