"""The Megatron ↔ Hugging Face tensor mapping on whole tensors (no megatron-core needed): every
architecture and both layer specs' names round-trip exactly, and what cannot be mapped is refused with
the tensor named."""

from __future__ import annotations

import pytest
import torch

from ckptstream.errors import ConversionError
from ckptstream.testing.models import ARCHITECTURES, TinyModelSpec, tiny_config, tiny_state_dict
from ckptstream.writer.megatron_hf import (HFArchitecture, check_complete, fuse_qkv, from_hf, hf_tensor_names,
                                           split_qkv, to_hf)
from tests.helpers import assert_same_tensors


@pytest.mark.parametrize("te_names", [False, True], ids=["local-spec", "te-spec"])
@pytest.mark.parametrize("arch_name", ARCHITECTURES)
def test_round_trip(arch_name: str, te_names: bool) -> None:
    spec = TinyModelSpec(arch=arch_name, tie_embeddings=arch_name == "llama", num_heads=8, num_kv_heads=2,
                         hidden_size=256)
    hf = tiny_state_dict(spec)
    arch = HFArchitecture.from_config(tiny_config(spec))
    megatron = dict(from_hf(hf, arch, te_names=te_names))
    assert any("layer_norm_weight" in name for name in megatron) == te_names
    back = {name: tensor for m_name, m_tensor in megatron.items() for name, tensor in to_hf(m_name, m_tensor, arch)}
    assert_same_tensors(back, hf)
    assert sorted(hf_tensor_names(arch)) == sorted(hf)
    check_complete(set(back), arch)
    with pytest.raises(ConversionError, match="1 tensors of the model config.json describes have no source"):
        check_complete(set(back) - {"model.norm.weight"}, arch)


def test_qkv_grouping_follows_kv_channels() -> None:
    """head_dim (kv_channels) need not be hidden / heads: the split uses it, and q/k/v land per group."""
    arch = HFArchitecture("qwen3", 1, num_heads=4, num_kv_heads=2, head_dim=3, vocab_size=8, tie_embeddings=False)
    q = torch.arange(12 * 5).reshape(12, 5)
    k, v = 100 + torch.arange(6 * 5).reshape(6, 5), 200 + torch.arange(6 * 5).reshape(6, 5)
    fused = fuse_qkv(q, k, v, arch)
    # Group 0: q heads 0-1 (rows 0-5), k head 0, v head 0; then group 1.
    assert torch.equal(fused[:6], q[:6]) and torch.equal(fused[6:9], k[:3]) and torch.equal(fused[9:12], v[:3])
    assert all(torch.equal(a, b) for a, b in zip(split_qkv("qkv", fused, arch), (q, k, v)))


def test_padded_vocabulary_is_trimmed_and_tied_output_skipped() -> None:
    arch = HFArchitecture("llama", 1, 4, 2, 32, vocab_size=500, tie_embeddings=True)
    [(name, tensor)] = to_hf("embedding.word_embeddings.weight", torch.zeros(512, 128), arch)
    assert name == "model.embed_tokens.weight" and tensor.shape == (500, 128)
    assert to_hf("output_layer.weight", torch.zeros(512, 128), arch) == []


@pytest.mark.parametrize("name,shape,message", [
    ("decoder.layers.0.mlp.shared_experts.linear_fc1.weight", (8, 4), "no Hugging Face name"),
    ("decoder.layers.7.input_layernorm.weight", (128,), "beyond the 2 layers"),
    ("decoder.layers.0.self_attention.linear_qkv.weight", (100, 128), "need 256"),
    ("decoder.layers.0.mlp.experts.local_experts.9.linear_fc2.weight", (128, 64), "beyond the 4 experts"),
    ("embedding.word_embeddings.weight", (100, 128), "fewer than config.json's vocab_size"),
    ("rotary_pos_emb.inv_freq", (16,), "no Hugging Face name"),
])
def test_unmappable_tensors_are_refused(name: str, shape: tuple[int, ...], message: str) -> None:
    arch = HFArchitecture.from_config(tiny_config(TinyModelSpec(arch="qwen3_moe")))
    with pytest.raises(ConversionError, match=message) as info:
        to_hf(name, torch.zeros(shape), arch)
    assert info.value.tensor == name


def test_unsupported_architecture_and_missing_config(tmp_path) -> None:
    with pytest.raises(ConversionError, match="model_type 'mistral' is not supported"):
        HFArchitecture.from_config({"model_type": "mistral"})
    with pytest.raises(ConversionError, match="cannot read the Hugging Face config"):
        HFArchitecture.from_dir(tmp_path)
    assert HFArchitecture.from_config(tiny_config(TinyModelSpec())).dtype == torch.bfloat16
