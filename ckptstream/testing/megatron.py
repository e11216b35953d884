"""Tiny megatron-core models built from tiny Hugging Face models: the fixtures of the Megatron tests, the
launch recipe and the publish benchmark. Imports megatron-core.

``build_gpt_model`` makes this rank's part of a ``GPTModel`` of the architecture in a Hugging Face
``config.json`` (call it after ``parallel_state.initialize_model_parallel``); ``cpu_support`` makes
megatron-core run on a CPU-only machine; ``pipeline_logits`` runs a forward pass over the pipeline
stages and returns the whole logits on the last stage.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
from pathlib import Path
from typing import Any, Iterator

import torch


def initialize_parallel(*, tp: int = 1, pp: int = 1, vpp: int | None = None, ep: int = 1,
                        timeout: datetime.timedelta = datetime.timedelta(minutes=10)) -> torch.device:
    """Start torch.distributed from torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``, ``LOCAL_RANK``) — NCCL with one GPU per rank where CUDA exists, else gloo on CPU —
    then megatron's model-parallel state and, on GPUs, its RNG states. Returns this rank's device."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    cuda = torch.cuda.is_available()
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        dist.init_process_group("gloo", timeout=timeout)
    mpu.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                  virtual_pipeline_model_parallel_size=vpp, expert_model_parallel_size=ep)
    if cuda:
        model_parallel_cuda_manual_seed(0)  # the RNG states of megatron's dropout regions
        return device
    return torch.device("cpu")


def megatron_config(hf_config_dir: str | os.PathLike[str], *, params_dtype: torch.dtype = torch.float32,
                    **overrides: Any) -> Any:
    """The ``TransformerConfig`` of the model described by a Hugging Face ``config.json``."""
    from megatron.core import parallel_state as mpu
    from megatron.core.transformer.transformer_config import TransformerConfig

    hf = json.loads((Path(hf_config_dir) / "config.json").read_text())
    experts = int(hf.get("num_experts") or 0)
    fields: dict[str, Any] = dict(
        num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
        num_attention_heads=hf["num_attention_heads"], num_query_groups=hf["num_key_value_heads"],
        kv_channels=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        ffn_hidden_size=hf["intermediate_size"], normalization="RMSNorm", layernorm_epsilon=hf["rms_norm_eps"],
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        add_qkv_bias=hf["model_type"] == "qwen2", qk_layernorm=hf["model_type"] in ("qwen3", "qwen3_moe"),
        tensor_model_parallel_size=mpu.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=mpu.get_pipeline_model_parallel_world_size(),
        virtual_pipeline_model_parallel_size=mpu.get_virtual_pipeline_model_parallel_world_size(),
        expert_model_parallel_size=mpu.get_expert_model_parallel_world_size(),
        params_dtype=params_dtype, pipeline_dtype=params_dtype, bf16=params_dtype == torch.bfloat16,
        use_cpu_initialization=True, perform_initialization=False, hidden_dropout=0.0, attention_dropout=0.0,
    )
    if experts:
        fields.update(num_moe_experts=experts, moe_router_topk=hf["num_experts_per_tok"],
                      moe_ffn_hidden_size=hf["moe_intermediate_size"], moe_aux_loss_coeff=0.0,
                      moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="none")
    fields.update(overrides)
    return TransformerConfig(**fields)


def padded_vocab_size(vocab_size: int, divisor: int = 128) -> int:
    """Megatron's padded vocabulary (a multiple of ``divisor`` × the tensor-parallel size)."""
    from megatron.core import parallel_state as mpu

    multiple = divisor * mpu.get_tensor_model_parallel_world_size()
    return -(-vocab_size // multiple) * multiple


def build_gpt_model(hf_config_dir: str | os.PathLike[str], *, params_dtype: torch.dtype = torch.float32,
                    vp_stage: int | None = None, **overrides: Any) -> Any:
    """This rank's ``GPTModel`` (local layer spec) of a Hugging Face architecture, uninitialized."""
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        # megatron-core 0.16.1 leaves the router's optional Transformer Engine GEMM undefined when TE is
        # not installed: a NameError in every MoE forward pass, on any device.
        moe_utils.te_general_gemm = None
    hf = json.loads((Path(hf_config_dir) / "config.json").read_text())
    config = megatron_config(hf_config_dir, params_dtype=params_dtype, **overrides)
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False,
                                    qk_layernorm=config.qk_layernorm, normalization="RMSNorm")
    stage_args: dict[str, Any] = {}
    if vp_stage is not None:
        stage_args["vp_stage"] = vp_stage
    with cpu_support():
        return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=padded_vocab_size(hf["vocab_size"]),
                        max_sequence_length=hf.get("max_position_embeddings", 2048),
                        pre_process=mpu.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage),
                        post_process=mpu.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage),
                        share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)),
                        position_embedding_type="rope", rotary_base=int(hf.get("rope_theta", 10000)),
                        parallel_output=False, **stage_args)


@contextlib.contextmanager
def cpu_support() -> Iterator[None]:
    """Let megatron-core build and run a model on a machine without CUDA (a no-op where CUDA exists):
    rotary embedding asks for ``torch.cuda.current_device()``, dropout regions fork the CUDA RNG tracker,
    a pipeline with tied embeddings moves the last stage's copy with ``Tensor.cuda()``, and saving a
    torch_dist checkpoint calls ``torch.cuda.synchronize()``. Also defines
    the router's ``te_general_gemm`` as absent, which megatron-core 0.16.1 leaves undefined without
    Transformer Engine (a NameError in every MoE forward)."""
    if torch.cuda.is_available():
        yield
        return
    from megatron.core import tensor_parallel
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    tracker = tensor_parallel.get_cuda_rng_tracker()
    saved = torch.cuda.current_device, torch.cuda.synchronize, tracker.fork, torch.Tensor.cuda
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
    tracker.fork = lambda *args, **kwargs: contextlib.nullcontext()  # type: ignore[method-assign]
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.cuda.current_device, torch.cuda.synchronize, tracker.fork, torch.Tensor.cuda = saved  # type: ignore


@torch.no_grad()
def pipeline_logits(model: Any, tokens: torch.Tensor) -> torch.Tensor | None:
    """Logits [batch, seq, padded vocab] of ``tokens`` [batch, seq]: each pipeline stage runs its layers
    and sends the hidden states on (point-to-point, any backend). Returns the logits on the last stage,
    None elsewhere. Call on every rank."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
    if not mpu.is_pipeline_first_stage():
        config = model.config
        hidden = torch.empty(tokens.shape[1], tokens.shape[0], config.hidden_size, dtype=config.params_dtype,
                             device=tokens.device)
        dist.recv(hidden, src=mpu.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(hidden)
    # An explicit causal mask (True: masked): megatron's default one is built on a CUDA device.
    causal = torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool, device=tokens.device).triu(1)
    was_training = model.training
    model.eval()
    try:
        with cpu_support():
            output = model(tokens, positions, attention_mask=causal[None, None])
    finally:
        model.train(was_training)
    if not mpu.is_pipeline_last_stage():
        dist.send(output.contiguous(), dst=mpu.get_pipeline_model_parallel_next_rank())
        return None
    return output
