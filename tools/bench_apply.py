"""The in-place apply against the number of checkpoint tensors: MoE depths on ``FusedModel`` (vLLM's fused
layout, no vLLM), 1 % of elements changed by a few ulps.

Per depth it prints the checkpoint tensors, the elements changed and the change file's bytes, the first staging
(the loaders traced: once per model), a later staging (plans reused), and the apply (what the pause holds), each
the median of ``--repeat`` runs, and whether the patched model equals a full ``load_weights`` of the new version
(``--check``). With ``--baseline MODULE`` (a copy of an older ``apply.py``, e.g.
``git show main:ckptstream/vllm_loader/inplace/apply.py > /tmp/apply_old.py``; one from before ``upload.Uploads``,
c653ba5, does not load: run this script from an older tree instead, ``tools/device_matrix.sh``'s ``BASELINE_TREE``)
the same figures for that applier are printed beside, in the same run. With ``--busy``, each staging is also
timed beside a thread that does what a generating engine's loop does to the interpreter (Python work between
small torch ops): a staging in a vLLM worker shares the GIL with it, and each of its own ops may wait for the GIL
again. With ``--engine``, each later
staging is also run beside a thread that steps like a generating engine over the model (on a GPU one CUDA graph
replayed per step, reading every parameter, then a wait for its result, as vLLM's decode and sampling): the median
step alone and the longest step a staging overlapped are printed (a client's stall: the GPU, the driver and the
interpreter, all shared with the staging). With ``--fp8 SCHEME``
(``tensor``, ``channel``, ``block``) the fused parameters are served quantized to FP8 as vLLM's online methods
quantize them (``quantize_fused``, with the torch mirrors of vLLM's ops), the base version's copy beside the change
(the units whose scale moves are quantized again from it); ``written`` counts the elements written, whole units
included.

    python tools/bench_apply.py --layers 2 4 8 --experts 128 --hidden 256 --intermediate 96
    python tools/bench_apply.py --layers 8 --busy --baseline /tmp/apply_old.py
    python tools/bench_apply.py --layers 4 --hidden 512 --intermediate 256 --fp8 channel --check
    python tools/bench_apply.py --device cuda --layers 8 16 --experts 128 --hidden 2048 --intermediate 768
    python tools/bench_apply.py --device cuda --layers 12 --hidden 2048 --intermediate 768 --engine  # the stall
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckptstream.codec import bit_pattern  # noqa: E402
from ckptstream.format import version_name  # noqa: E402
from ckptstream.testing.fused_model import FusedModel, FusedSpec, fused_checkpoint, quantize_fused  # noqa: E402
from ckptstream.testing.models import rl_like_step  # noqa: E402
from ckptstream.vllm_loader.inplace import apply as current_apply  # noqa: E402
from ckptstream.vllm_loader.inplace.change import write_change  # noqa: E402
from baseline_module import load_baseline  # noqa: E402  (tools/, beside this script)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _load(spec: FusedSpec, state: dict[str, torch.Tensor], device: torch.device) -> FusedModel:
    model = FusedModel(spec, device)
    with torch.no_grad():
        model.load_weights(state.items())
    return model


class _EngineLoop:
    """A thread that keeps the interpreter as busy as a generating engine's loop: Python work between small
    torch ops (each of which lets go of the GIL, as vLLM's scheduling and sampling do)."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def _run(self) -> None:
        state = torch.zeros(64)
        while not self._stop.is_set():
            for _ in range(20):
                state = state + 1
            sum(range(500))

    def __enter__(self) -> _EngineLoop:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


class _Steps:
    """A thread stepping like a generating engine over ``model`` while the block runs: some Python, then work that
    reads every matrix of the model once (a matrix-vector product each: on a GPU captured as one CUDA graph on a
    stream of its own and replayed, as vLLM replays its decode), then a wait for the result (its sampled tokens).
    ``steps``: (started, seconds) of each."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        # (FP8 matrices are left out: no matrix-vector product of theirs; the rest still reads most of the model)
        matrices = [p.detach().reshape(-1, p.shape[-1]) for p in model.parameters()
                    if p.dim() >= 2 and p.element_size() > 1]
        vectors = {(m.shape[1], m.dtype): torch.ones(m.shape[1], 1, dtype=m.dtype, device=device) for m in matrices}
        self.steps: list[tuple[float, float]] = []
        self._graph: torch.cuda.CUDAGraph | None = None
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

        def forward() -> torch.Tensor:
            return torch.stack([(m @ vectors[m.shape[1], m.dtype]).float().sum() for m in matrices]).sum()

        self._forward = forward
        if self._stream is not None:
            with torch.cuda.stream(self._stream):
                forward()  # (warmed up on the stream it is captured on)
                self._stream.synchronize()
                self._graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self._graph, stream=self._stream):
                    self._out = forward()
            self._host = torch.empty((), pin_memory=True)
        self._stop = threading.Event()
        self._started = threading.Event()
        self._thread: threading.Thread | None = None

    def _step(self) -> None:
        if self._graph is None:
            self._forward().item()
            return
        with torch.cuda.stream(self._stream):
            self._graph.replay()
            self._host.copy_(self._out, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        done.synchronize()

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.perf_counter()
            sum(range(2000))  # (the scheduler's Python between steps)
            self._step()
            self.steps.append((started, time.perf_counter() - started))
            if len(self.steps) >= 20:
                self._started.set()

    def __enter__(self) -> _Steps:
        self.steps, self._stop = [], threading.Event()
        self._started.clear()
        self._thread = threading.Thread(target=self._run, name="engine-steps", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout=120):  # (steps alone first: the median step beside nothing)
            raise RuntimeError("the engine's steps did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()

    def alone_and_longest(self, start: float, end: float) -> tuple[float, float]:
        """(the median step before ``start``, the longest step overlapping [``start``, ``end``])."""
        before = [seconds for started, seconds in self.steps if started + seconds < start]
        during = [seconds for started, seconds in self.steps if started + seconds >= start and started <= end]
        return statistics.median(before), max(during, default=0.0)


class _Runs:
    """One applier's runs on a model of its own: the first staging (its loaders traced), then later stagings and
    applies, each on the base version again, plans kept; with ``busy``, each later staging also beside an
    ``_EngineLoop``; with ``engine``, beside ``_Steps``."""

    def __init__(self, module: Any, spec: FusedSpec, base: dict, change: Path, device: torch.device, busy: bool,
                 fp8: str | None = None, engine: bool = False):
        self.model = _load(spec, base, device)
        self.fp8 = fp8
        quantized = quantize_fused(self.model, fp8) if fp8 else None
        self.applier = module.InPlaceApplier(self.model, device, quantized)
        self.served = {name: param.detach().clone() for name, param in self.model.named_parameters()}
        self.change, self.device, self.busy = change, device, busy
        self.first: float | None = None
        self.stages: list[float] = []
        self.applies: list[float] = []
        self.busy_stages: list[float] = []
        self.engine = _Steps(self.model, device) if engine else None
        self.engine_steps: list[tuple[float, float]] = []  # per staging beside it: (median step alone, longest)
        self.written = 0

    def run(self) -> None:
        if self.first is not None:
            with torch.no_grad():  # back to the base version, plans kept
                for name, param in self.model.named_parameters():
                    param.copy_(self.served[name])
            if self.busy:
                gc.collect()
                with _EngineLoop():
                    started = time.perf_counter()
                    self.applier.stage(str(self.change))
                    self.applier.staged(wait=True)
                    self.busy_stages.append(time.perf_counter() - started)
            if self.engine is not None:
                gc.collect()
                with self.engine:
                    started = time.perf_counter()
                    self.applier.stage(str(self.change))
                    self.applier.staged(wait=True)
                    ended = time.perf_counter()
                # (once the steps have stopped: the step a staging held up ends after it)
                self.engine_steps.append(self.engine.alone_and_longest(started, ended))
        _sync(self.device)
        gc.collect()  # (a collection of what the runs before left falls in no timed run)
        started = time.perf_counter()
        self.applier.stage(str(self.change))
        result = self.applier.staged(wait=True)
        stage_s = time.perf_counter() - started
        assert result is not None and not result.get("error") and not result.get("unpatchable"), result
        started = time.perf_counter()
        answer = self.applier.apply()
        apply_s = time.perf_counter() - started
        assert answer.get("applied"), answer
        self.written = answer["applied"]
        if self.first is None:
            self.first = stage_s
        else:
            self.stages.append(stage_s)
            self.applies.append(apply_s)

    def figures(self, spec: FusedSpec, new: dict, check: bool) -> dict[str, Any]:
        equal = None
        if check:
            fresh = _load(spec, new, self.device)
            if self.fp8:
                quantize_fused(fresh, self.fp8)
            reference = dict(fresh.named_parameters())
            equal = all(torch.equal(bit_pattern(p), bit_pattern(reference[n]))
                        for n, p in self.model.named_parameters())
        return {"first_stage_s": self.first, "stage_s": statistics.median(self.stages),
                "apply_s": statistics.median(self.applies),
                "busy_stage_s": statistics.median(self.busy_stages) if self.busy_stages else None,
                "engine_step_s": statistics.median(a for a, _ in self.engine_steps) if self.engine_steps else None,
                "engine_longest_s": [round(b, 4) for _, b in self.engine_steps] or None,
                "written": self.written, "equal": equal}


def _warm_up(appliers: dict[str, Any], device: torch.device, scratch: Path) -> None:
    """A small change staged and applied once by every applier: what the first run in a process pays alone (torch's
    first ops, imports) is paid before any timing."""
    spec = FusedSpec(layers=1, experts=2)
    base = fused_checkpoint(spec)
    new = {n: t.clone() for n, t in base.items()}
    rl_like_step(new, fraction=0.05, max_ulps=3, generator=torch.Generator().manual_seed(2))
    change = scratch / "warm-up.safetensors"
    write_change(((n, base[n], new[n]) for n in new), change, total=sum(t.numel() for t in new.values()),
                 max_fraction=1.0, stream_id="bench", base=0, version=1)
    for module in appliers.values():
        _Runs(module, spec, base, change, device, busy=False).run()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=96)
    parser.add_argument("--fraction", type=float, default=0.01)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--check", action="store_true", help="compare with a full load_weights of the new version")
    parser.add_argument("--baseline", help="path of an older apply.py to time beside the current one")
    parser.add_argument("--busy", action="store_true", help="also time each staging beside a busy engine loop")
    parser.add_argument("--engine", action="store_true",
                        help="also run each staging beside a thread stepping like an engine: its longest step")
    parser.add_argument("--threads", type=int, help="torch's CPU threads (1 on a busy host: OpenMP threads spin)")
    parser.add_argument("--fp8", choices=["tensor", "channel", "block"],
                        help="serve the fused parameters quantized to FP8 (vLLM's online method of that scheme)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    appliers = {"current": current_apply}
    if args.baseline:
        appliers["baseline"] = load_baseline(args.baseline, "ckptstream.vllm_loader.inplace._baseline_apply")
    rows = []
    print(f"device {device}; experts {args.experts}, hidden {args.hidden}, intermediate {args.intermediate}; "
          f"{args.fraction:.0%} of elements changed; medians of {args.repeat}"
          + (f"; served as FP8 per {args.fp8}" if args.fp8 else ""))
    print(f"{'applier':>9} {'layers':>6} {'tensors':>8} {'changed':>10} {'change MB':>9} {'1st stage s':>11} "
          f"{'stage s':>8} {'busy stage s':>12} {'apply s':>8} {'written':>10} {'equal':>6}"
          + ("   engine step alone s, longest beside each staging s" if args.engine else ""))
    with tempfile.TemporaryDirectory() as scratch:
        _warm_up(appliers, device, Path(scratch))
        for layers in args.layers:
            spec = FusedSpec(layers=layers, experts=args.experts, hidden=args.hidden,
                             intermediate=args.intermediate, vocab=4096)
            base = fused_checkpoint(spec)
            new = {n: t.clone() for n, t in base.items()}
            rl_like_step(new, fraction=args.fraction, max_ulps=3, generator=torch.Generator().manual_seed(1))
            new["lm_head.weight"] = new["model.embed_tokens.weight"]
            root = Path(scratch) / f"layers-{layers}"  # (laid out as a follower's cache: the change, the base)
            change = root / ".changes" / f"{version_name(0)}-{version_name(1)}.safetensors"
            change.parent.mkdir(parents=True)
            if args.fp8:
                (root / version_name(0)).mkdir()
                save_file({n: t.contiguous() for n, t in base.items() if n != "lm_head.weight"},
                          str(root / version_name(0) / "model.safetensors"))
            total = sum(t.numel() for t in new.values())
            summary = write_change(((n, base[n], new[n]) for n in new), change, total=total, max_fraction=1.0,
                                   stream_id="bench", base=0, version=1)
            runs = {label: _Runs(module, spec, base, change, device, args.busy, args.fp8, args.engine)
                    for label, module in appliers.items()}
            for round_ in range(args.repeat + 1):  # (interleaved, the order turned each round: no applier runs
                for label in list(runs)[::1 if round_ % 2 == 0 else -1]:  # on a machine the other warmed)
                    runs[label].run()
            for label, timed in runs.items():
                figures = timed.figures(spec, new, args.check)
                row = {"applier": label, "layers": layers, "tensors": len(new), "changed": summary.changed,
                       "change_bytes": change.stat().st_size, **figures}
                rows.append(row)
                print(f"{label:>9} {layers:>6} {len(new):>8} {summary.changed:>10} "
                      f"{row['change_bytes'] / 1e6:>9.1f} {figures['first_stage_s']:>11.3f} "
                      f"{figures['stage_s']:>8.3f} {_seconds(figures['busy_stage_s']):>12} "
                      f"{figures['apply_s']:>8.4f} {figures['written']:>10} {str(figures['equal']):>6}"
                      + (f"   {figures['engine_step_s']:.4f}, {figures['engine_longest_s']}" if args.engine else ""),
                      flush=True)
            del base, new
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


if __name__ == "__main__":
    sys.exit(main())
