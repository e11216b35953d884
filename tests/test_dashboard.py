"""The Grafana dashboard (launch/grafana/ckptstream.json, docs/guides/monitoring.md) queries only metrics the code
exports, read from the follower's and the relay's own registries (``ckptstream.testing.metrics``), and shows
what an operator of a rollout fleet looks for."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterator

import pytest

pytest.importorskip("prometheus_client")
pytest.importorskip("starlette")

from ckptstream.testing.metrics import exported_metrics, exported_series  # noqa: E402

DASHBOARD = Path(__file__).resolve().parent.parent / "launch" / "grafana" / "ckptstream.json"
METRIC = re.compile(r"\bckptstream_\w+")
SHOWN = ("ckptstream_version_served", "ckptstream_versions_behind", "ckptstream_commit_to_serving_seconds",
         "ckptstream_pause_seconds_bucket", "ckptstream_full_reload_fallbacks_total", "ckptstream_fetched_bytes_total",
         "ckptstream_refused_versions_total", "ckptstream_relay_sent_bytes_total",
         "ckptstream_relay_dropped_connections_total", "ckptstream_adapter_versions_resident")
"""What the dashboard is for (issue 39): per replica the version served and the lag behind the newest,
commit→serving and pauses, fallbacks by reason, bytes fetched, refused versions, relay egress and dropped
connections, adapter versions resident."""


def _queries(node: Any) -> Iterator[str]:
    """Every PromQL text of the dashboard: panels' ``expr`` and the template variables' queries."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("expr", "definition") and isinstance(value, str):
                yield value
            elif key == "query" and isinstance(value, (str, dict)):
                yield from ([value] if isinstance(value, str) else _queries(value))
            else:
                yield from _queries(value)
    elif isinstance(node, list):
        for item in node:
            yield from _queries(item)


def test_every_metric_queried_is_exported() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    queried = {name for query in _queries(dashboard) for name in METRIC.findall(query)}
    exported = exported_series()
    assert queried - exported == set(), f"not exported by ckptstream: {sorted(queried - exported)}"
    assert set(SHOWN) <= queried, f"not shown: {sorted(set(SHOWN) - queried)}"


def test_every_exported_family_is_shown() -> None:
    """A metric added to the code without a panel shows up here (the dashboard is the operator's picture)."""
    queried = " ".join(_queries(json.loads(DASHBOARD.read_text())))
    families = {family.name: family.series for family in exported_metrics()}
    left_out = [name for name, series in families.items() if not any(s in queried for s in series)]
    assert left_out == []


def test_panels_are_well_formed() -> None:
    """Unique panel ids, a Prometheus data source from the dashboard's variable on every query panel."""
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "stream", "replica", "relay"} <= variables
    for panel in panels:
        if panel["type"] != "row":
            assert panel["targets"] and panel["datasource"]["uid"] == "${datasource}", panel["title"]
