"""Every Prometheus metric ckptstream exports, read from the code's own registries: a follower's (an adapter
stream's follower, which has all of them) and a relay's. The docs' metrics reference is generated from it, and
a dashboard's queries can be checked against it (tests/test_dashboard.py does so for launch/grafana/)."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass

SERIES_SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum", "_created"),
                   "gauge": ("",)}
"""The series a metric family of each type exposes in Prometheus text (prometheus_client's naming)."""


@dataclass(frozen=True)
class MetricFamily:
    """One exported metric: ``name`` as queried (a counter's with ``_total``), its type, help and exporter."""

    name: str
    type: str
    help: str
    exporter: str  # "follower" (follow, serve, a fleet's servers) or "relay"
    series: tuple[str, ...]  # every series name of the family, e.g. a histogram's _bucket, _count, _sum


def exported_metrics() -> list[MetricFamily]:
    """The metric families of a follower (``--metrics-port``) and of ``ckptstream relay`` (``/metrics``), in the
    order the code defines them. Imports prometheus_client, starlette and uvicorn (extras ``relay``)."""
    from ..relay import Relay
    from ..vllm_loader.metrics import FollowerMetrics

    families = _families(FollowerMetrics("replica", "stream", adapter=True).registry, "follower")
    with tempfile.TemporaryDirectory() as directory:  # a relay's registry exists before it serves anything
        families += _families(Relay(directory).registry, "relay")
    return families


def exported_series() -> set[str]:
    """Every series name ckptstream exports (what a PromQL query may name)."""
    return {series for family in exported_metrics() for series in family.series}


def _families(registry, exporter: str) -> list[MetricFamily]:
    out = []
    for family in registry.collect():
        series = tuple(family.name + suffix for suffix in SERIES_SUFFIXES[family.type])
        name = family.name + ("_total" if family.type == "counter" else "")
        out.append(MetricFamily(name, family.type, family.documentation, exporter, series))
    return out
