"""MegatronPublisher on real megatron-core models in real torch.distributed jobs (gloo, spawned processes):
world sizes 1, 2 and 4 with tensor, pipeline and expert parallelism. A tiny Hugging Face model is loaded
into the Megatron model at each layout and published twice (a keyframe, then a delta after a training-like
change): the published tensors equal the Hugging Face tensors bit for bit, and Hugging Face transformers
on the published weights gives the logits of the Megatron model's own forward pass."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from pathlib import Path

import pytest
import torch

from ckptstream import Stream
from ckptstream.cli import main
from ckptstream.testing.models import TinyModelSpec, rl_like_step, tiny_state_dict, write_tiny_model
from tests.helpers import assert_same_tensors, run_ranks

pytest.importorskip("megatron.core")

VOCAB = 500  # not a multiple of Megatron's padding: the published vocabulary must be trimmed
TOKENS = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))


def _init_parallel(rank: int, world_size: int, port: int, layout: dict[str, int]) -> None:
    """The environment torchrun would give this rank, then the same initialization as the recipes."""
    from ckptstream.testing.megatron import initialize_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    initialize_parallel(tp=layout.get("tp", 1), pp=layout.get("pp", 1), vpp=layout.get("vpp"), ep=layout.get("ep", 1),
                        timeout=datetime.timedelta(seconds=120))


def _load_versions(arch_dir: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return load_file(arch_dir / "hf" / "model.safetensors"), load_file(arch_dir / "v1.safetensors")


def _publish_worker(rank: int, world_size: int, port: int, layout: dict[str, int], workdir: str,
                    models: list[str], checkpoint: bool) -> None:
    """One rank: for each model, load version 0, publish, load version 1, publish, run the forward pass
    (not with virtual pipeline chunks), and (``checkpoint``) save a torch_dist checkpoint of version 1.

    The model is fp32 (for an exact forward pass) and published as bf16; with ``layout["bf16"]`` it is
    bf16 as in training, where Megatron keeps layer norms in fp32, and published in config.json's dtype
    by default (no forward pass: tools/check_megatron_logits.py compares bf16 logits on GPUs). With
    ``layout["device_delta"]`` the gathered tensors go to the device encoder (its CPU reference here), as
    they do on GPUs."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from ckptstream.testing.megatron import build_gpt_model, pipeline_logits
    from ckptstream.writer.megatron import MegatronPublisher, load_hf_weights

    _init_parallel(rank, world_size, port, layout)
    for label in models:
        model_dir = Path(workdir) / label
        hf_dir = model_dir / "hf"
        v0, v1 = _load_versions(model_dir)
        params_dtype = torch.bfloat16 if layout.get("bf16") else torch.float32
        if layout.get("vpp"):
            model = [build_gpt_model(hf_dir, params_dtype=params_dtype, vp_stage=chunk)
                     for chunk in range(layout["vpp"])]
        else:
            model = build_gpt_model(hf_dir, params_dtype=params_dtype)
        if layout.get("bf16"):  # as megatron's training loop wraps a bf16 model
            from megatron.core.transformer.module import Float16Module

            model = Float16Module(model.config, model)
        load_hf_weights(model, v0, hf_dir)
        cast = {} if layout.get("bf16") else {"dtype": torch.bfloat16}
        if layout.get("device_delta"):
            cast["device_delta"] = True
        with MegatronPublisher(str(model_dir / "stream"), model, hf_dir, **cast) as publisher:
            publisher.publish(0, step=0)
            load_hf_weights(model, v1, hf_dir)  # the trainer may change weights as soon as publish returns
            publisher.publish(1, step=1).result()
        if not layout.get("vpp") and not layout.get("bf16"):
            logits = pipeline_logits(model, TOKENS)
            if logits is not None and mpu.get_tensor_model_parallel_rank() == 0:
                torch.save(logits[..., :VOCAB].clone(), model_dir / f"logits-rank{rank}.pt")
        if checkpoint:
            _save_torch_dist(model, model_dir / "megatron_ckpt", iteration=1)
    dist.destroy_process_group()


def _save_torch_dist(model, save_dir: Path, iteration: int) -> None:
    """Save as megatron's training loop does: <save_dir>/iter_<7 digits>/ in the torch_dist format, and
    latest_checkpointed_iteration.txt."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    from ckptstream.testing.megatron import cpu_support

    iteration_dir = save_dir / f"iter_{iteration:07d}"
    if dist.get_rank() == 0:
        iteration_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    chunks = model if isinstance(model, list) else [model]
    # One entry per virtual pipeline chunk, as megatron's training loop saves them, beside what else it
    # saves: optimizer moments (under the optimizer's key names), the RNG state, common values.
    state = {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}
    state["optimizer"] = {
        f"{chunk_key}.{key}": dataclasses.replace(value, key=f"optimizer.state.exp_avg.{value.key}",
                                                  data=torch.zeros_like(value.data))
        for chunk_key, chunk_state in state.items() for key, value in chunk_state.items()
        if isinstance(value, ShardedTensor)}
    state["rng_state"] = ShardedObject("rng_state", {"seed": dist.get_rank()}, (dist.get_world_size(),),
                                       (dist.get_rank(),), replica_id=0)
    state["iteration"] = iteration
    with cpu_support():
        dist_checkpointing.save(state, str(iteration_dir))
    if dist.get_rank() == 0:
        (save_dir / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    dist.barrier()


MODELS = {  # label: spec (Llama with tied embeddings, which pipeline parallelism duplicates)
    "qwen2": TinyModelSpec(arch="qwen2", vocab_size=VOCAB),
    "llama": TinyModelSpec(arch="llama", vocab_size=VOCAB, tie_embeddings=True),
    "qwen3": TinyModelSpec(arch="qwen3", vocab_size=VOCAB, kv_channels=64),  # head_dim ≠ hidden / heads
    "qwen3_moe": TinyModelSpec(arch="qwen3_moe", vocab_size=VOCAB),
    "llama-4-layers": TinyModelSpec(arch="llama", vocab_size=VOCAB, tie_embeddings=True, num_layers=4),
}


@pytest.fixture(scope="module")
def hf_versions(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict, dict]]:
    """Per model: a Hugging Face directory (version 0) and the weights of version 1 (an RL-like change of
    version 0)."""
    root = tmp_path_factory.mktemp("megatron-hf")
    models = {}
    for label, spec in MODELS.items():
        v0 = tiny_state_dict(spec)
        v1 = {name: tensor.clone() for name, tensor in v0.items()}
        rl_like_step(v1, generator=torch.Generator().manual_seed(1))
        models[label] = (write_tiny_model(root / label, spec, state=v0), v0, v1)
    return models


def _prepare(workdir: Path, labels: list[str], hf_versions: dict) -> None:
    from safetensors.torch import save_file

    for label in labels:
        hf_dir, _, v1 = hf_versions[label]
        model_dir = workdir / label
        model_dir.mkdir(parents=True)
        (model_dir / "hf").symlink_to(hf_dir)
        save_file(v1, str(model_dir / "v1.safetensors"))


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
    pytest.param({"pp": 2, "vpp": 2}, ["llama-4-layers"], True, id="pp2-vpp2"),
    pytest.param({"tp": 2, "bf16": True, "device_delta": True}, ["qwen2", "qwen3_moe"], False,
                 id="tp2-bf16-params-device-encoder"),
]


@pytest.mark.parametrize("layout,models,checkpoint", LAYOUTS)
def test_publish_matches_hf(layout: dict[str, int], models: list[str], checkpoint: bool, hf_versions: dict,
                            tmp_path: Path) -> None:
    world_size = layout.get("tp", 1) * layout.get("pp", 1) * layout.get("ep", 1)
    _prepare(tmp_path, models, hf_versions)
    codes = run_ranks(_publish_worker, world_size, layout, str(tmp_path), models, checkpoint)
    assert codes == [0] * world_size
    for label in models:
        _, v0, v1 = hf_versions[label]
        model_dir = tmp_path / label
        stream = Stream(str(model_dir / "stream"))
        assert stream.versions() == [0, 1]
        manifest = stream.manifest(1)
        assert manifest.kind == "delta" and manifest.base_version == 0
        assert manifest.metadata["parallel"]["tp"] == layout.get("tp", 1)
        # Every rank wrote its share (dense tensors of data-parallel rank 0 and experts of each EP rank).
        assert len({f.name.split("-")[1] for f in stream.manifest(0).files}) == world_size
        assert_same_tensors(dict(stream.iter_tensors(0)), v0)
        assert_same_tensors(dict(stream.iter_tensors(1)), v1)
        if checkpoint:  # the offline converter gives the live publish's tensors
            converted = model_dir / "converted"
            assert main(["publish", str(converted), "--from-megatron", str(model_dir / "megatron_ckpt"),
                         "--hf-config", str(model_dir / "hf")]) == 0
            offline = Stream(str(converted)).manifest(0)
            assert offline.step == 1  # the checkpoint's iteration
            assert {t.name: t.hash for t in offline.tensors} == {t.name: t.hash for t in manifest.tensors}
        if layout.get("vpp") or layout.get("bf16"):
            continue
        logit_files = list(model_dir.glob("logits-rank*.pt"))
        assert len(logit_files) == layout.get("ep", 1)  # one per data-parallel replica
        stream.materialize(1, model_dir / "materialized")
        expected = _hf_logits(model_dir / "materialized")
        for path in logit_files:
            torch.testing.assert_close(torch.load(path), expected, rtol=0, atol=1e-4)


def _dying_worker(rank: int, world_size: int, port: int, workdir: str, layout: dict[str, int], label: str) -> None:
    """The ranks publish version 0, then the last rank is SIGKILLed after writing its first data file of
    version 1 (the kill is real; the patch only decides when it happens). The others record what they saw."""
    import signal

    from ckptstream.testing.megatron import build_gpt_model
    from ckptstream.writer.files import DataFileWriter
    from ckptstream.writer.megatron import MegatronPublisher, load_hf_weights

    _init_parallel(rank, world_size, port, layout)
    model_dir = Path(workdir) / label
    v0, v1 = _load_versions(model_dir)
    model = build_gpt_model(model_dir / "hf")
    load_hf_weights(model, v0, model_dir / "hf")
    publisher = MegatronPublisher(str(model_dir / "stream"), model, model_dir / "hf",
                                  timeout=datetime.timedelta(seconds=60))
    publisher.publish(0).result()
    if rank == world_size - 1:
        write_data = DataFileWriter.write

        def write_then_die(self, *args, **kwargs):
            result = write_data(self, *args, **kwargs)
            os.kill(os.getpid(), signal.SIGKILL)
            return result

        DataFileWriter.write = write_then_die  # type: ignore[method-assign]
    load_hf_weights(model, v1, model_dir / "hf")
    try:
        publisher.publish(1).result()
        outcome = "committed"
    except Exception as exc:  # noqa: BLE001 - the outcome is what the test checks
        outcome = f"{type(exc).__name__}: {exc}"
    (model_dir / f"rank{rank}.json").write_text(json.dumps({"outcome": outcome}))


def _restarted_worker(rank: int, world_size: int, port: int, workdir: str, layout: dict[str, int],
                      label: str) -> None:
    """The job restarted after the kill: a new process group and publisher publish version 1 again."""
    from ckptstream.testing.megatron import build_gpt_model
    from ckptstream.writer.megatron import MegatronPublisher, load_hf_weights

    _init_parallel(rank, world_size, port, layout)
    model_dir = Path(workdir) / label
    _, v1 = _load_versions(model_dir)
    model = build_gpt_model(model_dir / "hf")
    load_hf_weights(model, v1, model_dir / "hf")
    with MegatronPublisher(str(model_dir / "stream"), model, model_dir / "hf",
                           timeout=datetime.timedelta(seconds=60)) as publisher:
        publisher.publish(1).result()


@pytest.mark.parametrize("layout,label", [({"pp": 2}, "qwen3"), ({"tp": 2, "pp": 2}, "qwen2")],
                         ids=["pp2", "tp2-pp2"])
def test_rank_killed_mid_publish_leaves_no_version(layout: dict[str, int], label: str, hf_versions: dict,
                                                   tmp_path: Path) -> None:
    """One rank SIGKILLed mid-publish: no version becomes visible, every other rank's future raises
    naming the version, the restarted job commits it, and gc removes what the killed attempt left."""
    from ckptstream.writer import collect_garbage

    world_size = layout.get("tp", 1) * layout.get("pp", 1)
    _prepare(tmp_path, [label], hf_versions)
    codes = run_ranks(_dying_worker, world_size, str(tmp_path), layout, label, timeout=240)
    assert codes == [0] * (world_size - 1) + [-9]
    for rank in range(world_size - 1):
        outcome = json.loads((tmp_path / label / f"rank{rank}.json").read_text())["outcome"]
        assert outcome.startswith("PublishError") and "version 1" in outcome, (rank, outcome)
    stream = Stream(str(tmp_path / label / "stream"))
    assert stream.versions() == [0]
    stream.verify(0)  # raises if version 0 was damaged

    assert run_ranks(_restarted_worker, world_size, str(tmp_path), layout, label, timeout=240) == [0] * world_size
    assert stream.versions() == [0, 1]
    assert_same_tensors(dict(stream.iter_tensors(1)), hf_versions[label][2])
    report = collect_garbage(stream, keep_last=5, grace_seconds=0)
    assert report.debris  # the files of the killed attempt at version 1
    assert stream.versions() == [0, 1]
    stream.verify(1)


class _RunsCode:
    """Unpickling this would run a shell command: a malicious checkpoint metadata file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_offline_converter_refuses_bad_checkpoints(hf_versions: dict, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    import pickle
    import shutil

    _prepare(tmp_path, ["qwen2"], hf_versions)
    assert run_ranks(_publish_worker, 1, {}, str(tmp_path), ["qwen2"], True) == [0]
    good = tmp_path / "qwen2" / "megatron_ckpt"
    hf_dir = str(tmp_path / "qwen2" / "hf")

    def convert(checkpoint: Path) -> int:
        return main(["publish", str(tmp_path / f"stream-{checkpoint.name}"), "--from-megatron", str(checkpoint),
                     "--hf-config", hf_dir])

    malicious = tmp_path / "malicious"
    shutil.copytree(good, malicious)
    marker = tmp_path / "code-ran"
    (malicious / "iter_0000001" / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    assert convert(malicious) == 3
    assert not marker.exists()
    assert "posix.system is not part of a checkpoint's metadata" in capsys.readouterr().err

    truncated = tmp_path / "truncated"
    shutil.copytree(good, truncated)
    data_file = sorted((truncated / "iter_0000001").glob("*.distcp"))[0]
    data_file.write_bytes(data_file.read_bytes()[:1000])
    assert convert(truncated) == 3
    error = capsys.readouterr().err
    assert data_file.name in error and "tensor " in error

    bigger = tmp_path / "three-layers"  # config.json describes more layers than the checkpoint holds
    shutil.copytree(tmp_path / "qwen2" / "hf", bigger)
    config = json.loads((bigger / "config.json").read_text())
    (bigger / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    assert main(["publish", str(tmp_path / "stream-bigger"), "--from-megatron", str(good), "--hf-config",
                 str(bigger)]) == 6
    assert "tensor model.layers.2.input_layernorm.weight" in capsys.readouterr().err
    assert Stream(str(tmp_path / "stream-bigger")).versions() == []

    missing = tmp_path / "missing"
    shutil.copytree(good, missing)
    (missing / "latest_checkpointed_iteration.txt").write_text("7")
    assert convert(missing) != 0
    assert "iter_0000007" in capsys.readouterr().err
    assert not (tmp_path / "stream-truncated" / "manifests").exists() or not list(
        (tmp_path / "stream-truncated" / "manifests").iterdir())


def _mismatch_worker(rank: int, world_size: int, port: int, workdir: str) -> None:
    """Pipeline stages build a 2-layer model but name a config.json of 1 layer: only the last stage holds
    an unmappable layer. Each rank records what MegatronPublisher raised."""
    from ckptstream.testing.megatron import build_gpt_model
    from ckptstream.writer.megatron import MegatronPublisher

    _init_parallel(rank, world_size, port, {"pp": 2})
    model = build_gpt_model(Path(workdir) / "qwen3" / "hf")
    try:
        MegatronPublisher(str(Path(workdir) / "stream"), model, Path(workdir) / "one-layer")
        outcome = "constructed"
    except Exception as exc:  # noqa: BLE001 - the outcome is what the test checks
        outcome = f"{type(exc).__name__}: {exc}"
    Path(workdir, f"rank{rank}.json").write_text(json.dumps(outcome))


def test_model_and_config_mismatch_fails_on_every_rank(hf_versions: dict, tmp_path: Path) -> None:
    import shutil

    _prepare(tmp_path, ["qwen3"], hf_versions)
    shutil.copytree(tmp_path / "qwen3" / "hf", tmp_path / "one-layer")
    config = json.loads((tmp_path / "one-layer" / "config.json").read_text())
    (tmp_path / "one-layer" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    assert run_ranks(_mismatch_worker, 2, str(tmp_path), timeout=120) == [0, 0]
    first, last = (json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2))
    assert last.startswith("ConversionError: tensor decoder.layers.1.") and "beyond the 1 layers" in last
    assert first.startswith("PublishError") and "rank 1: ConversionError" in first
