#!/usr/bin/env python3
"""Benchmark: 4 followers of one stream on one host sharing one cache, against 4 independent caches.

Four ``Follower`` processes, each driving a ``FakeVllmClient`` server (the weights are fetched, decoded and
hash-checked exactly as beside vLLM; only the reload is not), follow a synthetic model
(``ckptstream.testing.models``) through a few delta versions, in two setups, one after the other in one run:

- shared: the 4 followers on one cache root (one decode per version, the others reuse it);
- independent: 4 cache roots (what every follower did before the shared cache: 4 decodes per version).

Per version: decodes (counted from the followers' update records), CPU seconds of the 4 followers between
two versions (decode, checks, polling: everything), and the time from the commit of the version until all
4 serve it. Medians over the versions, side by side.

    python tools/bench_follow_shared.py                      # 128 MB model, 4 versions
    python tools/bench_follow_shared.py --size 512MB --versions 6
"""

from __future__ import annotations

import argparse
import multiprocessing
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckptstream import Publisher  # noqa: E402
from ckptstream.cli.options import parse_bytes  # noqa: E402
from ckptstream.testing.models import TinyModelSpec, rl_like_step, tiny_state_dict  # noqa: E402

FOLLOWERS = 4


def follow(url: str, cache_dir: str, replica_id: str, ready, reports, stop) -> None:
    """In a child process: one follower on a fake server, reporting (follower, version, decoded, wall
    clock, process CPU seconds) at each update."""
    from ckptstream.testing.fake_vllm import FakeVllmClient
    from ckptstream.vllm_loader import Follower, OnUpdate

    def report(update) -> None:
        reports.put((replica_id, update.version, update.decoded, time.time(), time.process_time()))

    with Follower(url, [FakeVllmClient()], cache_dir=cache_dir, replica_id=replica_id, poll_interval=0.05,
                  observers=[OnUpdate(report)]) as follower:
        ready.put(replica_id)
        halt = threading.Event()
        threading.Thread(target=lambda: (stop.wait(), halt.set(), follower.wake.set()), daemon=True).start()
        follower.run(halt)


def run_setup(name: str, url: str, publisher: Publisher, state: dict, roots: list[Path], start: int,
              versions: int, generator: torch.Generator) -> list[dict]:
    """Start 4 followers on ``roots`` (one root each, or the same one), wait for them to serve
    ``start``, the stream's newest version, then publish ``versions`` deltas one at a time; the figures
    of each."""
    context = multiprocessing.get_context("spawn")
    ready, reports, stop = context.Queue(), context.Queue(), context.Event()
    ids = [f"{name}-{i}" for i in range(FOLLOWERS)]
    children = [context.Process(target=follow, args=(url, str(roots[i]), ids[i], ready, reports, stop))
                for i in range(FOLLOWERS)]
    for child in children:
        child.start()
    rows = []
    try:
        for _ in children:
            ready.get(timeout=300)
        latest: dict[str, float] = {}  # replica id -> its CPU seconds at its last update

        def collect(version: int) -> list[tuple]:
            got = []
            while len(got) < FOLLOWERS:
                rid, v, decoded, wall, cpu = reports.get(timeout=600)
                if v == version:
                    got.append((rid, decoded, wall, cpu))
                latest[rid] = cpu
            return got

        collect(start)  # every follower loads the newest version first
        for _ in range(versions):
            rl_like_step(state, fraction=0.2, max_ulps=40, generator=generator)
            before = dict(latest)
            manifest = publisher.publish(state).result()
            committed = time.time()
            got = collect(manifest.version)
            rows.append(dict(version=manifest.version, decodes=sum(d for _, d, _, _ in got),
                             cpu=sum(cpu - before[rid] for rid, _, _, cpu in got),
                             all_serving=max(wall for _, _, wall, _ in got) - committed,
                             stored=manifest.stored_bytes))
            r = rows[-1]
            print(f"  {name:11} version {r['version']}: delta {r['stored'] / 1e6:6.1f} MB, {r['decodes']} decodes, "
                  f"{r['cpu']:5.2f} CPU s, all {FOLLOWERS} serving {r['all_serving']:5.2f} s after the commit",
                  flush=True)
    finally:
        stop.set()
        for child in children:
            child.join(60)
            if child.is_alive():
                child.kill()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=parse_bytes, default=parse_bytes("128MB"))
    parser.add_argument("--versions", type=int, default=4, help="delta versions per setup (default 4)")
    parser.add_argument("--dir", help="work directory (default: a temp dir, removed)")
    args = parser.parse_args()

    root = Path(args.dir or tempfile.mkdtemp(prefix="ckptstream-bench-shared-"))
    spec = TinyModelSpec.for_size(args.size)
    state = tiny_state_dict(spec)
    full = sum(t.numel() * t.element_size() for t in state.values())
    print(f"model: {spec.arch}, {spec.num_layers} layers, hidden {spec.hidden_size}, {full / 1e6:.0f} MB bf16; "
          f"{FOLLOWERS} followers (processes, fake servers); {args.versions} delta versions per setup, 20% of "
          f"elements changed each; {multiprocessing.cpu_count()} CPUs")
    url = str(root / "stream")
    generator = torch.Generator().manual_seed(0)
    results = {}
    with Publisher(url, keyframe_every=1000) as publisher:
        start = publisher.publish(state).result().version
        # The setups one after the other, each on fresh roots, from the stream's newest version.
        results["independent"] = run_setup("independent", url, publisher, state,
                                           [root / f"cache-{i}" for i in range(FOLLOWERS)], start, args.versions,
                                           generator)
        results["shared"] = run_setup("shared", url, publisher, state, [root / "cache"] * FOLLOWERS,
                                      results["independent"][-1]["version"], args.versions, generator)

    def med(setup: str, key: str) -> float:
        return statistics.median(r[key] for r in results[setup])

    print()
    print(f"{'median per version':44} {'independent':>12} {'shared':>8}")
    print(f"{'decodes (4 followers)':44} {med('independent', 'decodes'):12.0f} {med('shared', 'decodes'):8.0f}")
    print(f"{'CPU seconds (4 followers)':44} {med('independent', 'cpu'):12.2f} {med('shared', 'cpu'):8.2f}")
    print(f"{f'commit -> all {FOLLOWERS} serving (s)':44} {med('independent', 'all_serving'):12.2f} "
          f"{med('shared', 'all_serving'):8.2f}")
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
