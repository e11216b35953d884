"""The in-place apply on a model whose loaders fill fused parameters slice by slice (``FusedModel``: fused qkv,
MoE experts in ``w13``/``w2``, a tied embedding), against a full ``load_weights`` of the same version: every
runtime parameter equal bit for bit. The planner traces all tensors in one ``load_weights`` call; its plans must
equal those of one call per tensor, and a tensor whose loader misbehaves must be found alone."""

from __future__ import annotations

import contextlib
import json
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ckptstream.codec import bit_pattern
from ckptstream.format import MARKER_FILE
from ckptstream.testing.fused_model import FusedModel, FusedSpec, fused_checkpoint
from ckptstream.testing.models import rl_like_step
from ckptstream.vllm_loader.inplace.apply import InPlaceApplier
from ckptstream.vllm_loader.inplace.trace import plan_tensor, plan_tensors
from ckptstream.vllm_loader.inplace.checks import staging_problem
from ckptstream.vllm_loader.inplace.change import write_change

SPEC = FusedSpec(layers=3, experts=8)


def _loaded(state: dict[str, torch.Tensor]) -> FusedModel:
    model = FusedModel(SPEC)
    with torch.no_grad():
        model.load_weights(state.items())
    return model


def _change(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], out: Path) -> Path:
    total = sum(t.numel() for t in new.values())
    summary = write_change(((n, old[n], new[n]) for n in new), out, total=total, max_fraction=1.0,
                           stream_id="s", base=0, version=1)
    assert summary.problem is None and summary.changed
    return out


def _change_from_deltas(tmp_path: Path, states: list[dict[str, torch.Tensor]]) -> Path:
    """``states`` published as a keyframe and deltas (with change checks), and the change from the first to the last
    from the deltas alone (``xor-1``; across several, ``xor-steps-1``)."""
    from ckptstream import Publisher, Stream
    from ckptstream.vllm_loader.inplace.change import build_change_unbased

    with Publisher(str(tmp_path / "stream"), keyframe_every=10) as publisher:
        for state in states:
            publisher.publish(state).result()
    change = tmp_path / "change.safetensors"
    assert build_change_unbased(Stream(str(tmp_path / "stream")), change, base=0, version=len(states) - 1,
                                max_fraction=1.0).problem is None
    return change


def _next_version(base: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """``base`` after an RL-like step (5 % of the elements, a few ulps), its head tied to its embedding again."""
    new = {n: t.clone() for n, t in base.items()}
    rl_like_step(new, fraction=0.05, max_ulps=3, generator=torch.Generator().manual_seed(seed))
    new["lm_head.weight"] = new["model.embed_tokens.weight"]
    return new


def _served_directory(tmp_path: Path, state: dict[str, torch.Tensor]) -> Path:
    """``state`` saved as the served checkpoint directory (the tied head left out, as a checkpoint does)."""
    from safetensors.torch import save_file

    served = tmp_path / "served"
    served.mkdir()
    save_file({n: t.contiguous() for n, t in state.items() if n != "lm_head.weight"}, str(served / "model.safetensors"))
    return served


def _same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> list[str]:
    """The names of the parameters that differ bitwise."""
    theirs = dict(b.named_parameters())
    return [n for n, p in a.named_parameters() if not torch.equal(bit_pattern(p), bit_pattern(theirs[n]))]


def _stage_and_apply(model: FusedModel, change: Path) -> dict:
    applier = InPlaceApplier(model, torch.device("cpu"))
    applier.stage(str(change))
    staged = applier.staged(wait=True)
    assert staged is not None and not staged.get("error"), staged
    assert staging_problem([staged]) is None
    return applier.apply()


def test_batched_plans_equal_one_plan_per_tensor():
    state = fused_checkpoint(SPEC)
    model = _loaded(state)
    specs = {name: (tuple(t.shape), t.dtype) for name, t in state.items()}
    batched = plan_tensors(model, specs)
    assert batched == {name: plan_tensor(model, name, *spec) for name, spec in specs.items()}
    assert batched["lm_head.weight"].targets == [] and batched["lm_head.weight"].problem is None  # tied: skipped
    expert = batched["model.layers.1.mlp.experts.5.up_proj.weight"].targets
    assert [t.param for t in expert] == ["layers.1.w13"]


def test_a_change_to_every_expert_equals_a_full_load(tmp_path):
    base = fused_checkpoint(SPEC)
    new = _next_version(base, 1)
    model = _loaded(base)
    answer = _stage_and_apply(model, _change(base, new, tmp_path / "change.safetensors"))
    assert answer.get("applied"), answer
    assert _same_parameters(model, _loaded(new)) == []


def test_loaders_traced_before_the_first_change_leave_it_nothing_to_trace(tmp_path, monkeypatch):
    """``prepare`` plans every tensor of the served directory in the background; the first change then stages
    on those plans (no trace of its own) and equals a full load."""
    from ckptstream.vllm_loader.inplace import apply

    base = fused_checkpoint(SPEC)
    new = _next_version(base, 2)
    served = _served_directory(tmp_path, base)
    model = _loaded(base)
    applier = InPlaceApplier(model, torch.device("cpu"))
    traced: list[int] = []
    real_plan = apply.plan_tensors
    monkeypatch.setattr(apply, "plan_tensors",
                        lambda m, specs, *rest: traced.append(len(specs)) or real_plan(m, specs, *rest))
    applier.prepare(str(served))
    applier.stage(str(_change(base, new, tmp_path / "change.safetensors")))
    staged = applier.staged(wait=True)
    assert staged is not None and not staged.get("error") and staging_problem([staged]) is None, staged
    assert traced[0] == len(base) - 1 and sum(traced[1:]) <= 1  # (lm_head: tied, not in the directory)
    assert applier.apply().get("applied")
    assert _same_parameters(model, _loaded(new)) == []


def test_once_traced_a_worker_stages_and_drops_a_change_of_nothing_in_each_layout(tmp_path, monkeypatch, caplog):
    """After its trace, ``prepare`` stages a change of one element of the smallest tensor that changes nothing,
    from the deltas alone and with old values, and drops both: what a first staging pays once (on a GPU the kernels
    loaded at their first launch, the pinned buffers) is paid then, and the parameters are the served ones still;
    the staging of a real change after it is its own, and applies."""
    from ckptstream.vllm_loader.inplace import change as change_module

    base = fused_checkpoint(SPEC)
    new = _next_version(base, 4)
    served = _served_directory(tmp_path, base)
    model = _loaded(base)
    staged_files: list[tuple[str, list]] = []  # (layout, entries) of every change file read

    def load_change(handle):
        loaded = real_load(handle)
        staged_files.append(((handle.metadata() or {}).get("layout"), [(e.name, e.count) for e in loaded.entries]))
        return loaded

    real_load = change_module.load_change
    monkeypatch.setattr(change_module, "load_change", load_change)
    applier = InPlaceApplier(model, torch.device("cpu"))
    applier.prepare(str(served))
    applier._planning.join()
    smallest = min((n for n in base if n != "lm_head.weight"), key=lambda n: base[n].numel())
    assert staged_files == [("xor-1", [(smallest, 1)]), ("packed-1", [(smallest, 1)])]
    assert "warming the staging up" not in caplog.text  # (both mapped to the end)
    assert _same_parameters(model, _loaded(base)) == []
    applier.stage(str(_change(base, new, tmp_path / "change.safetensors")))
    staged = applier.staged(wait=True)
    assert staged is not None and not staged.get("error") and staging_problem([staged]) is None, staged
    assert applier.apply().get("applied")
    assert _same_parameters(model, _loaded(new)) == []


def test_tracing_and_staging_hand_the_interpreter_back_quickly_and_restore_its_interval(tmp_path, monkeypatch):
    """Beside the engine's thread, the background trace and the staging run with the short switch interval
    (``beside_engine``); once both are over, the interpreter's own is back."""
    import sys

    from ckptstream.vllm_loader.inplace import apply
    from ckptstream.vllm_loader.inplace.beside_engine import BESIDE_ENGINE_SWITCH_INTERVAL_S

    base = fused_checkpoint(SPEC)
    new = {n: t.clone() for n, t in base.items()}
    rl_like_step(new, fraction=0.05, max_ulps=3, generator=torch.Generator().manual_seed(3))
    served = _served_directory(tmp_path, base)
    applier = InPlaceApplier(_loaded(base), torch.device("cpu"))
    intervals: list[float] = []
    real_plan = apply.plan_tensors
    monkeypatch.setattr(apply, "plan_tensors",
                        lambda m, specs, *rest: intervals.append(sys.getswitchinterval()) or real_plan(m, specs, *rest))
    outside = sys.getswitchinterval()
    assert outside > BESIDE_ENGINE_SWITCH_INTERVAL_S
    applier.prepare(str(served))
    applier._planning.join()
    applier.plans.pop("model.layers.0.mlp.experts.0.up_proj.weight")  # (the staging traces it again)
    applier.stage(str(_change(base, new, tmp_path / "change.safetensors")))
    assert applier.staged(wait=True).get("error") is None
    assert len(intervals) >= 2 and intervals == pytest.approx([BESIDE_ENGINE_SWITCH_INTERVAL_S] * len(intervals))
    assert sys.getswitchinterval() == pytest.approx(outside)


def test_overlapping_works_beside_the_engine_restore_the_interval_once_the_last_ends():
    import sys

    from ckptstream.vllm_loader.inplace.beside_engine import BESIDE_ENGINE_SWITCH_INTERVAL_S, beside_engine

    outside = sys.getswitchinterval()
    first_in, second_out = threading.Event(), threading.Event()
    seen: list[float] = []

    def first() -> None:
        with beside_engine():
            first_in.set()
            second_out.wait(timeout=60)
            seen.append(sys.getswitchinterval())  # the second ended first: still short

    thread = threading.Thread(target=first)
    thread.start()
    assert first_in.wait(timeout=60)
    with beside_engine():
        assert sys.getswitchinterval() == pytest.approx(BESIDE_ENGINE_SWITCH_INTERVAL_S)
    second_out.set()
    thread.join()
    assert seen == pytest.approx([BESIDE_ENGINE_SWITCH_INTERVAL_S])
    assert sys.getswitchinterval() == pytest.approx(outside)
    sys.setswitchinterval(BESIDE_ENGINE_SWITCH_INTERVAL_S / 2)  # shorter already: kept
    shorter = sys.getswitchinterval()
    try:
        with beside_engine():
            assert sys.getswitchinterval() == shorter
        assert sys.getswitchinterval() == shorter
    finally:
        sys.setswitchinterval(outside)


def test_a_full_reload_stops_the_background_trace_and_a_staging(tmp_path, monkeypatch):
    """vLLM's layerwise reload swaps the parameters whose loaders a trace calls: run beside ``prepare``'s, a reload
    failed in CI (``'Parameter' object has no attribute 'weight_loader'``). The worker's reload stops the trace
    after its current batch, and a staging at its next step, and waits for them; the next ``prepare`` goes on where
    it stopped, the next staging goes through.
    (The reload here stands for vLLM's and records what ran beside it; the trace and the staging are the real ones,
    each held until a reload comes or 2 s pass: without the wait, the reload runs while they are held.)"""
    from ckptstream.vllm_loader.inplace import apply, change
    from ckptstream.vllm_loader.worker import WorkerExtension

    base = fused_checkpoint(SPEC)
    served = _served_directory(tmp_path, base)
    model = _loaded(base)
    applier = InPlaceApplier(model, torch.device("cpu"))
    held, reloading, done = threading.Event(), threading.Event(), threading.Event()
    batches: list[int] = []

    def holding(real):
        def call(*args):
            held.set()
            reloading.wait(timeout=2)
            answer = real(*args)
            done.set()
            return answer
        return call

    reloads: list[bool] = []

    def reload_weights(**_: object) -> None:
        reloads.append(done.is_set())
        reloading.set()

    worker = SimpleNamespace(_ckptstream_in_place=applier, model_runner=None, reload_weights=reload_weights)
    monkeypatch.setattr(apply, "PREPARE_BATCH", 8)
    real_plan = apply.plan_tensors
    monkeypatch.setattr(apply, "plan_tensors", holding(lambda m, specs, *rest: batches.append(len(specs)) or
                                                       real_plan(m, specs, *rest)))
    applier.prepare(str(served))
    assert held.wait(timeout=60)
    WorkerExtension.ckptstream_reload_weights(worker, str(served))
    assert reloads == [True] and batches == [8] and len(applier.plans) == 8  # stopped after its first batch
    monkeypatch.setattr(apply, "plan_tensors", real_plan)
    applier.prepare(str(served))  # (asked again after the reload: it goes on)
    applier._planning.join()  # (the trace's thread: quiesce would stop it)
    assert len(applier.plans) == len(base) - 1

    new = {n: t.clone() for n, t in base.items()}
    rl_like_step(new, fraction=0.05, max_ulps=3, generator=torch.Generator().manual_seed(4))
    for event in (held, reloading, done):
        event.clear()
    real_load = change.load_change
    monkeypatch.setattr(change, "load_change", holding(real_load))
    applier.stage(str(_change(base, new, tmp_path / "change.safetensors")))
    assert held.wait(timeout=60)
    WorkerExtension.ckptstream_reload_weights(worker, str(served))
    assert reloads == [True, True]  # the staging had read its change when the reload began,
    assert "staging stopped" in applier.staged(wait=True)["error"]  # and stopped there: not staged whole
    monkeypatch.setattr(change, "load_change", real_load)
    applier.stage(str(tmp_path / "change.safetensors"))  # (the next staging goes through)
    assert "error" not in applier.staged(wait=True) and applier.apply().get("applied")
    assert _same_parameters(model, _loaded(new)) == []


def test_an_old_value_that_differs_writes_nothing(tmp_path):
    base = fused_checkpoint(SPEC)
    new = {n: t.clone() for n, t in base.items()}
    rl_like_step(new, fraction=0.05, max_ulps=3, generator=torch.Generator().manual_seed(2))
    model = _loaded(base)
    before = {n: p.clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        model.layers[2].w2.view(-1).view(torch.int16).add_(1)  # the server is not on the base version here
        before["layers.2.w2"] = model.layers[2].w2.clone()
    answer = _stage_and_apply(model, _change(base, new, tmp_path / "change.safetensors"))
    assert "layers.2.w2" in answer["error"] and "nothing written" in answer["error"]
    assert all(torch.equal(bit_pattern(p), bit_pattern(before[n])) for n, p in model.named_parameters())


def test_a_reverted_apply_leaves_the_base_version_bit_for_bit(tmp_path):
    """An apply that another rank refused is written back (``--cache-versions 0``: no cached copy to reload)."""
    base = fused_checkpoint(SPEC)
    new = _next_version(base, 3)
    model = _loaded(base)
    applier = InPlaceApplier(model, torch.device("cpu"))
    applier.stage(str(_change(base, new, tmp_path / "change.safetensors")))
    assert applier.apply().get("applied") and _same_parameters(model, _loaded(new)) == []
    assert applier.revert()["reverted"] > 0
    assert _same_parameters(model, _loaded(base)) == []
    assert applier.revert() == {"reverted": 0}  # once only


class _OneBadLoader(FusedModel):
    """Copies one tensor through a transform and fails on another: only those two are unpatchable."""

    def load_weights(self, weights):
        passed = []
        for name, weight in weights:
            if name.endswith("layers.1.input_layernorm.weight"):
                self.layers[1].norm.copy_(weight * 2)
            elif name.endswith("layers.0.mlp.experts.3.down_proj.weight"):
                raise RuntimeError("no loader for this")
            else:
                passed.append((name, weight))
        return super().load_weights(passed)


@pytest.mark.parametrize("batch", [True, False], ids=["batched", "per-tensor"])
def test_a_misbehaving_loader_is_found_alone(batch):
    state = fused_checkpoint(SPEC)
    model = _OneBadLoader(SPEC)
    specs = {name: (tuple(t.shape), t.dtype) for name, t in state.items()}
    plans = plan_tensors(model, specs) if batch else {n: plan_tensor(model, n, *s) for n, s in specs.items()}
    problems = {name: plan.problem for name, plan in plans.items() if plan.problem}
    assert sorted(problems) == ["model.layers.0.mlp.experts.3.down_proj.weight",
                                "model.layers.1.input_layernorm.weight"]
    assert "transformed copy" in problems["model.layers.1.input_layernorm.weight"]
    assert "no loader for this" in problems["model.layers.0.mlp.experts.3.down_proj.weight"]
    assert plans["model.layers.0.mlp.experts.2.down_proj.weight"].targets


class _TensorParallelRank(torch.nn.Module):
    """One of two tensor-parallel ranks of a model whose embedding is split by rows (as vLLM's
    VocabParallelEmbedding) and whose norm is replicated (each rank holds all of it)."""

    def __init__(self, rank: int, vocab: int = 64, hidden: int = 16, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.rank = rank
        self.embed = torch.nn.Parameter(torch.zeros(vocab // 2, hidden, dtype=dtype), requires_grad=False)
        self.norm = torch.nn.Parameter(torch.zeros(hidden, dtype=dtype), requires_grad=False)

    def load_weights(self, weights):
        for name, weight in weights:
            if name == "embed.weight":
                rows = self.embed.shape[0]
                self.embed.copy_(weight[self.rank * rows:(self.rank + 1) * rows])
            else:
                self.norm.copy_(weight)


def _stage(models: list[torch.nn.Module], change: Path) -> tuple[list[InPlaceApplier], list[dict]]:
    appliers = [InPlaceApplier(model, torch.device("cpu")) for model in models]
    for applier in appliers:
        applier.stage(str(change))
    return appliers, [applier.staged(wait=True) for applier in appliers]


def test_ranks_splitting_a_tensor_add_their_checks_up_and_a_skewed_rank_fails_them(tmp_path):
    """A change from the deltas alone (``xor-1``) staged on two TP ranks: each reads the old values of the
    positions it holds from its own parameters and sums the check there; the head adds the split
    embedding's sums and compares each rank's sum of the replicated norm. Right: both apply, each equal to a
    load of the new version. One rank's rows not on the base: ``check_failed`` before anything is written.
    A third rank holding the whole tensor beside the split holds each position twice with them: checked
    twice over; beside one half only: ``unverifiable``."""
    from ckptstream import Publisher, Stream
    from ckptstream.vllm_loader.inplace.change import build_change_unbased

    generator = torch.Generator().manual_seed(4)
    base = {"embed.weight": torch.randn(64, 16, generator=generator).to(torch.bfloat16),
            "norm.weight": torch.randn(16, generator=generator).to(torch.bfloat16)}
    new = {n: t.clone() for n, t in base.items()}
    rl_like_step(new, fraction=0.1, max_ulps=3, generator=generator)
    with Publisher(str(tmp_path / "stream"), keyframe_every=10) as publisher:
        publisher.publish(base).result()
        publisher.publish(new).result()
    change = tmp_path / "change.safetensors"
    assert build_change_unbased(Stream(str(tmp_path / "stream")), change, base=0, version=1,
                                max_fraction=1.0).problem is None

    def ranks(state: dict[str, torch.Tensor]) -> list[_TensorParallelRank]:
        models = [_TensorParallelRank(rank) for rank in (0, 1)]
        with torch.no_grad():
            for model in models:
                model.load_weights(state.items())
        return models

    models = ranks(base)
    appliers, results = _stage(models, change)
    held = [r["checks"]["embed.weight"]["held"]["count"] for r in results]
    assert sum(held) == results[0]["checks"]["embed.weight"]["expected"]["count"] and all(held)
    assert staging_problem(results) is None
    assert all(applier.apply().get("applied") for applier in appliers)
    assert [_same_parameters(a, b) for a, b in zip(models, ranks(new))] == [[], []]

    skewed = ranks(base)
    with torch.no_grad():
        skewed[1].embed.view(torch.int16).add_(1)  # rank 1's rows are not the delta's base
    before = [{n: p.clone() for n, p in m.named_parameters()} for m in skewed]
    appliers, results = _stage(skewed, change)
    reason, detail = staging_problem(results)
    assert reason == "check_failed" and "embed.weight" in detail
    for applier in appliers:
        applier.discard()
    assert all(torch.equal(bit_pattern(p), bit_pattern(before[i][n]))
               for i, m in enumerate(skewed) for n, p in m.named_parameters())

    whole_rank = _TensorParallelRank(0, vocab=128)  # holds every row of the embedding
    with torch.no_grad():
        whole_rank.load_weights(base.items())
    _, results = _stage([*ranks(base), whole_rank], change)
    assert staging_problem(results) is None
    _, results = _stage([ranks(base)[0], whole_rank], change)
    assert staging_problem(results)[0] == "unverifiable"


class _TiedRank(_TensorParallelRank):
    """A rank holding the whole embedding and a head loaded from it too (a tied head kept as its own parameter)."""

    def __init__(self):
        super().__init__(0, vocab=128)
        self.head = torch.nn.Parameter(torch.zeros_like(self.embed), requires_grad=False)

    def load_weights(self, weights):
        for name, weight in weights:
            if name == "norm.weight":
                self.norm.copy_(weight)
            else:
                self.embed.copy_(weight)
                self.head.copy_(weight)


def test_a_tensor_loaded_into_two_parameters_is_checked_once_per_position(tmp_path):
    """A change from the deltas alone whose tensor one rank copies twice: both copies are read and written, each
    position's check is summed once over the tensor (``positions``) and twice where held."""
    stream, (base, new) = _published(tmp_path, seed=4)
    change = tmp_path / "change.safetensors"
    from ckptstream import Stream
    from ckptstream.vllm_loader.inplace.change import build_change_unbased

    assert build_change_unbased(Stream(stream), change, base=0, version=1, max_fraction=1.0).problem is None

    def tied(state: dict[str, torch.Tensor]) -> _TiedRank:
        model = _TiedRank()
        with torch.no_grad():
            model.load_weights(state.items())
        return model

    model = tied(base)
    appliers, results = _stage([model], change)
    checks = results[0]["checks"]["embed.weight"]
    assert checks["held"]["count"] == 2 * checks["expected"]["count"]
    assert staging_problem(results) is None
    assert appliers[0].apply().get("applied")
    assert _same_parameters(model, tied(new)) == []


def _published(tmp_path: Path, seed: int, steps: int = 1,
               fraction: float = 0.1) -> tuple[str, list[dict[str, torch.Tensor]]]:
    """A stream of bf16 versions of ``_TensorParallelRank``'s checkpoint, each after the first a delta on the
    one before (with change checks, ``fraction`` of the elements changed): (its path, the versions' tensors)."""
    from ckptstream import Publisher

    generator = torch.Generator().manual_seed(seed)
    states = [{"embed.weight": torch.randn(64, 16, generator=generator).to(torch.bfloat16),
               "norm.weight": torch.randn(16, generator=generator).to(torch.bfloat16)}]
    for _ in range(steps):
        states.append({n: t.clone() for n, t in states[-1].items()})
        rl_like_step(states[-1], fraction=fraction, max_ulps=3, generator=generator)
    with Publisher(str(tmp_path / "stream"), keyframe_every=10) as publisher:
        for state in states:
            publisher.publish(state).result()
    return str(tmp_path / "stream"), states


def _tp_ranks(state: dict[str, torch.Tensor], dtype: torch.dtype) -> list[_TensorParallelRank]:
    models = [_TensorParallelRank(rank, dtype=dtype) for rank in (0, 1)]
    with torch.no_grad():
        for model in models:
            model.load_weights(state.items())
    return models


@pytest.mark.parametrize("served", [torch.float16, torch.float32])
def test_a_server_rounding_the_checkpoints_values_cannot_check_a_change_from_the_deltas_alone(tmp_path, served):
    """A bf16 stream served as fp16 (``--dtype float16``): the ranks' runtime values are rounded, so the
    checkpoint's old bits that a change from the deltas alone (``xor-1``) needs are not there. That is
    ``unverifiable`` (the follower then stages the change with old values, ``packed-1``, which applies),
    never ``check_failed`` (a forged delta or a server off the base). Served as fp32 (wider): checked."""
    from ckptstream import Stream
    from ckptstream.vllm_loader.inplace.change import build_change_from_deltas, build_change_unbased

    url, (base, new) = _published(tmp_path, seed=5)
    unbased, packed = tmp_path / "xor.safetensors", tmp_path / "packed.safetensors"
    assert build_change_unbased(Stream(url), unbased, base=0, version=1, max_fraction=1.0).problem is None
    base_dir = Path(Stream(url).materialize(0, tmp_path / "v0"))
    assert build_change_from_deltas(Stream(url), base_dir, packed, base=0, version=1,
                                    max_fraction=1.0).problem is None

    appliers, results = _stage(_tp_ranks(base, served), unbased)
    problem = staging_problem(results)
    if served == torch.float32:
        assert problem is None
    else:
        assert problem is not None and problem[0] == "unverifiable" and "float16" in problem[1], problem
    for applier in appliers:
        applier.discard()
    models = _tp_ranks(base, served)
    appliers, results = _stage(models, packed)
    assert staging_problem(results) is None
    assert all(applier.apply().get("applied") for applier in appliers)
    assert [_same_parameters(a, b) for a, b in zip(models, _tp_ranks(new, served))] == [[], []]


def test_ranks_that_read_different_changes_fail_the_check(tmp_path):
    """Ranks on different nodes read the change from their own node's cache: a stale or foreign file on one
    node shows as another expected check (or positions) of a tensor; never does one rank's word win."""
    from ckptstream import Stream
    from ckptstream.vllm_loader.inplace.change import build_change_unbased

    url, (base, _) = _published(tmp_path, seed=6)
    change = tmp_path / "change.safetensors"
    assert build_change_unbased(Stream(url), change, base=0, version=1, max_fraction=1.0).problem is None
    _, results = _stage(_tp_ranks(base, torch.bfloat16), change)
    assert staging_problem(results) is None
    for field, other in (("expected", {**results[1]["checks"]["embed.weight"]["expected"], "old": "0" * 16}),
                         ("positions", "0" * 16)):
        for order in (results, results[::-1]):
            forged = [order[0], {**order[1], "checks": {**order[1]["checks"], "embed.weight": {
                **order[1]["checks"]["embed.weight"], field: other}}}]
            problem = staging_problem(forged)
            assert problem is not None and problem[0] == "check_failed" and "different" in problem[1], (field,
                                                                                                       problem)


def test_a_change_across_three_deltas_equals_a_full_load_and_a_forged_step_fails_its_check(tmp_path):
    """A change from the deltas alone across three deltas (``xor-steps-1``) on fused parameters: the worker
    gathers the old values once, applies the steps in order in memory and reports each step's check
    (``name@version``); applied, every parameter equals a load of the last version. One step's XOR forged in
    the file: ``check_failed`` for that step, and nothing written."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(7)
    states = [fused_checkpoint(SPEC)]
    for _ in range(3):
        states.append({n: t.clone() for n, t in states[-1].items()})
        rl_like_step(states[-1], fraction=0.05, max_ulps=3, generator=generator)
        states[-1]["lm_head.weight"] = states[-1]["model.embed_tokens.weight"]
    change = _change_from_deltas(tmp_path, states)
    model = _loaded(states[0])
    applier = InPlaceApplier(model, torch.device("cpu"))
    applier.stage(str(change))
    staged = applier.staged(wait=True)
    assert {key.rpartition("@")[2] for key in staged["checks"]} == {"1", "2", "3"}, staged.get("error")
    assert staging_problem([staged]) is None
    assert applier.apply().get("applied") and _same_parameters(model, _loaded(states[3])) == []

    with safe_open(str(change), framework="pt") as handle:
        metadata, tensors = handle.metadata(), {k: handle.get_tensor(k) for k in handle.keys()}
    entries = json.loads(metadata["tensors"])
    at = next(i for i, e in enumerate(entries)  # a tensor loaded (not the tied lm_head) of step 1 -> 2
              if e[5] == 1 and e[2] == "bfloat16" and e[0].startswith("model.layers."))
    offset = sum(e[3] for e in entries[:at] if e[2] == "bfloat16")
    tensors["xor.bfloat16"].view(torch.int16)[offset] ^= 0x10
    save_file(tensors, str(change), metadata=metadata)
    model = _loaded(states[0])
    before = {n: p.clone() for n, p in model.named_parameters()}
    applier = InPlaceApplier(model, torch.device("cpu"))
    applier.stage(str(change))
    problem = staging_problem([applier.staged(wait=True)])
    assert problem is not None and problem[0] == "check_failed" and f"{entries[at][0]}@2" in problem[1], problem
    applier.discard()
    assert all(torch.equal(bit_pattern(p), bit_pattern(before[n])) for n, p in model.named_parameters())


def test_ranks_splitting_a_tensor_add_their_checks_up_per_step(tmp_path):
    """Two TP ranks staging a change across three deltas: per step, their counts of the split embedding's
    changed elements add up to the step's check, the replicated norm's are each the whole; applied, each rank
    equals a load of the last version."""
    from ckptstream import Stream
    from ckptstream.vllm_loader.inplace.change import build_change_unbased

    url, states = _published(tmp_path, seed=8, steps=3)
    change = tmp_path / "change.safetensors"
    assert build_change_unbased(Stream(url), change, base=0, version=3, max_fraction=1.0).problem is None
    models = _tp_ranks(states[0], torch.bfloat16)
    appliers, results = _stage(models, change)
    for version in (1, 2, 3):
        held = [r["checks"][f"embed.weight@{version}"]["held"]["count"] for r in results]
        assert sum(held) == results[0]["checks"][f"embed.weight@{version}"]["expected"]["count"] and all(held)
    assert staging_problem(results) is None
    assert all(applier.apply().get("applied") for applier in appliers)
    assert [_same_parameters(a, b) for a, b in zip(models, _tp_ranks(states[3], torch.bfloat16))] == [[], []]


class _Ranks:
    """The staging side of a server (``VllmControl``) whose ranks are ``models``, in this process."""

    def __init__(self, models: list[torch.nn.Module]):
        self.url = "http://ranks:1"
        self.appliers = [InPlaceApplier(model, torch.device("cpu")) for model in models]
        self.staged: list[str] = []  # the change files staged, by name

    def stage_change(self, path: str) -> list[dict]:
        self.staged.append(Path(path).name)
        return _stage_all(self.appliers, path)

    def discard_change(self) -> None:
        for applier in self.appliers:
            applier.discard()

    def prepare_in_place(self, path: str) -> list[dict] | None:
        """As a server without ckptstream's prepare call answers (an older extension): the first change finds out
        which tensors its ranks round."""
        return None


def _stage_all(appliers: list[InPlaceApplier], path: str) -> list[dict]:
    for applier in appliers:
        applier.stage(path)
    return [applier.staged(wait=True) for applier in appliers]


def _layout(change: Path) -> str | None:
    from safetensors import safe_open

    with safe_open(str(change), framework="pt") as handle:
        return (handle.metadata() or {}).get("layout")


def test_a_follower_stages_the_change_with_old_values_where_its_ranks_cannot_check_one(tmp_path, monkeypatch, caplog):
    """A server rounding the checkpoint's values (bf16 served as fp16) cannot check a change from the deltas
    alone: the follower builds the change with old values from its cached copy of the served version, stages
    that (applied: equal to a load of the version), and from then on builds only that one (the deltas read
    once per update); so on ranks holding a tensor's positions unevenly (kv heads replicated, q heads split),
    never reusing a change with old values of other versions. With no cached copy (``--cache-versions 0``) or
    on an engine spanning nodes (the other nodes have no such change): a full reload, ``unverifiable``, and
    from then on no change built nor staged, said once."""
    from ckptstream import Stream
    from ckptstream.vllm_loader.follow import in_place
    from ckptstream.vllm_loader.follow.cache import VersionCache
    from ckptstream.vllm_loader.follow.config import FollowerConfig
    from ckptstream.vllm_loader.follow.in_place import InPlaceUpdates
    from ckptstream.vllm_loader.inplace.change import build_change_unbased

    from ckptstream.vllm_loader.inplace import change as change_module

    builds: list[str] = []  # the changes built from the deltas, by layout
    # (the change from the deltas alone, built through build_change_from_stored; packed-1 where the follower builds
    # it directly: with_old_values' own build is counted as "packed-1 beside" below)
    for module, name, layout in ((change_module, "build_change_unbased", "xor-1"),
                                 (in_place, "build_change_from_deltas", "packed-1")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _layout=layout, **k: (builds.append(_layout),
                                                                                       _real(*a, **k))[1])

    def with_old_values(stream, base_dir, change):
        packed = real_with_old_values(stream, base_dir, change)
        builds.extend([] if packed in (None, change) else ["packed-1 beside"])
        return packed

    real_with_old_values = in_place.with_old_values
    monkeypatch.setattr(in_place, "with_old_values", with_old_values)
    url, states = _published(tmp_path, seed=7, steps=2, fraction=0.02)  # (in place: at most 5 %)
    stream = Stream(url)
    models = _tp_ranks(states[0], torch.float16)
    ranks = _Ranks(models)
    with VersionCache(tmp_path / "cache", stream.info().stream_id, "t") as cache:
        cache.acquire(stream, 0, keep=set(), holder="t")
        updates = InPlaceUpdates(FollowerConfig(), stream, cache, [ranks])
        staged_names = []
        for version in (1, 2):
            builds.clear()
            change, why_not = updates.change(version, None, version - 1)
            assert change is not None and why_not is None
            staged, reason = updates.stage(ranks, change)
            assert reason is None and staged is not None and _layout(staged) == "packed-1"
            staged_names.append([change.name, staged.name] if version == 1 else [staged.name])
            (tmp_path / f"{version}.packed-1").write_bytes(staged.read_bytes())
            assert builds == (["xor-1", "packed-1 beside"] if version == 1 else ["packed-1"]), builds
            assert all(applier.apply().get("applied") for applier in ranks.appliers)
            assert [_same_parameters(a, b) for a, b in zip(models, _tp_ranks(states[version], torch.float16))] \
                == [[], []]
            cache.acquire(stream, version, keep={version - 1}, holder="t")
        assert ranks.url in updates.old_values and "float16" in updates.old_values[ranks.url]
        assert ranks.staged == [name for names in staged_names for name in names]  # v2: old values only

        change = tmp_path / "elsewhere" / cache.change_path(1, 2).name  # the change from the deltas alone
        change.parent.mkdir()
        assert build_change_unbased(stream, change, base=1, version=2, max_fraction=1.0).problem is None
        # a change with old values of other versions where this one's would be: rebuilt, not staged
        (change.parent / f"{change.stem}.packed-1.safetensors").write_bytes((tmp_path / "1.packed-1").read_bytes())
        uneven = [_TensorParallelRank(0), _TensorParallelRank(0, vocab=128)]  # rows 0-31 held twice, the rest once
        with torch.no_grad():
            for model in uneven:
                model.load_weights(states[1].items())
        other = _Ranks(uneven)
        staged, reason = InPlaceUpdates(FollowerConfig(), stream, cache, [other]).stage(other, change)
        assert reason is None and other.staged == [change.name, staged.name]  # unverifiable, then old values
        assert all(applier.apply().get("applied") for applier in other.appliers)

        from ckptstream import Publisher

        with Publisher(url, keyframe_every=1) as publisher:  # version 3, a keyframe
            publisher.publish(states[2]).result()
        compared = tmp_path / "compared" / change.name  # a change with old values, as comparing builds it
        compared.parent.mkdir()
        compared.write_bytes((tmp_path / "2.packed-1").read_bytes())
        for config in (FollowerConfig(nodes_ready_timeout=5.0), FollowerConfig(cache_versions=0)):
            if config.cache_versions == 0:
                cache.release(1)
                cache.drop_copies({1})
                assert not (cache.path(1) / MARKER_FILE).is_file()
            other = _Ranks(_tp_ranks(states[1], torch.float16))
            updates = InPlaceUpdates(config, stream, cache, [other])
            caplog.clear()
            staged, reason = updates.stage(other, change)
            assert (staged, reason) == (None, "unverifiable") and other.staged == [change.name]
            builds.clear()
            for _ in range(2):  # the next updates: straight to the full reload, nothing built nor staged
                assert updates.change(2, None, 1) == (None, "unverifiable")
                assert updates.stage(other, change) == (None, "unverifiable")
            assert builds == [] and other.staged == [change.name]
            said = [r.getMessage() for r in caplog.records if "full reload instead of in place" in r.getMessage()]
            assert len(said) == 1 and "unverifiable" in said[0] and "float16" in said[0], said
            # across a keyframe, with the served version cached: both versions compared, and that change staged
            assert updates.change(3, None, 1) == ((None, None) if config.cache_versions else (None, "unverifiable"))
            assert updates.stage(other, compared) == (compared, None)
            assert all(applier.apply().get("applied") for applier in other.appliers)


def test_the_weight_transfer_engine_stages_the_change_with_old_values_where_it_cannot_check_one(tmp_path):
    """The weight-transfer backend (one rank here: vLLM's routes call the same methods on every rank) on a
    model that rounds the checkpoint's values (bf16 served as fp16): each update is applied in place with the
    change with old values, built from the served version's cached copy, never a full reload."""
    from types import SimpleNamespace

    from ckptstream import Stream
    from ckptstream.weight_transfer.engine import (CkptstreamInitInfo, CkptstreamUpdateInfo,
                                                   CkptstreamWeightTransferEngine)

    url, states = _published(tmp_path, seed=8, steps=2, fraction=0.02)
    start = Stream(url).materialize(0, tmp_path / "start")
    model = _TensorParallelRank(0, vocab=128, dtype=torch.float16)  # one rank holding every row
    with torch.no_grad():
        model.load_weights(states[0].items())
    config = SimpleNamespace(parallel_config=None, model_config=SimpleNamespace(model=str(start)))
    engine = CkptstreamWeightTransferEngine(None, config, torch.device("cpu"), model)
    engine.init_transfer_engine(CkptstreamInitInfo(url=url, cache_dir=str(tmp_path / "cache"), prefetch=False))
    try:
        for version in (1, 2):
            engine.receive_weights(CkptstreamUpdateInfo(version=version))
            assert engine.last_update["mode"] == "in_place", engine.last_update
            expected = _TensorParallelRank(0, vocab=128, dtype=torch.float16)
            with torch.no_grad():
                expected.load_weights(states[version].items())
            assert _same_parameters(model, expected) == []
        assert engine._old_values is not None and "float16" in engine._old_values
    finally:
        engine.shutdown()


@pytest.mark.parametrize("layout", ["packed-1", "xor-1", "xor-steps-1"])
def test_a_change_staged_in_chunks_equals_one_staged_at_once(tmp_path, monkeypatch, layout):
    """The staging maps every copy of a dtype at once in chunks of ``STAGING_CHUNK_ELEMENTS``: chunks of a few
    hundred elements, which cut through tensors' runs of copies, parameters and steps, report the same coverage,
    checks and writes as one chunk, and the applied model equals a full load, for every layout of change; so do
    chunks gathered as a GPU gathers them."""
    from ckptstream.vllm_loader.inplace import apply
    from ckptstream.vllm_loader.inplace import change as change_module

    generator = torch.Generator().manual_seed(11)
    states = [fused_checkpoint(SPEC)]
    for _ in range(3 if layout == "xor-steps-1" else 1):
        states.append({n: t.clone() for n, t in states[-1].items()})
        rl_like_step(states[-1], fraction=0.05, max_ulps=3, generator=generator)
        states[-1]["lm_head.weight"] = states[-1]["model.embed_tokens.weight"]
    change = (_change(states[0], states[-1], tmp_path / "change.safetensors") if layout == "packed-1"
              else _change_from_deltas(tmp_path, states))
    assert _layout(change) == layout

    def staged(chunk: int) -> tuple[FusedModel, InPlaceApplier, dict]:
        monkeypatch.setattr(apply, "STAGING_CHUNK_ELEMENTS", chunk)
        model = _loaded(states[0])
        applier = InPlaceApplier(model, torch.device("cpu"))
        applier.stage(str(change))
        result = applier.staged(wait=True)
        assert result is not None and not result.get("error") and staging_problem([result]) is None, result
        result.pop("seconds")
        return model, applier, result

    _, _, at_once = staged(1 << 30)
    model, applier, in_chunks = staged(300)
    assert in_chunks == at_once
    assert applier.apply().get("applied") == at_once["elements"]
    assert _same_parameters(model, _loaded(states[-1])) == []
    # As a GPU gathers each chunk's ranges (from the window that holds them, by an index), here on the CPU: the same.
    monkeypatch.setattr(change_module, "_ranges", _through_windows)
    model, applier, windowed = staged(300)
    assert windowed == at_once
    assert applier.apply().get("applied") == at_once["elements"]
    assert _same_parameters(model, _loaded(states[-1])) == []


def _through_windows(tensors: tuple[torch.Tensor, ...], ranges: list[tuple[int, int]],
                     upload: object = None) -> tuple[torch.Tensor, ...]:
    """``change._ranges`` as a GPU takes them, whatever the device and the window's size: the window that holds
    them, one index."""
    from ckptstream.vllm_loader.inplace.change import _gather_window

    low, high = min(start for start, _ in ranges), max(start + count for start, count in ranges)
    relative = [(start - low, count) for start, count in ranges]
    return _gather_window(tuple(tensor[low:high] for tensor in tensors), relative, sum(c for _, c in ranges))


class _SharedSpans(torch.nn.Module):
    """A model whose loader copies two checkpoint tensors into spans of one parameter that meet: the column halves
    of a fused parameter (``interleaved``: no element written twice), or overlapping ranges (a full load leaves the
    later tensor's values where they meet)."""

    def __init__(self, interleaved: bool):
        super().__init__()
        self.interleaved = interleaved
        self.both = torch.nn.Parameter(torch.zeros(16, 32, dtype=torch.bfloat16), requires_grad=False)
        self.norm = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16), requires_grad=False)

    def load_weights(self, weights):
        flat = self.both.view(-1)
        halves = {"a": self.both[:, :16], "b": self.both[:, 16:]} if self.interleaved else {
            "a": flat[0:256].view(16, 16), "b": flat[128:384].view(16, 16)}
        for name, weight in weights:
            {**halves, "norm": self.norm}[name].copy_(weight)


def _shared_spans_versions() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    states = [{"a": torch.randn(16, 16, generator=generator).to(torch.bfloat16),
               "b": torch.randn(16, 16, generator=generator).to(torch.bfloat16),
               "norm": torch.randn(4, generator=generator).to(torch.bfloat16)}]
    states.append({name: tensor.clone() for name, tensor in states[0].items()})
    rl_like_step(states[1], fraction=0.1, max_ulps=3, generator=generator)
    return states


@pytest.mark.parametrize("layout", ["packed-1", "xor-1"])
def test_tensors_copied_into_column_halves_of_a_parameter_equal_a_full_load(tmp_path, layout):
    """Copies whose spans of storage offsets meet but whose elements interleave (the column halves of a fused
    parameter) are applied by the path that gathers each parameter's old values once and applies the copies in
    order: the patched model equals a full load, for both layouts of change."""
    old, new = _shared_spans_versions()
    change = (_change(old, new, tmp_path / "change.safetensors") if layout == "packed-1"
              else _change_from_deltas(tmp_path, [old, new]))
    assert _layout(change) == layout

    def loaded(state: dict[str, torch.Tensor]) -> _SharedSpans:
        model = _SharedSpans(interleaved=True)
        with torch.no_grad():
            model.load_weights(state.items())
        return model

    model = loaded(old)
    assert not torch.equal(model.both, loaded(new).both)
    assert _stage_and_apply(model, change).get("applied")
    assert _same_parameters(model, loaded(new)) == []


def test_tensors_copied_over_one_another_are_refused_by_their_old_values(tmp_path):
    """Two tensors copied over one another: the parameter holds the later one's values where they meet, so the
    earlier one's old values there are not what it holds, and the apply writes nothing."""
    old, new = _shared_spans_versions()
    model = _SharedSpans(interleaved=False)
    with torch.no_grad():
        model.load_weights(old.items())
    before = {n: p.clone() for n, p in model.named_parameters()}
    applier = InPlaceApplier(model, torch.device("cpu"))
    applier.stage(str(_change(old, new, tmp_path / "change.safetensors")))
    assert staging_problem([applier.staged(wait=True)]) is None
    answer = applier.apply()
    assert "differ from the base version; nothing written" in answer.get("error", ""), answer
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_copies_of_every_layout_mapped_at_once_equal_each_mapped_alone():
    """``map_copies`` maps the copies of norms (1-D), matrices, fused q/k/v and gate/up shards and experts at once
    (fewer dimensions padded, shared numbers kept as numbers): each element lands where ``map_copy`` puts it alone,
    and positions outside a copy's slice are not covered."""
    from ckptstream.vllm_loader.inplace.trace import map_copies, map_copy

    state = fused_checkpoint(SPEC)
    plans = plan_tensors(_loaded(state), {name: (tuple(t.shape), t.dtype) for name, t in state.items()})
    generator = torch.Generator().manual_seed(5)
    copies, positions = [], []
    for name, plan in plans.items():
        for target in plan.targets:
            copies.append(target)
            positions.append(torch.randint(0, state[name].numel(), (50,), generator=generator).sort().values)
    assert {len(target.sizes) for target in copies} == {1, 2}
    copy = torch.arange(len(copies)).repeat_interleave(50)
    covered, index = map_copies(copies, torch.cat(positions), copy)
    for k, (target, at) in enumerate(zip(copies, positions)):
        alone_covered, alone = map_copy(target, at, torch.full_like(at, target.src_offset),
                                        torch.full_like(at, target.dst_offset))
        assert torch.equal(covered[copy == k], alone_covered)
        assert torch.equal(index[copy == k][alone_covered], alone[alone_covered])


class _MixedDtypes(torch.nn.Module):
    """A bf16 parameter loaded from a bf16 checkpoint tensor (rows 0:4) and an fp32 one (rows 4:8)."""

    def __init__(self):
        super().__init__()
        self.p = torch.nn.Parameter(torch.zeros(8, 16, dtype=torch.bfloat16), requires_grad=False)

    def load_weights(self, weights):
        for name, weight in weights:
            (self.p[:4] if name == "a" else self.p[4:]).copy_(weight)


def test_only_the_tensors_a_parameter_rounds_are_unverifiable(tmp_path):
    """A change from the deltas alone whose fp32 tensor lands in a bf16 parameter cannot be checked there
    (``unverifiable``), but the bf16 tensor loaded into the same parameter can: it alone is not named."""
    generator = torch.Generator().manual_seed(0)
    states = [{"a": torch.randn(4, 16, generator=generator).to(torch.bfloat16),
               "b": torch.randn(4, 16, generator=generator)}]
    states.append({name: tensor.clone() for name, tensor in states[0].items()})
    rl_like_step(states[1], fraction=0.3, max_ulps=3, generator=generator)
    change = _change_from_deltas(tmp_path, states)
    model = _MixedDtypes()
    with torch.no_grad():
        model.load_weights(states[0].items())
    applier = InPlaceApplier(model, torch.device("cpu"))
    applier.stage(str(change))
    assert sorted(applier.staged(wait=True)["unverifiable"]) == ["b"]


class _TracedRanks(_Ranks):
    """``_Ranks`` that also answer ``prepare_in_place`` as the worker extension does: at the first call the traces
    have just started (``traced`` False: answered while they wait for the plans, however fast the machine); a later
    call answers once they are done (their threads waited for here)."""

    def __init__(self, models: list[torch.nn.Module]):
        super().__init__(models)
        self.prepared = 0

    def prepare_in_place(self, path: str) -> list[dict]:
        self.prepared += 1
        if self.prepared == 1:
            with contextlib.ExitStack() as held:
                for applier in self.appliers:
                    held.enter_context(applier._plan_lock)
                return [applier.prepare(path) for applier in self.appliers]
        for applier in self.appliers:
            applier.prepare(path)
            if applier._planning is not None:
                applier._planning.join()
        return [applier.prepare(path) for applier in self.appliers]


def test_a_follower_builds_the_change_with_old_values_first_where_a_changed_tensor_is_rounded(tmp_path, caplog):
    """Ranks say, once their loaders are traced, which checkpoint tensors a parameter of theirs rounds (an fp32
    tensor in a bf16 parameter here; FP8 weights of a bf16 stream in a server). Versions that change none of them
    are staged from the deltas alone (``xor-1``, the publisher's checks before the write), across a keyframe too
    (which stores every tensor: not a change of the rounded one); the first that changes one is built with old
    values straight away (``packed-1``) and staged once, not refused first. A server whose traces were not done
    when asked at its start is asked once more at the change."""
    from ckptstream import Publisher, Stream
    from ckptstream.vllm_loader.follow.cache import VersionCache
    from ckptstream.vllm_loader.follow.config import FollowerConfig
    from ckptstream.vllm_loader.follow.in_place import InPlaceUpdates

    generator = torch.Generator().manual_seed(11)
    states = [{"a": torch.randn(4, 16, generator=generator).to(torch.bfloat16),
               "b": torch.randn(4, 16, generator=generator)}]
    # (versions 1 to 3 leave the rounded tensor as it was, version 2 a keyframe; version 4 changes it)
    for changed in (["a"], ["a"], ["a"], ["a", "b"]):
        states.append({name: tensor.clone() for name, tensor in states[-1].items()})
        rl_like_step({name: states[-1][name] for name in changed}, fraction=0.04, max_ulps=3, generator=generator)
    url = str(tmp_path / "stream")
    with Publisher(url, keyframe_every=100) as publisher:
        for version, state in enumerate(states):
            publisher.publish(state, keyframe=version == 2).result()
    stream = Stream(url)
    model = _MixedDtypes()
    with torch.no_grad():
        model.load_weights(states[0].items())
    ranks = _TracedRanks([model])
    with VersionCache(tmp_path / "cache", stream.info().stream_id, "t") as cache:
        cache.acquire(stream, 0, keep=set(), holder="t")
        updates = InPlaceUpdates(FollowerConfig(), stream, cache, [ranks])
        updates.prepare([ranks], cache.path(0))  # (at the start: not traced yet)
        for version, layout in ((1, "xor-1"), (2, "packed-1"), (3, "xor-1"), (4, "packed-1")):
            change, why_not = updates.change(version, None, version - 1)
            if version == 2:  # (a keyframe: no change from the deltas; the comparison of both copies builds it)
                assert (change, why_not) == (None, None)
                cache.acquire(stream, version, keep={version - 1}, holder="t")
                change, why_not = updates.change(version, cache.path(version), version - 1)
            assert why_not is None and change is not None and _layout(change) == layout, (version, why_not)
            assert ranks.url in updates.old_values if version == 4 else ranks.url not in updates.old_values
            staged, reason = updates.stage(ranks, change)
            assert (staged, reason) == (change, None)
            assert ranks.appliers[0].apply().get("applied")
            expected = _MixedDtypes()
            with torch.no_grad():
                expected.load_weights(states[version].items())
            assert _same_parameters(model, expected) == []
            cache.acquire(stream, version, keep={version - 1}, holder="t")
    assert ranks.prepared == 2  # (asked once more at the first change, not after)
    assert ranks.staged == [cache.change_path(v - 1, v).name for v in (1, 2, 3, 4)]  # each staged once
    assert "holds its values as bfloat16" in updates.old_values[ranks.url] and "(b, " in updates.old_values[ranks.url]
    said = [r.getMessage() for r in caplog.records if "old values" in r.getMessage()]
    assert len(said) == 1 and ranks.url in said[0], said
