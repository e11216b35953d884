#!/usr/bin/env python3
"""Benchmark: writing and parsing a manifest of a MoE model's thousands of tensors, as the publisher does at every
commit (``Manifest.to_bytes``, then its check ``Manifest.from_bytes``) and the follower once per version.

The manifest is that of a delta of a small-dimension Qwen3-MoE stream with the real model's tensor count per layer
(128 experts × 3 projections: 393 tensors a layer). With ``--baseline`` (a copy of an older ``format.py``, e.g.
``git show 0d92f38:ckptstream/format.py > /tmp/format_old.py``), the same manifest is written and parsed by it
too, the two in turn; medians of ``--repeat``.

    python tools/bench_manifest.py                                   # 8 layers: 3,147 tensors
    python tools/bench_manifest.py --layers 16 --baseline /tmp/format_old.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckptstream import Publisher, format as current  # noqa: E402
from ckptstream.hf import iter_hf_weights  # noqa: E402
from ckptstream.testing.models import TinyModelSpec, rl_like_step, write_tiny_model  # noqa: E402
from baseline_module import load_baseline  # noqa: E402  (tools/, beside this script)


def delta_manifest(root: Path, layers: int) -> bytes:
    """The bytes of the manifest of a delta (version 1) of a small MoE model of ``layers`` layers."""
    spec = TinyModelSpec(arch="qwen3_moe", hidden_size=256, num_layers=layers, num_heads=4, num_kv_heads=2,
                         kv_channels=64, intermediate_size=512, vocab_size=1024, num_experts=128, experts_per_token=8,
                         moe_intermediate_size=128)
    model = write_tiny_model(root / "model", spec)
    state = dict(iter_hf_weights(model))
    with Publisher(str(root / "stream"), keyframe_every=10) as publisher:
        publisher.publish(state).result()
        rl_like_step(state, fraction=0.01, max_ulps=3, generator=torch.Generator().manual_seed(1))
        publisher.publish(state).result()
    return (root / "stream" / current.manifest_path(1)).read_bytes()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--baseline", help="path of an older format.py to time beside the current one")
    args = parser.parse_args()
    modules = {"current": current}
    if args.baseline:
        modules["baseline"] = load_baseline(args.baseline, "ckptstream._baseline_format")
    with tempfile.TemporaryDirectory() as tmp:
        raw = delta_manifest(Path(tmp), args.layers)
    parsed = {name: module.Manifest.from_bytes(raw, version=1) for name, module in modules.items()}
    times: dict[str, dict[str, list[float]]] = {name: {"write": [], "parse": []} for name in modules}
    for _ in range(args.repeat):
        for name, module in modules.items():  # (in turn: a busy machine slows both alike)
            started = time.perf_counter()
            written = parsed[name].to_bytes()
            wrote = time.perf_counter()
            module.Manifest.from_bytes(written, version=1)
            times[name]["write"].append(wrote - started)
            times[name]["parse"].append(time.perf_counter() - wrote)
    print(f"manifest of {len(parsed['current'].tensors)} tensors, {len(raw) / 1e6:.2f} MB; medians of {args.repeat}")
    print("| format.py | write (to_bytes) | parse (from_bytes) | bytes written |\n|---|---|---|---|")
    for name in modules:
        print(f"| {name} | {statistics.median(times[name]['write']) * 1e3:.1f} ms "
              f"| {statistics.median(times[name]['parse']) * 1e3:.1f} ms | {len(parsed[name].to_bytes()):,} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
