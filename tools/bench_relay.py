#!/usr/bin/env python3
"""Benchmark: bytes at the origin for N followers at a remote site, without and with a site relay.

The origin stream is served over HTTP by a ``Relay`` that counts the bytes it sends (standing in for the
trainer's storage across the WAN). Without a site relay, N followers each pull the newest version from the
origin. With one, ``mirror`` carries the stream once into the site's directory, a second ``Relay`` serves
it there, and the N followers pull from that. Each follower drives a ``FakeVllmClient`` (the weights are
pulled and decoded exactly as beside vLLM; only the reload is not sent to a server), with its own cache.
Byte counts are exact, not timings: one run suffices.

    python tools/bench_relay.py                        # 4 followers, 64 MB model, 4 versions
    python tools/bench_relay.py --followers 8 --size 256MB --json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckptstream import Publisher, Stream  # noqa: E402
from ckptstream.cli.options import parse_bytes  # noqa: E402
from ckptstream.format import manifest_path  # noqa: E402
from ckptstream.mirror import Mirror  # noqa: E402
from ckptstream.relay import Relay  # noqa: E402
from ckptstream.storage import open_storage  # noqa: E402
from ckptstream.testing.fake_vllm import FakeVllmClient  # noqa: E402
from ckptstream.testing.models import TinyModelSpec, rl_like_step, tiny_state_dict  # noqa: E402
from ckptstream.vllm_loader import Follower  # noqa: E402


def follow_once(url: str, followers: int, work: Path, tag: str) -> None:
    """``followers`` followers of ``url``, each bringing its server to the newest version once."""
    for index in range(followers):
        server = FakeVllmClient()
        with Follower(url, [server], cache_dir=work / f"cache-{tag}-{index}", replica_id=f"{tag}-{index}") as f:
            update = f.step()
            assert update is not None and server.loaded_version == update.version


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--followers", type=int, default=4)
    parser.add_argument("--size", type=parse_bytes, default=parse_bytes("64MB"))
    parser.add_argument("--steps", type=int, default=4, help="versions: a keyframe, then deltas")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="ckptstream-bench-relay-"))
    try:
        origin = work / "origin"
        state = tiny_state_dict(TinyModelSpec.for_size(args.size))
        generator = torch.Generator().manual_seed(0)
        with Publisher(str(origin), keyframe_every=args.steps + 1) as publisher:
            for step in range(args.steps):
                if step:
                    rl_like_step(state, generator=generator)
                publisher.publish(state).result()
        stream = Stream(str(origin))
        # What a copy of the stream holds: the data files and the manifests (which name every chunk and its
        # checks: a few percent of a small delta version).
        stored = sum(stream.manifest(v).stored_bytes + (origin / manifest_path(v)).stat().st_size
                     for v in stream.versions())

        with Relay(origin) as wan:  # every follower across the WAN
            follow_once(wan.url, args.followers, work, "direct")
            direct = wan.sent_bytes
        with Relay(origin) as wan:  # one mirror across the WAN, the followers at the site
            Mirror(Stream(wan.url), open_storage(str(work / "site"))).run_once()
            with Relay(work / "site") as site:
                follow_once(site.url, args.followers, work, "relayed")
                site_bytes = site.sent_bytes
            relayed = wan.sent_bytes
        figures = {"followers": args.followers, "versions": args.steps, "stored_bytes": stored,
                   "origin_bytes_without_relay": direct, "origin_bytes_with_relay": relayed,
                   "site_relay_bytes": site_bytes, "without_relay_x": direct / stored,
                   "with_relay_x": relayed / stored}
        if args.json:
            print(json.dumps(figures))
            return
        print(f"{args.followers} followers, {args.steps} versions, {stored / 1e6:.1f} MB stored (keyframe + deltas)")
        print(f"  origin bytes, every follower across the WAN: {direct / 1e6:9.1f} MB  ({direct / stored:.2f}x)")
        print(f"  origin bytes, mirror + site relay:           {relayed / 1e6:9.1f} MB  ({relayed / stored:.2f}x)")
        print(f"  bytes the site relay served its followers:   {site_bytes / 1e6:9.1f} MB  "
              f"({site_bytes / stored:.2f}x)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
