"""The architectures :mod:`ckptstream.testing.models` generates, without importing torch (the command
line offers them as choices, and building its parser must stay cheap)."""

from __future__ import annotations

# Short name -> (Hugging Face ``architectures`` class, ``model_type``) of config.json.
HF_NAMES: dict[str, tuple[str, str]] = {
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
}
ARCHITECTURES: tuple[str, ...] = tuple(HF_NAMES)
