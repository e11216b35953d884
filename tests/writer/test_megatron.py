"""MegatronPublisher on real megatron-core models in real torch.distributed jobs (gloo, spawned processes):
world sizes 1, 2 and 4 with tensor, pipeline and expert parallelism. A tiny Hugging Face model is loaded
into the Megatron model at each layout and published twice (a keyframe, then a delta after a training-like
change): the published tensors equal the Hugging Face tensors bit for bit, and Hugging Face transformers
on the published weights gives the logits of the Megatron model's own forward pass."""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

import pytest
import torch

from ckptstream import Stream
from ckptstream.synthetic import TinyModelSpec, rl_like_step, tiny_state_dict, write_tiny_model
from tests.conftest import assert_same_tensors, run_ranks

pytest.importorskip("megatron.core")

VOCAB = 500  # not a multiple of Megatron's padding: the published vocabulary must be trimmed
TOKENS = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))


def _init_parallel(rank: int, world_size: int, port: int, layout: dict[str, int]) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120))
    mpu.initialize_model_parallel(tensor_model_parallel_size=layout.get("tp", 1),
                                  pipeline_model_parallel_size=layout.get("pp", 1),
                                  expert_model_parallel_size=layout.get("ep", 1))


def _load_versions(arch_dir: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return load_file(arch_dir / "hf" / "model.safetensors"), load_file(arch_dir / "v1.safetensors")


def _publish_worker(rank: int, world_size: int, port: int, layout: dict[str, int], workdir: str,
                    archs: list[str], checkpoint: bool) -> None:
    """One rank: for each architecture, load version 0, publish, load version 1, publish, run the
    forward pass, and (``checkpoint``) save a torch_dist checkpoint of version 1."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from ckptstream.synthetic_megatron import build_gpt_model, pipeline_logits
    from ckptstream.writer.megatron import MegatronPublisher, load_hf_weights

    _init_parallel(rank, world_size, port, layout)
    for arch in archs:
        arch_dir = Path(workdir) / arch
        hf_dir = arch_dir / "hf"
        v0, v1 = _load_versions(arch_dir)
        model = build_gpt_model(hf_dir)
        load_hf_weights(model, v0, hf_dir)
        with MegatronPublisher(str(arch_dir / "stream"), model, hf_dir, dtype=torch.bfloat16) as publisher:
            publisher.publish(0, step=0)
            load_hf_weights(model, v1, hf_dir)  # the trainer may change weights as soon as publish returns
            publisher.publish(1, step=1).result()
        logits = pipeline_logits(model, TOKENS)
        if logits is not None and mpu.get_tensor_model_parallel_rank() == 0:
            torch.save(logits[..., :VOCAB].clone(), arch_dir / f"logits-rank{rank}.pt")
        if checkpoint:
            _save_torch_dist(model, arch_dir / "megatron_ckpt", iteration=1)
    dist.destroy_process_group()


def _save_torch_dist(model, save_dir: Path, iteration: int) -> None:
    """Save as megatron's training loop does: <save_dir>/iter_<7 digits>/ in the torch_dist format, and
    latest_checkpointed_iteration.txt."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from ckptstream.synthetic_megatron import cpu_support

    iteration_dir = save_dir / f"iter_{iteration:07d}"
    if dist.get_rank() == 0:
        iteration_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    with cpu_support():
        dist_checkpointing.save(model.sharded_state_dict(), str(iteration_dir))
    if dist.get_rank() == 0:
        (save_dir / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    dist.barrier()


@pytest.fixture(scope="module")
def hf_versions(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict, dict]]:
    """Per architecture: a Hugging Face directory (version 0) and the weights of version 1 (an RL-like
    change of version 0)."""
    root = tmp_path_factory.mktemp("megatron-hf")
    models = {}
    for arch in ("qwen2", "llama", "qwen3", "qwen3_moe"):
        spec = TinyModelSpec(arch=arch, vocab_size=VOCAB, tie_embeddings=arch == "llama", num_layers=2)
        v0 = tiny_state_dict(spec)
        v1 = {name: tensor.clone() for name, tensor in v0.items()}
        rl_like_step(v1, generator=torch.Generator().manual_seed(1))
        models[arch] = (write_tiny_model(root / arch, spec, state=v0), v0, v1)
    return models


def _prepare(workdir: Path, archs: list[str], hf_versions: dict) -> None:
    from safetensors.torch import save_file

    for arch in archs:
        hf_dir, _, v1 = hf_versions[arch]
        arch_dir = workdir / arch
        arch_dir.mkdir(parents=True)
        (arch_dir / "hf").symlink_to(hf_dir)
        save_file(v1, str(arch_dir / "v1.safetensors"))


def _hf_logits(model_dir: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        return model(TOKENS).logits


LAYOUTS = [
    pytest.param({}, ["qwen2", "llama", "qwen3", "qwen3_moe"], False, id="world1"),
    pytest.param({"tp": 2}, ["qwen2", "llama", "qwen3_moe"], False, id="tp2"),
    pytest.param({"pp": 2}, ["qwen3", "llama"], False, id="pp2"),
    pytest.param({"tp": 2, "pp": 2}, ["qwen2", "llama", "qwen3_moe"], True, id="tp2-pp2"),
    pytest.param({"ep": 2}, ["qwen3_moe"], True, id="ep2-dp2"),
]


@pytest.mark.parametrize("layout,archs,checkpoint", LAYOUTS)
def test_publish_matches_hf(layout: dict[str, int], archs: list[str], checkpoint: bool, hf_versions: dict,
                            tmp_path: Path) -> None:
    world_size = layout.get("tp", 1) * layout.get("pp", 1) * layout.get("ep", 1)
    _prepare(tmp_path, archs, hf_versions)
    codes = run_ranks(_publish_worker, world_size, layout, str(tmp_path), archs, checkpoint)
    assert codes == [0] * world_size
    for arch in archs:
        _, v0, v1 = hf_versions[arch]
        stream = Stream(str(tmp_path / arch / "stream"))
        assert stream.versions() == [0, 1]
        manifest = stream.manifest(1)
        assert manifest.kind == "delta" and manifest.base_version == 0
        assert manifest.metadata["parallel"]["tp"] == layout.get("tp", 1)
        assert_same_tensors(dict(stream.iter_tensors(0)), v0)
        assert_same_tensors(dict(stream.iter_tensors(1)), v1)
        logit_files = list((tmp_path / arch).glob("logits-rank*.pt"))
        assert len(logit_files) == 1 + (layout.get("ep", 1) - 1)  # one per data-parallel replica
        stream.materialize(1, tmp_path / arch / "materialized")
        expected = _hf_logits(tmp_path / arch / "materialized")
        for path in logit_files:
            torch.testing.assert_close(torch.load(path), expected, rtol=0, atol=1e-4)
