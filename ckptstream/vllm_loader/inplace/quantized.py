"""Parameters that vLLM quantized to FP8 as it loaded them (``--quantization fp8`` on a bf16 checkpoint), written in
place from a change of the checkpoint's values, bit for bit as a reload would write them.

vLLM 0.24's online per-tensor method quantizes each layer once it is loaded: a Linear's weight (a rank's fused
qkv, gate_up, o or down) gets one scale, its absolute maximum over 448 (float8_e4m3fn's largest value), and is kept
as ``qweight.t()``, so its bytes lie in the bf16 weight's [out, in] order; a MoE weight (``w13``, ``w2``) gets one
scale per expert and keeps its layout (the Triton experts read it as it is). So a checkpoint element lands at the
same storage offset as on a bf16 server, in a *unit* (the Linear's weight, an expert) worth ``fp8(x / scale)``.

**The plan.** A quantized parameter no longer takes checkpoint tensors (its loader checks shapes it lost), so the
trace (``trace.plan_tensors``) runs on a copy of the model's module tree in which each quantized parameter is its
*stand-in*: the bf16 parameter rebuilt from what vLLM recorded of the layer before loading (what its own reload
restores), with the loader unwrapped, in host memory never touched. The model itself keeps generating meanwhile.

**The write, per unit.** A reload computes the unit's scale from its new absolute maximum. Where no changed
element's old or new value quantizes to ±448 with the held scale, that maximum is an unchanged element's (an element
at the maximum quantizes to 448 exactly, a larger one clamps to it): the reload's scale is the held one and the
unchanged elements keep their bytes, so the changed ones are quantized with the held scale (vLLM's static op, which
is its dynamic one element for element). Otherwise the whole unit is quantized again from its new values (the base
version's copy the change was built on, with the change's new values), by vLLM's own op: new bytes and a new scale,
as a reload computes them. The old values the apply checks are the base's, quantized the same way.

Written in place: the per-tensor online method on a CUDA GPU (Linear weights without CUTLASS's padding, MoE experts
on the Triton backend). Any other quantized parameter is unpatchable, with the reason (the follower reloads fully).
"""

from __future__ import annotations

import contextlib
import copy
import logging
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

log = logging.getLogger("ckptstream.inplace")

FP8_MAX = 448.0
"""float8_e4m3fn's largest value: a unit's scale is its absolute maximum over it."""
_FP8_MAX_BITS = 0x7E  # its magnitude's bits (0x7F: NaN)

Quantize = Callable[[torch.Tensor, "torch.Tensor | None"], "tuple[torch.Tensor, torch.Tensor]"]
"""(values of one unit, its scale or None) -> (their float8_e4m3fn values, the scale): None computes the scale
from the values, as a load does."""

BaseValues = Callable[[str, int, int], "torch.Tensor | str"]
"""(parameter, start, stop) -> the base version's checkpoint values at those storage offsets, or why not."""

_LINEAR_METHODS = {"Fp8PerTensorOnlineLinearMethod": (("weight", "weight_scale"),)}
_MOE_WEIGHTS = (("w13_weight", "w13_weight_scale"), ("w2_weight", "w2_weight_scale"))
_MOE_METHODS = {"Fp8OnlineMoEMethod": _MOE_WEIGHTS, "Fp8PerTensorOnlineMoEMethod": _MOE_WEIGHTS}


def reference_quantize(values: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's per-tensor FP8 quantization (``ops.scaled_fp8_quant``) in torch: scale = amax / 448 in float32, each
    value times the scale's reciprocal, clamped to ±448 (NaN to 448, as CUDA's ``fminf``), rounded to nearest even.
    For tests on a CPU; a server uses vLLM's op (``vllm_quantize``). On an H200 its bytes equalled the op's for 16 M
    random bf16 values, its scale did not (the op's division by 448 may round otherwise): tests use it on both
    sides."""
    if scale is None:
        scale = (values.abs().max().float() / FP8_MAX).reshape(1)
    scaled = values.float() * (1.0 / scale)
    scaled = torch.where(torch.isnan(scaled), torch.full_like(scaled, FP8_MAX), scaled)
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def vllm_quantize(values: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's own ``scaled_fp8_quant`` of ``values`` as one unit (per tensor), the op its loading runs."""
    from vllm import _custom_ops as ops

    quantized, scale = ops.scaled_fp8_quant(values.reshape(1, -1), scale)
    return quantized.reshape(values.shape), scale.reshape(1)


@dataclass(frozen=True)
class QuantizedParam:
    """An FP8 parameter written in place: ``scale``, its scales' parameter (one per unit, offset 0 of its storage),
    ``unit``, the consecutive storage elements each scale covers, ``dtype``, the dtype vLLM loads it in."""

    scale: str
    unit: int
    dtype: torch.dtype  # what vLLM loads it as, then quantizes (the checkpoint's values are cast to it first)


class QuantizedParams:
    """A model's FP8 parameters written in place (``params``), each traced through its bf16 stand-in. None at all
    on a model vLLM did not quantize as it loaded it."""

    def __init__(self, params: dict[str, QuantizedParam] | None = None,
                 stand_ins: dict[str, Callable[[], torch.Tensor]] | None = None,
                 quantize: Quantize = reference_quantize):
        self.params = params or {}
        self.stand_ins = stand_ins or {}  # parameter -> makes its bf16 stand-in
        self.quantize = quantize

    @classmethod
    def of_model(cls, model: torch.nn.Module, device: torch.device) -> QuantizedParams:
        """vLLM's online FP8 parameters of ``model``, found by their layers' quantization methods; those not written
        in place are logged once, with the reason (their loaders then refuse the trace: full reloads)."""
        params, stand_ins, problems = {}, {}, {}
        for prefix, layer in model.named_modules():
            method = getattr(layer, "quant_method", None)
            if not getattr(method, "uses_meta_device", False):
                continue  # (loaded as the checkpoint is: nothing quantized on loading)
            kind = type(method).__name__
            pairs = _LINEAR_METHODS.get(kind) or _MOE_METHODS.get(kind) or ()
            for weight, scale in pairs or [(n, "") for n in layer._parameters]:
                param = layer._parameters.get(weight)
                if param is None or param.element_size() != 1 or not param.is_floating_point():
                    continue
                name = f"{prefix}.{weight}" if prefix else weight
                problem, unit = _layout(layer, method, kind, weight, scale, param, device)
                if problem is not None:
                    problems[name] = problem
                    continue
                recorded = _recorded(layer, weight)  # (there: ``_layout`` checked it)
                assert recorded is not None
                params[name] = QuantizedParam(f"{prefix}.{scale}" if prefix else scale, unit, recorded.dtype)
                stand_ins[name] = _stand_in_maker(layer, weight)
        if problems:
            name, why = next(iter(sorted(problems.items())))
            log.warning("%d FP8 parameter(s) quantized by vLLM on loading are not written in place (changes to them "
                        "reload fully), e.g. %s: %s", len(problems), name, why)
        return cls(params, stand_ins, vllm_quantize if params else reference_quantize)

    @contextlib.contextmanager
    def tracing(self, model: torch.nn.Module) -> Iterator[torch.nn.Module]:
        """``model`` to trace its loaders on: itself, or (with quantized parameters) a copy of its module tree in
        which they are their bf16 stand-ins, the model itself untouched."""
        if not self.stand_ins:
            yield model
            return
        yield _with_parameters(model, {name: make() for name, make in self.stand_ins.items()})

    def writes(self, param: str, index: torch.Tensor, old: torch.Tensor, new: torch.Tensor, held: torch.Tensor,
               base: BaseValues) -> list[tuple[str, torch.Tensor | slice, torch.Tensor, torch.Tensor]] | str:
        """The writes that take the quantized ``param`` from the base version to the next one: [(parameter,
        storage offsets (a range: a unit written whole), what it must hold there, what to write)], in the
        parameters' dtypes, or why none can be made. ``index``: the changed elements' storage offsets (on the
        device, each once); ``old``/``new``: their checkpoint values; ``held``: the scales the server holds (the
        scale parameter)."""
        spec = self.params[param]
        old, new = old.to(spec.dtype), new.to(spec.dtype)  # (vLLM's loader casts to it before quantizing)
        units = torch.div(index, spec.unit, rounding_mode="floor")
        order = torch.argsort(units, stable=True)
        touched, counts = torch.unique_consecutive(units[order], return_counts=True)
        groups = list(zip(touched.tolist(), *(t[order].split(counts.tolist()) for t in (index, old, new))))
        quantized = [(self._bits(o, held[u:u + 1])[0], self._bits(n, held[u:u + 1])[0]) for u, _, o, n in groups]
        at_max = torch.stack([_reaches_max(q_old) | _reaches_max(q_new) for q_old, q_new in quantized]).tolist() \
            if groups else []
        writes: list[list[torch.Tensor]] = [[], [], []]
        whole_units: list[tuple[str, torch.Tensor | slice, torch.Tensor, torch.Tensor]] = []
        scales: list[list[torch.Tensor]] = [[], [], []]
        for (unit, offsets, _, values), (q_old, q_new), again in zip(groups, quantized, at_max):
            if not again:
                for part, value in zip(writes, (offsets, q_old, q_new)):
                    part.append(value)
                continue
            start, stop = unit * spec.unit, (unit + 1) * spec.unit
            whole = base(param, start, stop)
            if isinstance(whole, str):
                return f"{param}: the scale of its unit {unit} changes, and its new values are not here ({whole})"
            whole = whole.to(spec.dtype)
            q_base, s_base = self._bits(whole, None)
            whole[offsets - start] = values
            q_unit, s_unit = self._bits(whole, None)
            whole_units.append((param, slice(start, stop), q_base, q_unit))
            for part, value in zip(scales, (torch.tensor([unit], device=index.device), s_base, s_unit)):
                part.append(value)
        made: list[tuple[str, torch.Tensor | slice, torch.Tensor, torch.Tensor]] = whole_units
        if writes[0]:
            made.append((param, *(torch.cat(part) for part in writes)))
        return made + ([(spec.scale, *(torch.cat(part) for part in scales))] if scales[0] else [])

    def _bits(self, values: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``quantize``, its FP8 values as their bytes (uint8: few torch ops take float8 tensors)."""
        quantized, scale = self.quantize(values, scale)
        return quantized.view(torch.uint8), scale


def _reaches_max(quantized: torch.Tensor) -> torch.Tensor:
    """Whether any FP8 value (bytes) is ±448 (or NaN): a unit's maximum may be among them."""
    return ((quantized & 0x7F) >= _FP8_MAX_BITS).any()


def _layout(layer: torch.nn.Module, method: object, kind: str, weight: str, scale: str, param: torch.Tensor,
            device: torch.device) -> tuple[str | None, int]:
    """(why ``layer``'s quantized ``weight`` cannot be written in place, or None; the elements of its unit)."""
    if not scale:
        return f"quantized on loading by vLLM's {kind}, which ckptstream does not write in place", 0
    if device.type != "cuda":
        return "FP8 weights are written in place on CUDA GPUs only (other platforms repack them)", 0
    if kind in _MOE_METHODS and getattr(getattr(method, "fp8_backend", None), "value", None) != "TRITON":
        return f"its experts run on vLLM's {getattr(method, 'fp8_backend', None)} backend, which repacks them", 0
    shape = _recorded_shape(layer, weight)
    scales = layer._parameters.get(scale)
    if shape is None or scales is None or scales.dtype != torch.float32 or scales.storage_offset():
        return "vLLM's record of its bf16 layout or its scales is missing", 0
    numel = torch.Size(shape).numel()
    if param.untyped_storage().nbytes() != numel or param.storage_offset():
        return "its FP8 storage is padded or shared", 0
    if kind in _MOE_METHODS:
        if tuple(param.shape) != shape or not param.is_contiguous() or scales.numel() != shape[0]:
            return "its FP8 layout is not its bf16 one", 0
        return None, numel // shape[0]
    out, inner = shape
    if tuple(param.shape) != (inner, out) or tuple(param.stride()) != (1, inner) or scales.numel() != 1:
        return "its FP8 layout is not the transposed bf16 one", 0
    return None, numel


def _recorded_shape(layer: torch.nn.Module, weight: str) -> tuple[int, ...] | None:
    meta = _recorded(layer, weight)
    return None if meta is None else tuple(meta.shape)


def _recorded(layer: torch.nn.Module, weight: str) -> torch.Tensor | None:
    """The bf16 parameter vLLM recorded (on the meta device) before loading ``layer``, for its reloads."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    except ImportError:
        return None
    info = LAYERWISE_INFO.get(layer)
    return None if info is None else info.restore_metadata[0].get(weight)


def _stand_in_maker(layer: torch.nn.Module, weight: str) -> Callable[[], torch.Tensor]:
    def make() -> torch.Tensor:
        from vllm.model_executor.model_loader.reload.layerwise import _get_original_loader
        from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor
        from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

        meta = _recorded(layer, weight)
        assert meta is not None
        with torch.device("cpu"):
            tensor = materialize_meta_tensor(meta)  # (empty host memory: the trace writes none of it)
        restore_layer_refs(tensor, layer)
        tensor.weight_loader = _get_original_loader(tensor)
        return tensor

    return make


def _with_parameters(module: torch.nn.Module, replaced: dict[str, torch.Tensor], prefix: str = "") -> torch.nn.Module:
    """A shallow copy of ``module``'s tree with the parameters named in ``replaced`` replaced."""
    clone = copy.copy(module)
    object.__setattr__(clone, "_parameters", {n: replaced.get(prefix + n, p) for n, p in module._parameters.items()})
    object.__setattr__(clone, "_modules", {n: None if child is None else _with_parameters(child, replaced,
                                                                                           f"{prefix}{n}.")
                                           for n, child in module._modules.items()})
    return clone
