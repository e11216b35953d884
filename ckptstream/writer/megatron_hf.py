"""Megatron-core tensor names and layouts ↔ Hugging Face names and layouts, for whole (unsharded) tensors.

Pure tensor code shared by the live publisher (after its tensor-parallel gather) and the offline
``torch_dist`` converter. Megatron names here are *global*: ``decoder.layers.<i>`` counts layers over all
pipeline stages and virtual chunks, and expert indices count experts over all expert-parallel ranks.
Both the local layer spec's names (``input_layernorm``, ``pre_mlp_layernorm``,
``experts.local_experts.<e>``) and the Transformer-Engine spec's (``linear_qkv.layer_norm_weight``,
``linear_fc1.layer_norm_weight``, ``experts.linear_fc1.weight<e>``) are accepted.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from ..errors import ConversionError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe")

# Layer tensors that are renamed only: Megatron suffix → Hugging Face suffix.
_RENAMED = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.router.weight": "mlp.gate.weight",
}
_GLOBAL = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.(?:local_experts\.(\d+)\.linear_fc([12])\.weight|linear_fc([12])\.weight(\d+))")


@dataclass(frozen=True)
class HFArchitecture:
    """What the mapping needs from a Hugging Face ``config.json``."""

    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_embeddings: bool
    num_experts: int = 0
    qkv_bias: bool = False
    qk_norm: bool = False
    dtype: torch.dtype | None = None  # config.json's torch_dtype: what vLLM serves the model in

    @classmethod
    def from_config(cls, config: dict) -> HFArchitecture:
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConversionError(f"model_type {model_type!r} is not supported",
                                  hint=f"Supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        heads = int(config["num_attention_heads"])
        dtype_name = config.get("torch_dtype") or config.get("dtype")
        dtype = getattr(torch, dtype_name, None) if isinstance(dtype_name, str) else None
        return cls(model_type=model_type, num_layers=int(config["num_hidden_layers"]), num_heads=heads,
                   num_kv_heads=int(config.get("num_key_value_heads") or heads),
                   head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
                   vocab_size=int(config["vocab_size"]),
                   tie_embeddings=bool(config.get("tie_word_embeddings", False)),
                   num_experts=int(config.get("num_experts") or 0),
                   qkv_bias=model_type == "qwen2" or bool(config.get("attention_bias", False)),
                   qk_norm=model_type in ("qwen3", "qwen3_moe"),
                   dtype=dtype if isinstance(dtype, torch.dtype) else None)

    @classmethod
    def from_dir(cls, directory: str | os.PathLike[str]) -> HFArchitecture:
        path = Path(directory) / "config.json"
        try:
            return cls.from_config(json.loads(path.read_text()))
        except ConversionError:
            raise
        except (OSError, ValueError, KeyError) as exc:
            raise ConversionError(f"cannot read the Hugging Face config {path}: {exc!r}",
                                  hint="Pass --hf-config a model directory with a complete config.json") from exc


def hf_tensor_names(arch: HFArchitecture) -> list[str]:
    """Every tensor name a Hugging Face checkpoint of ``arch`` holds (what vLLM loads)."""
    names = ["model.embed_tokens.weight", "model.norm.weight"] + ([] if arch.tie_embeddings else ["lm_head.weight"])
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight", p + "self_attn.o_proj.weight"]
        names += [f"{p}self_attn.{x}_proj.{kind}" for x in "qkv"
                  for kind in (("weight", "bias") if arch.qkv_bias else ("weight",))]
        if arch.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        if arch.num_experts:
            names.append(p + "mlp.gate.weight")
            names += [f"{p}mlp.experts.{e}.{x}_proj.weight" for e in range(arch.num_experts)
                      for x in ("gate", "up", "down")]
        else:
            names += [f"{p}mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
    return names


def check_complete(names: set[str], arch: HFArchitecture) -> None:
    """Raise ConversionError naming the tensors of ``arch`` missing from ``names``."""
    missing = [name for name in hf_tensor_names(arch) if name not in names]
    if missing:
        raise ConversionError(f"{len(missing)} tensors of the model config.json describes have no source, e.g. "
                              f"{', '.join(missing[:4])}", tensor=missing[0],
                              hint="Check that --hf-config / hf_config_dir describes this model (layers, experts, "
                                   "biases, norms)")


def to_hf(name: str, tensor: torch.Tensor, arch: HFArchitecture) -> list[tuple[str, torch.Tensor]]:
    """The Hugging Face (name, tensor) pairs of one whole Megatron tensor under its global name.

    Returns views where possible (no copies). Returns ``[]`` for tensors vLLM does not load
    (``output_layer.weight`` of a model with tied embeddings, which pipeline parallelism keeps a copy of).

    Raises:
        ConversionError: the name is unknown or the shape does not fit ``arch``.
    """
    if name in _GLOBAL:
        if name == "output_layer.weight" and arch.tie_embeddings:
            return []
        if name != "decoder.final_layernorm.weight":
            tensor = _trim_vocab(name, tensor, arch)
        return [(_GLOBAL[name], tensor)]
    match = _LAYER.fullmatch(name)
    if match is None:
        raise ConversionError("no Hugging Face name is known for this Megatron tensor", tensor=name)
    layer, suffix = int(match.group(1)), match.group(2)
    if layer >= arch.num_layers:
        raise ConversionError(f"layer {layer} is beyond the {arch.num_layers} layers of config.json", tensor=name)
    prefix = f"model.layers.{layer}."
    if suffix in _RENAMED:
        return [(prefix + _RENAMED[suffix], tensor)]
    if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = suffix.rsplit(".", 1)[1]
        q, k, v = split_qkv(name, tensor, arch)
        return [(f"{prefix}self_attn.{p}_proj.{kind}", t) for p, t in zip("qkv", (q, k, v))]
    if suffix == "mlp.linear_fc1.weight":
        gate, up = _split_halves(name, tensor)
        return [(prefix + "mlp.gate_proj.weight", gate), (prefix + "mlp.up_proj.weight", up)]
    expert = _EXPERT.fullmatch(suffix)
    if expert is not None:
        index = int(expert.group(1) if expert.group(1) is not None else expert.group(4))
        fc = expert.group(2) or expert.group(3)
        if index >= arch.num_experts:
            raise ConversionError(f"expert {index} is beyond the {arch.num_experts} experts of config.json",
                                  tensor=name)
        expert_prefix = f"{prefix}mlp.experts.{index}."
        if fc == "2":
            return [(expert_prefix + "down_proj.weight", tensor)]
        gate, up = _split_halves(name, tensor)
        return [(expert_prefix + "gate_proj.weight", gate), (expert_prefix + "up_proj.weight", up)]
    raise ConversionError("no Hugging Face name is known for this Megatron tensor", tensor=name,
                          hint="Supported: dense Llama/Qwen2/Qwen3 and Qwen3-MoE layers without shared experts")


def split_qkv(name: str, tensor: torch.Tensor, arch: HFArchitecture) -> tuple[torch.Tensor, ...]:
    """Split Megatron's fused ``linear_qkv`` (rows grouped per query group: that group's query heads, then
    its key head, then its value head) into q, k and v. Uses ``head_dim`` (Megatron's kv_channels), which
    need not be hidden_size / num_heads."""
    groups, per_group, d = arch.num_kv_heads, arch.num_heads // arch.num_kv_heads, arch.head_dim
    rows = groups * (per_group + 2) * d
    if tensor.shape[0] != rows:
        raise ConversionError(f"has {tensor.shape[0]} rows; {arch.num_heads} heads, {groups} query groups of "
                              f"head_dim {d} need {rows}", tensor=name)
    grouped = tensor.reshape(groups, (per_group + 2) * d, *tensor.shape[1:])
    q, k, v = grouped.split([per_group * d, d, d], dim=1)
    return tuple(t.reshape(-1, *tensor.shape[1:]) for t in (q, k, v))


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: HFArchitecture) -> torch.Tensor:
    """The inverse of :func:`split_qkv`."""
    groups = arch.num_kv_heads
    rest = q.shape[1:]
    parts = [t.reshape(groups, -1, *rest) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def _split_halves(name: str, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's gated ``linear_fc1`` is [gate; up] (whole tensor, after the tensor-parallel regroup)."""
    if tensor.shape[0] % 2:
        raise ConversionError(f"gated linear_fc1 has an odd number of rows ({tensor.shape[0]})", tensor=name)
    gate, up = tensor.chunk(2, dim=0)
    return gate, up


def _trim_vocab(name: str, tensor: torch.Tensor, arch: HFArchitecture) -> torch.Tensor:
    """Megatron pads the vocabulary to a multiple of its divisor × TP size; vLLM expects config's size."""
    if tensor.shape[0] < arch.vocab_size:
        raise ConversionError(f"has {tensor.shape[0]} vocabulary rows, fewer than config.json's vocab_size "
                              f"{arch.vocab_size}", tensor=name)
    return tensor[:arch.vocab_size]


def from_hf(hf: dict[str, torch.Tensor], arch: HFArchitecture, *, te_names: bool = False
            ) -> Iterator[tuple[str, torch.Tensor]]:
    """Whole Megatron tensors (global names, unpadded vocabulary) from Hugging Face weights: the inverse of
    :func:`to_hf`, used to initialize a Megatron model from a Hugging Face model. ``te_names`` picks the
    Transformer-Engine spec's names for the fused layer norms and grouped experts."""
    yield "embedding.word_embeddings.weight", hf["model.embed_tokens.weight"]
    for i in range(arch.num_layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        yield (m + ("self_attention.linear_qkv.layer_norm_weight" if te_names else "input_layernorm.weight"),
               hf[p + "input_layernorm.weight"])
        for kind in ("weight", "bias"):
            if p + f"self_attn.q_proj.{kind}" in hf:
                yield m + f"self_attention.linear_qkv.{kind}", fuse_qkv(
                    *(hf[p + f"self_attn.{x}_proj.{kind}"] for x in "qkv"), arch)
        if p + "self_attn.q_norm.weight" in hf:
            yield m + "self_attention.q_layernorm.weight", hf[p + "self_attn.q_norm.weight"]
            yield m + "self_attention.k_layernorm.weight", hf[p + "self_attn.k_norm.weight"]
        yield m + "self_attention.linear_proj.weight", hf[p + "self_attn.o_proj.weight"]
        moe = arch.num_experts > 0
        yield (m + ("mlp.linear_fc1.layer_norm_weight" if te_names and not moe else "pre_mlp_layernorm.weight"),
               hf[p + "post_attention_layernorm.weight"])
        if not moe:
            yield m + "mlp.linear_fc1.weight", torch.cat([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]])
            yield m + "mlp.linear_fc2.weight", hf[p + "mlp.down_proj.weight"]
            continue
        yield m + "mlp.router.weight", hf[p + "mlp.gate.weight"]
        for e in range(arch.num_experts):
            q = f"{p}mlp.experts.{e}."
            fc1 = torch.cat([hf[q + "gate_proj.weight"], hf[q + "up_proj.weight"]])
            if te_names:
                yield m + f"mlp.experts.linear_fc1.weight{e}", fc1
                yield m + f"mlp.experts.linear_fc2.weight{e}", hf[q + "down_proj.weight"]
            else:
                yield m + f"mlp.experts.local_experts.{e}.linear_fc1.weight", fc1
                yield m + f"mlp.experts.local_experts.{e}.linear_fc2.weight", hf[q + "down_proj.weight"]
    yield "decoder.final_layernorm.weight", hf["model.norm.weight"]
    if not arch.tie_embeddings:
        yield "output_layer.weight", hf["lm_head.weight"]
