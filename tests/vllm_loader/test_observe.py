"""The follower's reports through its observers (``observe.py``) and its Prometheus metrics (``metrics.py``),
against fake servers: the events and their order, the metrics scraped over HTTP against the updates and the
replica record, the ``--json`` lines. The real-vLLM counterpart is in test_follower.py (``serve
--metrics-port``)."""

from __future__ import annotations

import io
import json
import math
import threading
import time
import urllib.request
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from ckptstream import Publisher, Stream
from ckptstream.errors import (CkptStreamError, IntegrityError, MissingBaseError, ModelMismatchError, VllmError,
                               VllmUnreachable)
from ckptstream.format import data_path
from ckptstream.testing.fake_vllm import FakeVllmClient
from ckptstream.vllm_loader import Follower, FollowerObserver, JsonLines, UpdateRecord
from ckptstream.vllm_loader.observe import refusal_reason


def _state(step: int) -> dict[str, torch.Tensor]:
    weight = torch.zeros(16, dtype=torch.bfloat16)
    weight[step % 16] = float(step)
    return {"w": weight, "b": torch.full((4,), float(step))}


class Recorder(FollowerObserver):
    """Every event, in order, in a comparable form."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []
        self.updates: list[UpdateRecord] = []
        self.reported: list[tuple[Any, ...]] = []  # what each report says, heartbeats told apart by it

    def on_report(self, record) -> None:
        self.events.append(("report", record.state, record.version))
        self.reported.append((record.state, record.version, record.last_error, sorted(record.refused)))

    def on_discovered(self, newest: int) -> None:
        self.events.append(("discovered", newest))

    def on_update(self, update: UpdateRecord) -> None:
        self.updates.append(update)
        self.events.append(("update", update.version))

    def on_refused(self, version: int, reason: str, error: BaseException) -> None:
        self.events.append(("refused", version, reason))

    def on_error(self, error: BaseException, retry_in: float) -> None:
        self.events.append(("error", type(error).__name__))

    def distinct(self) -> list[tuple[Any, ...]]:
        """The events without heartbeats (a report saying what the report before said)."""
        out, reports, last = [], iter(self.reported), None
        for event in self.events:
            if event[0] == "report":
                said = next(reports)
                if said == last:
                    continue
                last = said
            out.append(event)
        return out


def _corrupt(url: str, version: int) -> None:
    manifest = Stream(url).manifest(version)
    stored = next(t for t in manifest.tensors if t.length)
    path = Path(url) / data_path(version, stored.file)
    data = bytearray(path.read_bytes())
    data[stored.offset] ^= 0x40
    path.write_bytes(bytes(data))


def _scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Samples of a /metrics page: (name, labels other than replica and stream) -> value."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("replica", "stream")))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture
def run(tmp_path: Path):
    """A stream, a follower on a fake server with a recording observer and metrics on a free port."""
    url = str(tmp_path / "stream")
    publisher = Publisher(url, keyframe_every=1000)
    publisher.publish(_state(0)).result()
    server, recorder = FakeVllmClient(), Recorder()
    follower = Follower(url, [server], cache_dir=tmp_path / "cache", replica_id="observed", poll_interval=0.01,
                        heartbeat_interval=0.05, observers=[recorder], metrics_port=0)
    yield url, publisher, server, recorder, follower
    follower.close()
    publisher.close()


def test_observers_see_updates_refusals_and_errors_in_order_and_metrics_match(run):
    url, publisher, server, recorder, follower = run
    assert follower.step().version == 0
    publisher.publish(_state(1)).result()
    assert follower.step().version == 1
    corrupt = publisher.publish(_state(2)).result().version
    _corrupt(url, corrupt)
    assert follower.step() is None
    behind = ("ckptstream_versions_behind", ())
    assert math.isnan(_scrape(follower.metrics_server.url)[behind])  # the newest good version: unknown until a look
    misshapen = publisher.publish({**_state(3), "b": torch.zeros(5)}, keyframe=True).result().version
    assert follower.step() is None
    assert recorder.distinct() == [
        ("discovered", 0), ("report", "updating", None), ("update", 0), ("report", "serving", 0),
        ("discovered", 1), ("report", "updating", 0), ("update", 1), ("report", "serving", 1),
        ("discovered", 2), ("report", "updating", 1), ("refused", 2, "integrity"), ("report", "serving", 1),
        ("discovered", 3), ("refused", 3, "model_mismatch"), ("report", "serving", 1)]

    # A server away: the round fails (an error, not a refusal), the next one loads the version.
    good = publisher.publish(_state(4), keyframe=True).result().version
    server.fail("reload_weights", VllmUnreachable("fake server restarting"))
    recorder.events.clear()
    recorder.reported.clear()
    stop = threading.Event()
    loop = threading.Thread(target=follower.run, args=(stop,))
    loop.start()
    try:
        deadline = time.monotonic() + 120  # the update's report, which follows the update itself
        while ("report", "serving", good) not in recorder.events:
            assert time.monotonic() < deadline, f"no report of serving version {good}: {recorder.events}"
            time.sleep(0.02)
        time.sleep(0.2)  # heartbeats meanwhile
        assert follower.current == good
        events = [e for e in recorder.distinct() if e[0] != "discovered"]
        events = events[events.index(("report", "updating", 1)):]  # heartbeats may come before the first round
        assert events[:5] == [("report", "updating", 1), ("report", "error", 1), ("error", "VllmUnreachable"),
                              ("report", "updating", 1), ("update", good)]
        assert events[5] == ("report", "serving", good)

        record = next(r for r in Stream(url).replicas() if r.replica_id == "observed")
        assert record.metrics_url == follower.metrics_server.url
        scraped = time.time()
        samples = _scrape(record.metrics_url)
    finally:
        stop.set()
        follower.wake.set()
        loop.join()

    updates = recorder.updates
    assert [u.version for u in updates] == [0, 1, good]
    assert samples[("ckptstream_version_served", ())] == record.version == good
    assert samples[("ckptstream_versions_behind", ())] == 0
    assert samples[("ckptstream_updates_total", ())] == len(updates)
    assert samples[("ckptstream_fetched_bytes_total", ())] == sum(u.bytes_fetched for u in updates) > 0
    assert samples[("ckptstream_commit_to_serving_seconds", ())] == pytest.approx(updates[-1].lag_s)
    for metric, field in [("pause", "pause_s"), ("fetch", "fetch_s"), ("decode", "decode_s"), ("reload", "reload_s")]:
        assert samples[(f"ckptstream_{metric}_seconds_count", ())] == len(updates)
        assert samples[(f"ckptstream_{metric}_seconds_sum", ())] == pytest.approx(
            sum(getattr(u, field) for u in updates))
    assert samples[("ckptstream_refused_versions_total", (("reason", "integrity"),))] == 1
    assert samples[("ckptstream_refused_versions_total", (("reason", "model_mismatch"),))] == 1
    assert set(record.refused) == {str(corrupt), str(misshapen)}
    assert samples[("ckptstream_errors_total", ())] == 1
    # Heartbeats every 0.05 s: the age at the scrape is the record's, within a heartbeat or so.
    assert 0 <= samples[("ckptstream_heartbeat_age_seconds", ())] < 1.0
    assert abs((scraped - record.heartbeat) - samples[("ckptstream_heartbeat_age_seconds", ())]) < 1.0
    for u in updates:
        assert u.fetch_s >= 0 and u.decode_s >= 0 and u.fetch_s + u.decode_s == pytest.approx(u.prepare_s)
        assert f"fetch {u.fetch_s:.2f} s + decode {u.decode_s:.2f} s" in u.log_line()


def test_json_lines_are_the_update_records(run):
    url, publisher, _, _, follower = run
    out = io.StringIO()
    follower.observers.append(JsonLines(out))
    first = follower.step()
    publisher.publish(_state(1)).result()
    second = follower.step()
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert lines == [asdict(first), asdict(second)]
    assert set(lines[0]) == {"version", "base_version", "bytes_fetched", "prepare_s", "pause_s", "reload_s", "lag_s",
                             "decoded", "fetch_s", "decode_s", "applied_in_place", "fallbacks", "cache_s", "stage_s",
                             "found_s", "servers_s"}
    # Why each was reloaded rather than applied in place: nothing served yet, then too much changed.
    assert [line["fallbacks"] for line in lines] == [{"first_version": 1}, {"large_change": 1}]


def test_an_observer_that_fails_stops_nothing_and_followers_in_one_process_have_their_own_metrics(run, tmp_path):
    url, publisher, server, recorder, follower = run

    class Broken(FollowerObserver):
        def on_update(self, update: UpdateRecord) -> None:
            raise RuntimeError("dashboard down")

    follower.observers.insert(0, Broken())
    assert follower.step().version == 0
    assert recorder.events[-2:] == [("update", 0), ("report", "serving", 0)]
    with Follower(url, [FakeVllmClient()], cache_dir=tmp_path / "cache", replica_id="other",
                  metrics_port=0) as other:
        assert other.metrics_server.url != follower.metrics_server.url
        assert other.step().version == 0
        publisher.publish(_state(1)).result()
        assert other.step().version == 1
        assert _scrape(other.metrics_server.url)[("ckptstream_updates_total", ())] == 2
        assert _scrape(follower.metrics_server.url)[("ckptstream_updates_total", ())] == 1
        labels = {s.labels["replica"] for f in text_string_to_metric_families(
            urllib.request.urlopen(other.metrics_server.url).read().decode()) for s in f.samples}
        assert labels == {"other"}
        closed = other.metrics_server.url
    with pytest.raises(OSError):  # close() stops serving them
        urllib.request.urlopen(closed, timeout=2)


def test_refusal_reasons_come_from_the_error_classes():
    assert refusal_reason(ModelMismatchError("x")) == "model_mismatch"
    assert refusal_reason(IntegrityError("x")) == "integrity"
    assert refusal_reason(MissingBaseError("x")) == "missing_base"
    assert refusal_reason(VllmError("x")) == "reload_failed"
    assert refusal_reason(CkptStreamError("x")) == "other"


def test_a_node_agent_reports_through_the_same_observers(tmp_path):
    from ckptstream.vllm_loader.follow.agent import NodeAgent

    url = str(tmp_path / "stream")
    recorder = Recorder()
    with Publisher(url, keyframe_every=1000) as publisher:
        publisher.publish(_state(0)).result()
        with NodeAgent(url, engine="eng", node_rank=1, nnodes=2, cache_dir=tmp_path / "cache", observers=[recorder],
                       metrics_port=0) as agent:
            assert agent.step() == 0
            corrupt = publisher.publish(_state(1)).result().version
            _corrupt(url, corrupt)
            assert agent.step() is None
            assert [e for e in recorder.distinct() if e[0] != "report"] == [
                ("discovered", 0), ("discovered", 1), ("refused", 1, "integrity")]
            (record,) = Stream(url).replicas()
            samples = _scrape(record.metrics_url)
    assert samples[("ckptstream_version_served", ())] == record.version == 0
    assert samples[("ckptstream_refused_versions_total", (("reason", "integrity"),))] == 1
    assert list(record.refused) == [str(corrupt)]
