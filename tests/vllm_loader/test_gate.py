"""The follower's update gate (``FollowerConfig.update_gate``) against fake servers: where it is entered
and exited around each server's update, also when the update fails; a gate that cannot be entered makes
the follower retry, not refuse the version. Real servers behind a real router: tests/fleet/test_rolling.py."""

from __future__ import annotations

import contextlib
from typing import Iterator

import pytest
import torch

from ckptstream import Publisher
from ckptstream.errors import RouterError, VllmError
from ckptstream.testing.fake_vllm import FakeVllmClient
from ckptstream.vllm_loader import Follower


class RecordingGate:
    def __init__(self, events: list, fail_enter: int = 0):
        self.events, self.fail_enter = events, fail_enter

    @contextlib.contextmanager
    def hold(self, server_url: str, version: int) -> Iterator[None]:
        if self.fail_enter:
            self.fail_enter -= 1
            raise RouterError("does not answer", router="http://router:1", worker=server_url)
        self.events.append(("enter", server_url, version))
        try:
            yield
        finally:
            self.events.append(("exit", server_url, version))


@pytest.fixture
def stream(tmp_path):
    url = str(tmp_path / "stream")
    publisher = Publisher(url, keyframe_every=1000)
    publisher.publish({"w": torch.zeros(16, dtype=torch.bfloat16)}).result()
    yield url, publisher
    publisher.close()


def _servers(events: list) -> list[FakeVllmClient]:
    servers = [FakeVllmClient(), FakeVllmClient()]
    for server in servers:
        server.on_call = lambda method, _, url=server.url: events.append((method, url))
    return servers


def test_each_server_is_updated_inside_the_gate_one_at_a_time(stream, tmp_path):
    url, _ = stream
    events: list = []
    a, b = _servers(events)
    with Follower(url, [a, b], cache_dir=tmp_path / "cache", update_gate=RecordingGate(events)) as follower:
        assert follower.step().version == 0
    steps = [e for e in events if e[0] in ("enter", "exit", "pause", "probe")]
    assert steps == [("enter", a.url, 0), ("pause", a.url), ("probe", a.url), ("exit", a.url, 0),
                     ("enter", b.url, 0), ("pause", b.url), ("probe", b.url), ("exit", b.url, 0)]


def test_a_failed_update_is_rolled_back_before_each_gate_is_exited(stream, tmp_path):
    url, publisher = stream
    events: list = []
    a, b = _servers(events)
    with Follower(url, [a, b], cache_dir=tmp_path / "cache", update_gate=RecordingGate(events)) as follower:
        follower.step()
        publisher.publish({"w": torch.ones(16, dtype=torch.bfloat16)}).result()
        b.fail("reload_weights", VllmError("reload failed half-way"))
        events.clear()
        assert follower.step() is None and 1 in follower.refused
    # b got version 0 back inside its pause, then a (updated already) was rolled back inside its own gate.
    assert [e for e in events if e[0] in ("enter", "exit")] == [
        ("enter", a.url, 1), ("exit", a.url, 1), ("enter", b.url, 1), ("exit", b.url, 1),
        ("enter", a.url, 1), ("exit", a.url, 1)]
    last_reload_a = max(i for i, e in enumerate(events) if e == ("reload_weights", a.url))
    assert last_reload_a < len(events) - 1 and events[-1] == ("exit", a.url, 1)
    assert (a.loaded_version, b.loaded_version) == (0, 0) and not a.paused and not b.paused


def test_a_gate_that_cannot_be_entered_leaves_the_servers_alone_and_the_version_is_retried(stream, tmp_path):
    url, _ = stream
    events: list = []
    (a,) = _servers(events)[:1]
    gate = RecordingGate(events, fail_enter=1)
    with Follower(url, [a], cache_dir=tmp_path / "cache", update_gate=gate) as follower:
        with pytest.raises(RouterError):
            follower.step()  # run() backs off and retries
        assert follower.refused == {} and a.calls_of("pause") == []
        assert follower.step().version == 0
    assert a.loaded_version == 0
