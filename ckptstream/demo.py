"""``ckptstream demo``: the main job end to end on embedded defaults.

Generates a tiny model, publishes a base version and a series of RL-like updates to a local directory
stream, lists, verifies and materializes them (also the follower's way: deltas applied to the previous
materialized version), checks every result bit for bit and prints a summary table.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from .format import content_hash
from .reader import Stream
from .synthetic import TinyModelSpec, rl_like_step, write_tiny_model
from .hf import iter_hf_weights
from .writer import Publisher

_MARKER = ".ckptstream-demo"


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _hashes(state: dict[str, torch.Tensor]) -> dict[str, str]:
    from .codec import as_bytes, buffer_of

    return {n: content_hash(buffer_of(as_bytes(t.contiguous()))) for n, t in state.items()}


def run_demo(*, workdir: Path | None, versions: int = 12, size: int = 32_000_000, keyframe_every: int = 5,
             as_json: bool = False) -> int:
    """Run the demo; returns the process exit code (0 when every check passed)."""
    if workdir is None:
        workdir = Path(tempfile.mkdtemp(prefix="ckptstream-demo-"))
    elif workdir.exists() and any(workdir.iterdir()) and not (workdir / _MARKER).exists():
        raise FileExistsError(f"{workdir} is not empty and was not made by `ckptstream demo`; pick another --workdir")
    import shutil

    for sub in ("model", "stream", "latest", "follower"):
        shutil.rmtree(workdir / sub, ignore_errors=True)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / _MARKER).touch()
    url = str(workdir / "stream")

    spec = TinyModelSpec.for_size(size)
    model_dir = write_tiny_model(workdir / "model", spec)
    state = dict(iter_hf_weights(model_dir))
    full = sum(t.numel() * t.element_size() for t in state.values())
    _say(f"[1/4] generated a {spec.arch} model: {spec.num_layers} layers, hidden {spec.hidden_size}, "
         f"{len(state)} tensors, {full / 1e6:.1f} MB in {model_dir}")

    _say(f"[2/4] publishing {versions} versions to {url} (1% of elements change per step)")
    generator = torch.Generator().manual_seed(1)
    expected, rows = [], []
    with Publisher(url, assets=model_dir, keyframe_every=keyframe_every) as publisher:
        for step in range(versions):
            if step:
                rl_like_step(state, fraction=0.01, generator=generator)
            expected.append(_hashes(state))
            started = time.perf_counter()
            future = publisher.publish(state, step=step, metadata={"demo": True})
            blocked = time.perf_counter() - started
            manifest = future.result()
            rows.append({"version": manifest.version, "kind": manifest.kind, "stored_bytes": manifest.stored_bytes,
                         "full_bytes": manifest.full_bytes, "changed_elements": manifest.changed_elements,
                         "blocked_ms": 1000 * blocked, "committed_ms": 1000 * (time.perf_counter() - started)})

    stream = Stream(url)
    _say(f"[3/4] verifying {len(stream.versions())} versions bit for bit")
    numel = sum(t.numel() for t in state.values())
    ok = True
    for row in rows:
        started = time.perf_counter()
        stream.verify(row["version"])
        row["verify_ms"] = 1000 * (time.perf_counter() - started)
        decoded = _hashes(dict(stream.iter_tensors(row["version"])))
        row["bit_exact"] = decoded == expected[row["version"]]
        ok &= row["bit_exact"]

    latest = stream.latest()
    assert latest is not None
    _say(f"[4/4] materializing version {latest}: from its keyframe, and from version {latest - 1} (follower)")
    started = time.perf_counter()
    latest_dir = stream.materialize(latest, workdir / "latest")
    from_keyframe = time.perf_counter() - started
    previous_dir = stream.materialize(latest - 1, workdir / "follower")
    started = time.perf_counter()
    stream.materialize(latest, previous_dir, base_dir=previous_dir, overwrite=True)
    from_previous = time.perf_counter() - started
    for directory in (latest_dir, previous_dir):
        ok &= _hashes(dict(iter_hf_weights(directory))) == expected[latest]

    stored = sum(r["stored_bytes"] for r in rows)
    summary = {"workdir": str(workdir), "stream": url, "model_bytes": full, "versions": rows,
               "stored_bytes": stored, "full_copies_bytes": full * len(rows),
               "materialize_from_keyframe_s": from_keyframe, "materialize_from_previous_s": from_previous,
               "materialized": str(latest_dir), "ok": ok}
    if as_json:
        print(json.dumps(summary, indent=2))
        return 0 if ok else 3
    print(f"{'VERSION':<8} {'KIND':<9} {'STORED':>10} {'OF FULL':>8} {'CHANGED':>8} {'BLOCKED':>9} "
          f"{'COMMITTED':>10} {'VERIFY':>8}  BIT-EXACT")
    for r in rows:
        changed = "-" if r["changed_elements"] is None else f"{100 * r['changed_elements'] / numel:.2f}%"
        print(f"{r['version']:<8} {r['kind']:<9} {r['stored_bytes'] / 1e6:>8.2f}MB "
              f"{100 * r['stored_bytes'] / r['full_bytes']:>7.2f}% {changed:>8} {r['blocked_ms']:>7.1f}ms "
              f"{r['committed_ms']:>8.1f}ms {r['verify_ms']:>6.0f}ms  {'yes' if r['bit_exact'] else 'NO'}")
    print(f"\n{len(rows)} versions: {stored / 1e6:.1f} MB stored instead of {full * len(rows) / 1e6:.1f} MB "
          f"of full copies ({100 * stored / (full * len(rows)):.1f}%)")
    print(f"materialize version {latest}: {from_keyframe:.2f} s from its keyframe, "
          f"{from_previous:.2f} s from version {latest - 1}")
    print(f"served-ready directory: {latest_dir}")
    print("all checks passed" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 3
