#!/usr/bin/env python3
"""Benchmark + check on a GPU machine: publishing CUDA tensors, against the pinned device-to-host floor.

A bf16 model (default 15 GB, 7B-shaped) lives on the device; each step changes 1 % of its elements by a
few ulps there (``rl_like_step``), then ``Publisher.publish`` takes the version (by default with the device
encoder: ``--device-delta auto``; ``off`` is the host path). Measured in the same run: the floor of the host
path, a pinned device-to-host copy of every tensor into preallocated pinned buffers. Prints per version the
blocking time of ``publish`` and when the version was committed after ``publish`` returned, then the targets
side by side with the floor, the extra device memory and the pinned host memory ("blocked" counts until
``publish`` returned and the device work queued before the trainer's next kernels is done); every version is decoded
from the stream and compared bit for bit with the device tensors of its step (on the device).

    python tools/bench_gpu_snapshot.py --size 15GB --steps 6 --json /tmp/bench.json
    python tools/bench_gpu_snapshot.py --device cpu --size 64MB --steps 4      # smoke test without a GPU
    python tools/bench_gpu_snapshot.py --fsdp --size 15GB --json /tmp/fsdp.json   # DTensor locals (issue 38)

``--fsdp`` publishes the model as FSDP2 holds it, DTensors placed ``Shard(0)`` on a one-rank device mesh, through
``DistributedPublisher.publish_sharded``: the device encoder then takes each DTensor's local shard (a one-rank
mesh: the whole tensor), nothing gathered; the trainer's step changes the locals in place.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckptstream import Publisher, Stream  # noqa: E402
from ckptstream.cli.options import parse_bytes  # noqa: E402
from ckptstream.codec import INT_OF_SIZE  # noqa: E402
from ckptstream.writer import DistributedPublisher  # noqa: E402
from ckptstream.testing.models import TinyModelSpec, rl_like_step, tiny_state_dict  # noqa: E402

TARGETS = {  # the targets, checked below
    "steady_blocked_s": 0.10, "steady_vs_floor": 0.36, "first_blocked_s": 1.0, "max_later_blocked_s": 0.2,
    "delta_committed_after_s": 1.5, "extra_device_memory_x_model": 1.0, "pinned_host_x_model": 0.10,
}


def model_on(device: torch.device, size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A 7B-shaped bf16 state dict of about ``size`` bytes, generated on ``device`` (unit vectors for the
    norms, normal(0, 0.02) elsewhere)."""
    spec = TinyModelSpec.for_size(size, vocab_size=32000 if size >= (1 << 30) else 8192)
    with torch.device("meta"):
        shapes = {name: (t.shape, t.dtype) for name, t in tiny_state_dict(spec).items()}
    generator = torch.Generator(device=device).manual_seed(seed)
    state = {}
    for name, (shape, dtype) in shapes.items():
        if len(shape) == 1 and name.endswith("norm.weight"):
            state[name] = torch.ones(shape, dtype=dtype, device=device)
        else:
            state[name] = torch.empty(shape, dtype=torch.float32, device=device).normal_(
                0.0, 0.02, generator=generator).to(dtype)
    return state


def as_dtensors(state: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """``state`` as FSDP2 holds it: DTensors placed ``Shard(0)`` on a one-rank device mesh (a process group of
    one is started here), each wrapping the tensor of ``state`` itself as its local shard, so that a step that
    changes ``state`` in place changes what is published."""
    import datetime
    import os
    import socket

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(probe.getsockname()[1]))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1,
                            timeout=datetime.timedelta(minutes=10))
    mesh = init_device_mesh(device.type, (1,))
    dtensors = {name: DTensor.from_local(t, mesh, [Shard(0)], run_check=False) for name, t in state.items()}
    assert all(d.to_local().data_ptr() == state[n].data_ptr() for n, d in dtensors.items())
    return dtensors


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pinned_floor(state: dict[str, torch.Tensor], device: torch.device) -> float:
    """Seconds of the host path's floor: copying every tensor into preallocated (pinned, on a GPU) host
    buffers with ``non_blocking`` copies; the better of two runs."""
    buffers = {n: torch.empty(t.shape, dtype=t.dtype, pin_memory=device.type == "cuda") for n, t in state.items()}
    times = []
    for _ in range(2):
        synchronize(device)
        started = time.perf_counter()
        for name, tensor in state.items():
            buffers[name].copy_(tensor, non_blocking=True)
        synchronize(device)
        times.append(time.perf_counter() - started)
    del buffers
    return min(times)


class FullCollections:
    """Python's full garbage collections (generation 2) of this process, as (start, seconds) by
    ``perf_counter``, whichever thread ran them: one falling inside ``publish`` adds its time to it."""

    def __init__(self) -> None:
        self.spans: list[tuple[float, float]] = []
        self._started: dict[int, float] = {}
        gc.callbacks.append(self._note)

    def _note(self, phase: str, info: dict[str, int]) -> None:
        if info["generation"] != 2:
            return
        now = time.perf_counter()
        if phase == "start":
            self._started[threading.get_ident()] = now
        elif threading.get_ident() in self._started:
            start = self._started.pop(threading.get_ident())
            self.spans.append((start, now - start))

    def close(self) -> None:
        gc.callbacks.remove(self._note)

    def within(self, start: float, end: float) -> list[float]:
        """The seconds of the collections that ran (partly) between ``start`` and ``end``."""
        return [seconds for begun, seconds in self.spans if begun < end and begun + seconds > start]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.reshape(-1).view(INT_OF_SIZE[a.element_size()]), b.reshape(-1).view(INT_OF_SIZE[b.element_size()]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=parse_bytes, default=parse_bytes("15GB"))
    parser.add_argument("--steps", type=int, default=6, help="versions to publish (default 6)")
    parser.add_argument("--keyframe-every", type=int, default=4,
                        help="versions per keyframe chain (default 4: a later keyframe is timed too)")
    parser.add_argument("--fraction", type=float, default=0.01, help="elements changed per step")
    parser.add_argument("--device", default="cuda", help="where the model lives (default cuda; cpu for a smoke test)")
    parser.add_argument("--device-delta", choices=("auto", "off"), default="auto",
                        help="auto: the device encoder for CUDA tensors (and, with --device cpu, its CPU "
                             "reference); off: the host path")
    parser.add_argument("--freeze-gc", choices=("auto", "off"), default="auto",
                        help="auto: the publisher's default (the heap frozen at the first device publish); "
                             "off: freeze_gc=False, the collector left alone")
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--fsdp", action="store_true",
                        help="publish DTensors (Shard(0), one-rank mesh) through DistributedPublisher.publish_sharded")
    parser.add_argument("--dir", help="stream directory (default: a temp dir, removed afterwards)")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    assert not cuda or torch.cuda.is_available(), "no GPU here: use --device cpu"

    state = model_on(device, args.size)
    full = sum(t.numel() * t.element_size() for t in state.values())
    name = torch.cuda.get_device_name(device) if cuda else "CPU"
    print(f"device: {name}; model {full / 1e9:.2f} GB bf16 in {len(state)} tensors; torch {torch.__version__}; "
          f"encoder: {'device' if args.device_delta == 'auto' else 'host'}", flush=True)
    floor = pinned_floor(state, device)
    print(f"pinned D2H floor (copy into preallocated pinned buffers): {floor:.3f} s "
          f"({full / floor / 1e9:.1f} GB/s)", flush=True)

    root = Path(args.dir or tempfile.mkdtemp(prefix="ckptstream-gpu-"))
    shutil.rmtree(root / "stream", ignore_errors=True)
    synchronize(device)
    memory_before = torch.cuda.memory_allocated(device) if cuda else 0
    peak = 0  # device memory above memory_before while a version is published (the step's own temporaries aside)
    generator = torch.Generator(device=device).manual_seed(1)
    rows, exact = [], []
    device_delta = None if args.device_delta == "auto" and cuda else args.device_delta == "auto"
    options = dict(keyframe_every=args.keyframe_every, workers=args.workers, device_delta=device_delta,
                   freeze_gc=None if args.freeze_gc == "auto" else False)
    if args.fsdp:
        published = as_dtensors(state, device)
        publisher = DistributedPublisher(str(root / "stream"), **options)
        publish = publisher.publish_sharded
    else:
        published, publisher = state, Publisher(str(root / "stream"), **options)
        publish = publisher.publish
    stream = Stream(str(root / "stream"))
    full_collections = FullCollections()
    with publisher:
        for step in range(args.steps):
            if step:
                rl_like_step(state, fraction=args.fraction, generator=generator)
            synchronize(device)
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            started = time.perf_counter()
            future = publish(published, step if args.fsdp else None, step=step)
            returned = time.perf_counter() - started
            synchronize(device)  # and the device work the trainer's stream now waits for
            blocked = time.perf_counter() - started
            full_gc = full_collections.within(started, started + blocked)
            manifest = future.result()
            after = time.perf_counter() - started - returned
            if cuda:
                peak = max(peak, torch.cuda.max_memory_allocated(device) - memory_before)
            rows.append({"version": manifest.version, "kind": manifest.kind, "stored_bytes": manifest.stored_bytes,
                         "blocked_s": blocked, "returned_s": returned, "committed_after_s": after,
                         "device_memory_bytes": publisher.device_memory_bytes,
                         "pinned_bytes": publisher.pinned_memory_bytes, "phases_s": dict(publisher.phase_seconds),
                         "full_gc_in_publish_s": full_gc})
            print(f"  version {step}: {manifest.kind:8} stored {manifest.stored_bytes / 1e6:9.1f} MB "
                  f"({100 * manifest.stored_bytes / full:6.2f}%)  publish blocked {blocked:6.3f} s (returned after "
                  f"{returned:6.3f} s), committed {after:6.2f} s after it returned"
                  + (f"; full gc inside it: {', '.join(f'{x:.3f} s' for x in full_gc)}" if full_gc else ""), flush=True)
            print("    background: " + ", ".join(f"{k} {v:.3f} s" for k, v in rows[-1]["phases_s"].items()),
                  flush=True)
            ok = all(same_bits(state[n], t.to(device)) for n, t in stream.iter_tensors(manifest.version))
            exact.append(ok)
            print(f"    decodes bit-exactly to the device tensors: {'ok' if ok else 'NO'}", flush=True)
        resident = publisher.device_memory_bytes
        pinned = publisher.pinned_memory_bytes
    full_collections.close()
    synchronize(device)
    memory_after = torch.cuda.memory_allocated(device) if cuda else 0

    later = [r["blocked_s"] for r in rows[1:]]
    deltas = [r for r in rows if r["kind"] == "delta"]
    steady = statistics.median(later) if later else float("nan")
    figures = {
        "device": name, "fsdp": args.fsdp, "model_bytes": full, "tensors": len(state), "floor_s": floor,
        "first_blocked_s": rows[0]["blocked_s"], "steady_blocked_s": steady, "steady_vs_floor": steady / floor,
        "max_later_blocked_s": max(later) if later else float("nan"),
        "delta_committed_after_s": max(r["committed_after_s"] for r in deltas) if deltas else float("nan"),
        "delta_stored_median_bytes": statistics.median(r["stored_bytes"] for r in deltas) if deltas else 0,
        "extra_device_memory_x_model": peak / full, "resident_device_memory_x_model": resident / full,
        "pinned_host_x_model": pinned / full, "device_memory_before": memory_before,
        "device_memory_after_close": memory_after, "bit_exact": all(exact), "rows": rows,
        "delta_phases_median_s": {k: statistics.median(r["phases_s"].get(k, 0.0) for r in deltas)
                                  for k in (deltas[0]["phases_s"] if deltas else {})},
        "peak_beyond_resident_bytes": peak - resident,
    }
    print()
    print(f"{'measure':44} {'figure':>10} {'target':>9}  ok")
    for key, label in (("first_blocked_s", "first publish (keyframe) blocks, s"),
                       ("steady_blocked_s", "steady-state publish blocks (median), s"),
                       ("steady_vs_floor", "  ... x the pinned D2H floor"),
                       ("max_later_blocked_s", "max later blocking (keyframes incl.), s"),
                       ("delta_committed_after_s", "delta committed after publish returns, s"),
                       ("extra_device_memory_x_model", "extra device memory (peak) x model"),
                       ("pinned_host_x_model", "pinned host memory x model")):
        value, target = figures[key], TARGETS[key]
        print(f"{label:44} {value:10.3f} {target:9.2f}  {'yes' if value <= target else 'NO'}")
    print(f"{'pinned D2H floor, s':44} {floor:10.3f}")
    print(f"{'resident device copy x model':44} {resident / full:10.3f}")
    print(f"{'peak device memory beyond it, MB':44} {(peak - resident) / 1e6:10.1f}")
    for key, value in figures["delta_phases_median_s"].items():
        print(f"{'delta background, ' + key + ' (median), s':44} {value:10.3f}")
    print(f"{'full gc runs inside publish (all versions)':44} {sum(len(r['full_gc_in_publish_s']) for r in rows):10d}")
    print(f"{'full gc runs in the whole run, longest, s':44} {len(full_collections.spans):10d} "
          f"{max((s for _, s in full_collections.spans), default=0):9.3f}")
    print(f"{'delta stored (median) x model':44} {figures['delta_stored_median_bytes'] / full:10.4f}")
    print(f"device memory allocated: before {memory_before / 1e9:.2f} GB, after close {memory_after / 1e9:.2f} GB")
    print(f"every version decodes bit-exactly to the device tensors: {'ok' if all(exact) else 'NO'}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    sys.exit(0 if all(exact) else 1)


if __name__ == "__main__":
    main()
