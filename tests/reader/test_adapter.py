"""The reader's side of adapter streams: a stream of the other kind refused with what it is and what to do,
and the checks a follower makes before serving an adapter's version (base, rank, target modules)."""

from __future__ import annotations

import pytest
import torch

from ckptstream import Stream
from ckptstream.errors import AdapterMismatchError, ModelMismatchError, StreamKindError
from ckptstream.format import STREAM_KIND_ADAPTER, STREAM_KIND_WEIGHTS, AdapterInfo, content_hash
from ckptstream.reader.adapter import check_adapter_fits, check_adapter_tensors
from ckptstream.testing.adapters import tiny_peft_model
from ckptstream.testing.models import TinyModelSpec, write_tiny_model
from ckptstream.writer import Publisher

BASE = content_hash(b"base")
INFO = AdapterInfo(base_name="Qwen/Qwen3-8B", base_hash=BASE, rank=16, target_modules=("q_proj", "v_proj"))
A, B = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", \
    "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


def test_require_kind_refuses_the_other_kind_naming_both_and_the_next_step(tmp_path):
    pytest.importorskip("peft")
    weights_url, adapter_url = str(tmp_path / "weights"), str(tmp_path / "adapter")
    with Publisher(weights_url) as publisher:
        publisher.publish({"w": torch.ones(2)}).result()
    base = write_tiny_model(tmp_path / "base", TinyModelSpec(arch="llama"))
    with Publisher(adapter_url, adapter_of=tiny_peft_model(base)) as publisher:
        publisher.publish().result()
    Stream(weights_url).require_kind(STREAM_KIND_WEIGHTS)
    Stream(adapter_url).require_kind(STREAM_KIND_ADAPTER)
    with pytest.raises(StreamKindError) as exc:
        Stream(adapter_url).require_kind(STREAM_KIND_WEIGHTS)
    assert str(exc.value) == (f"file stream.json: {adapter_url} is an adapter stream (LoRA adapters over a base "
                              "model), not a weights stream (a model's full weights). `ckptstream serve URL` "
                              "serves its base model with each version as a LoRA adapter (or `ckptstream follow "
                              "URL` beside a vLLM started with --enable-lora); `ckptstream info URL` names the base")
    assert (exc.value.url, exc.value.kind, exc.value.expected, exc.value.exit_code) == (
        adapter_url, STREAM_KIND_ADAPTER, STREAM_KIND_WEIGHTS, 6)
    with pytest.raises(StreamKindError, match=f"{weights_url} is a weights stream .*, not an adapter stream .*"
                                              "`ckptstream follow` and `ckptstream serve` serve it"):
        Stream(weights_url).require_kind(STREAM_KIND_ADAPTER)


def test_an_adapter_that_fits_the_server_passes():
    check_adapter_fits(INFO, base_hash=BASE, max_lora_rank=16, version=3, target_modules=["q_proj", "k_proj", "v_proj"])
    check_adapter_fits(INFO, base_hash=None, max_lora_rank=None, version=3)  # nothing known: nothing checked
    unknown_base = AdapterInfo("Qwen/Qwen3-8B", None, 16, ("q_proj",))
    check_adapter_fits(unknown_base, base_hash=content_hash(b"other"), max_lora_rank=16, version=3)


@pytest.mark.parametrize("server, message", [
    (dict(base_hash=content_hash(b"other")), "version 7: the adapter is of base model Qwen/Qwen3-8B "
                                             f"\\({BASE}\\), but the model of the server hashes to"),
    (dict(max_lora_rank=8), "version 7: the adapter has rank 16, above the server's --max-lora-rank 8. "
                            "Start vLLM with --max-lora-rank 16 or more"),
    (dict(target_modules=["q_proj", "o_proj"]), "version 7: the adapter targets modules the server cannot adapt: "
                                                "v_proj"),
])
def test_an_adapter_that_does_not_fit_the_server_is_refused_naming_the_version(server, message):
    arguments = {"base_hash": None, "max_lora_rank": None, **server}
    with pytest.raises(AdapterMismatchError, match=message) as exc:
        check_adapter_fits(INFO, version=7, **arguments)
    assert exc.value.version == 7 and isinstance(exc.value, ModelMismatchError)


def test_the_tensors_of_a_version_must_keep_the_streams_rank_and_modules():
    check_adapter_tensors(INFO, [(A, (16, 128)), (B, (128, 16)), ("base_model.model.lm_head.weight", (512, 128))],
                          version=1)
    check_adapter_tensors(INFO, [(A, (8, 128)), (B, (128, 8))], version=1)  # a rank_pattern's smaller rank
    for tensors, message in [
            ([(A, (32, 128))], "a LoRA tensor of rank 32, above the stream's rank 16"),
            ([(A, (16, 128)), (B, (128, 8))], "rank 8, but .*lora_A.weight of the same module has rank 16"),
            ([(A.replace("q_proj", "o_proj"), (16, 128))],
             "a LoRA tensor of a module the stream's target modules \\(q_proj, v_proj\\) do not cover"),
            ([(A, (16,))], "a LoRA tensor of shape \\[16\\] \\(it needs two dimensions\\)")]:
        with pytest.raises(AdapterMismatchError, match=f"version 1, tensor .*: {message}"):
            check_adapter_tensors(INFO, tensors, version=1)
