"""Publishing from a live megatron-core model: every rank of the trainer calls ``publish``.

The weights are split over tensor-, pipeline-, expert- and data-parallel ranks under Megatron names.
``MegatronPublisher`` enumerates each rank's parameters under global names, gathers tensor-parallel shards
(in the trainer's own process groups, while the trainer waits), converts them to the Hugging Face tensors
vLLM loads, and hands them to a :class:`DistributedPublisher`: the tensor-parallel ranks of each pipeline
stage (and of each expert-parallel rank, for experts) take turns writing its tensors, every rank in
parallel with the others, and rank 0 commits. On GPUs, the gathered tensors (on the writing rank's GPU)
go to the device encoder (:mod:`ckptstream.writer.device_encode`; ``device_delta=False`` keeps the host
path): ``publish`` then waits for the gathers and the change detection on the GPU only.
megatron-core is imported only when a publisher is built.
"""

from __future__ import annotations

import datetime as _dt
import os
import re
from concurrent.futures import Future
from typing import Any, Iterator, Mapping, Sequence

import torch

from ..errors import ConversionError
from ..format import Manifest
from .config import PublisherConfig
from .distributed import DistributedPublisher
from .megatron_hf import HFArchitecture, check_complete, from_hf, to_hf

_LAYER_PREFIX = re.compile(r"decoder\.layers\.(\d+)\.")
_LOCAL_EXPERT = re.compile(r"(mlp\.experts\.local_experts\.)(\d+)(\.)|(mlp\.experts\.linear_fc[12]\.weight)(\d+)$")
_COLUMN_PARALLEL = re.compile(r"(?:^embedding\.word_embeddings\.weight|^output_layer\.weight"
                              r"|linear_qkv\.(?:weight|bias)"
                              r"|linear_fc1\.(?:weight|bias)\d*)$")
_ROW_PARALLEL = re.compile(r"(?:linear_proj|linear_fc2)\.weight\d*$")
_GATED_FC1 = re.compile(r"(?:^|\.)(?:mlp\.linear_fc1|mlp\.experts\.local_experts\.\d+\.linear_fc1"
                        r"|mlp\.experts\.linear_fc1)"
                        r"\.(?:weight\d*|bias\d*)$")


class MegatronPublisher:
    """Publishes a megatron-core GPT model (Llama, Qwen2, Qwen3, Qwen3-MoE) under Hugging Face names.

    Construct it and call ``publish`` on every rank of the job, at the same points of the program.

    Args:
        url: the stream (local/NFS path or fsspec URL, the same storage on every rank).
        model: the model, or the list of virtual-pipeline chunks of this rank (wrappers such as DDP or
            Float16Module are looked through).
        hf_config_dir: a Hugging Face model directory of the architecture: its ``config.json`` drives the
            name mapping, and its non-weight files (config, tokenizer) become the stream's assets.
        dtype: the dtype to publish. Default: ``torch_dtype`` of config.json, the dtype vLLM serves (Megatron
            keeps some parameters, e.g. layer norms and routers, in fp32 beside bf16 weights), else each
            parameter's own dtype.
        config, timeout, group: as for :class:`DistributedPublisher`.
        **options: fields of :class:`PublisherConfig` (``storage_options``, ``keyframe_every``,
            ``max_in_flight``, ...), replacing ``config``'s; the assets are ``hf_config_dir``'s files.

    Example::

        publisher = MegatronPublisher("s3://bucket/run1", model, "hf/Qwen3-8B", dtype=torch.bfloat16)
        for step in range(steps):
            train_step(model)
            publisher.publish(step, step=step)   # returns after the gather and the snapshot
        publisher.close()
    """

    def __init__(self, url: str, model: Any, hf_config_dir: str | os.PathLike[str], *,
                 dtype: torch.dtype | None = None, config: PublisherConfig | None = None,
                 group: Any = None, timeout: _dt.timedelta = _dt.timedelta(minutes=10), **options: Any):
        from megatron.core import parallel_state

        self._mpu = parallel_state
        self.chunks = _model_chunks(model)
        self.arch = HFArchitecture.from_dir(hf_config_dir)
        self.dtype = dtype if dtype is not None else self.arch.dtype
        self.publisher = DistributedPublisher(url, config, group=group, timeout=timeout, assets=hf_config_dir,
                                              **options)
        try:
            names, failure = self._check_mapping(), None
        except ConversionError as exc:
            names, failure = set(), exc
        try:
            self.publisher.agree(failure)  # every rank raises if any rank's parameters cannot be mapped
            check_complete(set().union(*self.publisher.all_gather(names)), self.arch)
        except BaseException:
            self.publisher.close(create_stream=False)
            raise

    def publish(self, version: int, *, step: int | None = None, metadata: Mapping[str, Any] | None = None,
                keyframe: bool = False) -> Future[Manifest]:
        """Gather and snapshot this rank's weights, then publish ``version`` in the background.

        Blocks for the tensor-parallel gathers and the snapshot only (on GPUs, the device encoder's change
        detection against its copy of the last version; else the copy to host memory). Returns a future that
        resolves to the committed manifest on every rank, or raises on every rank if any rank failed.
        """
        mpu = self._mpu
        layout = {"tp": mpu.get_tensor_model_parallel_world_size(), "pp": mpu.get_pipeline_model_parallel_world_size(),
                  "ep": mpu.get_expert_model_parallel_world_size(), "dp": mpu.get_data_parallel_world_size()}
        return self.publisher.publish(self.iter_hf_tensors(), version, step=step,
                                      metadata={"source": "megatron", "parallel": layout, **(metadata or {})},
                                      keyframe=keyframe)

    @property
    def device_memory_bytes(self) -> int:
        """Device memory this rank's publisher holds (its copy of the tensors it writes)."""
        return self.publisher.device_memory_bytes

    @property
    def pinned_memory_bytes(self) -> int:
        """Pinned host memory of this rank's device encoder."""
        return self.publisher.pinned_memory_bytes

    def wait(self) -> None:
        """Block until every version published so far is committed (on every rank)."""
        self.publisher.wait()

    def close(self) -> None:
        """Wait for pending versions and release the publisher's threads and buffers."""
        self.publisher.close()

    def __enter__(self) -> MegatronPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_mapping(self) -> set[str]:
        """Map every parameter of this rank on shapes alone (meta tensors), before any training step, so
        that a model and config.json that do not fit fail here on every rank rather than in a gather.
        Returns the Hugging Face names this rank's parameters give."""
        mpu = self._mpu
        names = set()
        for name, param in global_parameters(self.chunks, mpu):
            if name == "output_layer.weight" and self.arch.tie_embeddings:
                continue
            shape = list(param.shape)
            dim = partition_dim(name)
            if dim is not None:
                shape[dim] *= _tensor_parallel(mpu, name)[2]
            names.update(n for n, _ in to_hf(name, torch.empty(shape, dtype=param.dtype, device="meta"), self.arch))
        return names

    def iter_hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's share of the Hugging Face tensors, on the parameters' device, gathered one at a time
        (``publish`` snapshots each before the next is gathered). Consume it on every rank in step: the
        gathers are collectives of the trainer's process groups.

        One replica of each tensor is written, by one rank of the tensor-parallel group of data-parallel
        rank 0 (with context parallelism) for dense tensors, of the expert-tensor-parallel group of
        expert-data-parallel rank 0 for experts; the tensors take turns among the group's ranks. Other
        data-parallel replicas skip even the gathers.
        """
        mpu = self._mpu
        dense_replica = mpu.get_data_parallel_rank(with_context_parallel=True) == 0
        expert_replica = mpu.get_expert_data_parallel_rank() == 0
        for index, (name, param) in enumerate(global_parameters(self.chunks, self._mpu)):
            if name == "output_layer.weight" and self.arch.tie_embeddings:
                continue  # the last pipeline stage's copy of the embedding
            if not (expert_replica if _is_expert(name) else dense_replica):
                continue
            group, _, size = _tensor_parallel(mpu, name)
            # Parameters take turns among the group's ranks: each writes (and holds in host memory) 1/size
            # of the stage, and the ranks encode and write in parallel.
            whole = gather_tensor_parallel(name, param.detach(), group, owner=index % size)
            if whole is None:
                continue
            for hf_name, tensor in to_hf(name, whole, self.arch):
                yield hf_name, tensor if self.dtype is None else tensor.to(self.dtype)


def global_parameters(chunks: Sequence[Any], mpu: Any) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """(global name, local parameter) of this rank: layer numbers over all pipeline stages and virtual
    chunks (from each layer's ``layer_number``), expert numbers over all expert-parallel ranks."""
    experts_per_rank = None
    ep_rank = mpu.get_expert_model_parallel_rank()
    for chunk in chunks:
        config = chunk.config
        if getattr(config, "num_moe_experts", None):
            experts_per_rank = config.num_moe_experts // mpu.get_expert_model_parallel_world_size()
        layer_numbers = {index: layer.layer_number - 1 for index, layer in enumerate(chunk.decoder.layers)}
        for name, param in chunk.named_parameters():
            match = _LAYER_PREFIX.match(name)
            if match is not None:
                name = f"decoder.layers.{layer_numbers[int(match.group(1))]}.{name[match.end():]}"
                if experts_per_rank is not None:
                    offset = ep_rank * experts_per_rank
                    name = _LOCAL_EXPERT.sub(lambda m, offset=offset: _global_expert(m, offset), name)
            yield name, param


def _global_expert(match: re.Match[str], offset: int) -> str:
    if match.group(1) is not None:
        return f"{match.group(1)}{int(match.group(2)) + offset}{match.group(3)}"
    return f"{match.group(4)}{int(match.group(5)) + offset}"


def partition_dim(name: str) -> int | None:
    """The dimension Megatron splits a parameter along over tensor-parallel ranks (None: replicated).

    Decided by name: Megatron sets the ``partition_dim`` attribute only when it initializes the weights
    itself (not with ``perform_initialization=False``, the usual setting when loading a checkpoint)."""
    if _COLUMN_PARALLEL.search(name):
        return 0
    if _ROW_PARALLEL.search(name):
        return 1
    return None


def gather_tensor_parallel(name: str, shard: torch.Tensor, group: Any, owner: int = 0) -> torch.Tensor | None:
    """The whole tensor from every tensor-parallel rank's shard, on the group's rank ``owner`` (None on
    the others): a collective over ``group``.

    Column-parallel shards are concatenated along dim 0, row-parallel along dim 1; gated ``linear_fc1``
    shards, each [gate_r; up_r], are regrouped into [gate; up]. Replicated tensors are returned as they are
    on ``owner``, without communication.
    """
    import torch.distributed as dist

    size = dist.get_world_size(group)
    mine = dist.get_rank(group) == owner
    dim = partition_dim(name)
    if size == 1 or dim is None:
        return shard if mine else None
    shards = [torch.empty_like(shard) for _ in range(size)] if mine else None
    dist.gather(shard.contiguous(), shards, dst=dist.get_global_rank(group, owner), group=group)
    if shards is None:
        return None
    if _GATED_FC1.search(name):
        halves = [s.chunk(2, dim=dim) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=dim)
    return torch.cat(shards, dim=dim)


def shard_tensor_parallel(name: str, whole: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This rank's shard of a whole tensor: the inverse of :func:`gather_tensor_parallel`."""
    dim = partition_dim(name)
    if size == 1 or dim is None:
        return whole
    if _GATED_FC1.search(name):
        gate, up = whole.chunk(2, dim=dim)
        return torch.cat([gate.chunk(size, dim=dim)[rank], up.chunk(size, dim=dim)[rank]], dim=dim)
    return whole.chunk(size, dim=dim)[rank]


@torch.no_grad()
def load_hf_weights(model: Any, hf_weights: Mapping[str, torch.Tensor], hf_config_dir: str | os.PathLike[str]) -> None:
    """Initialize this rank's part of a megatron-core model from whole Hugging Face weights (the inverse
    of publishing): for tests, demos and the launch recipe. Padded vocabulary rows are set to zero.
    Call it on every rank; no communication is needed."""
    from megatron.core import parallel_state as mpu

    arch = HFArchitecture.from_dir(hf_config_dir)
    named = list(global_parameters(_model_chunks(model), mpu))
    te_names = any("layer_norm_weight" in n or re.search(r"experts\.linear_fc1\.weight\d+$", n) for n, _ in named)
    wholes = dict(from_hf(dict(hf_weights), arch, te_names=te_names))
    if arch.tie_embeddings:
        wholes["output_layer.weight"] = wholes["embedding.word_embeddings.weight"]
    for name, param in named:
        if name not in wholes:
            raise ConversionError("the Hugging Face weights have no tensor for this Megatron parameter", tensor=name)
        _, rank, size = _tensor_parallel(mpu, name)
        whole = wholes[name]
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):  # vocabulary-parallel
            padded = torch.zeros(param.shape[0] * size, *whole.shape[1:], dtype=whole.dtype)
            padded[:whole.shape[0]] = whole
            whole = padded
        param.copy_(shard_tensor_parallel(name, whole, rank, size))


def _is_expert(name: str) -> bool:
    return ".experts." in name


def _tensor_parallel(mpu: Any, name: str) -> tuple[Any, int, int]:
    """(group, this rank, size) of the tensor-parallel group that splits a parameter: the expert one for
    experts."""
    if _is_expert(name):
        return (mpu.get_expert_tensor_parallel_group(), mpu.get_expert_tensor_parallel_rank(),
                mpu.get_expert_tensor_parallel_world_size())
    return (mpu.get_tensor_model_parallel_group(), mpu.get_tensor_model_parallel_rank(),
            mpu.get_tensor_model_parallel_world_size())


def _model_chunks(model: Any) -> list[Any]:
    """The GPTModel chunks of a model or of a list of virtual-pipeline chunks, wrappers looked through."""
    return [_unwrap(chunk) for chunk in (model if isinstance(model, (list, tuple)) else [model])]


def _unwrap(module: Any) -> Any:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while not hasattr(module, "decoder") and hasattr(module, "module"):
        module = module.module
    if not hasattr(module, "decoder"):
        raise ConversionError(f"{type(module).__name__} is not a megatron-core GPT model (it has no decoder)")
    return module
