"""Serving a follower's (or node agent's) Prometheus metrics when asked to (``--metrics-port``): the one place that
imports ``metrics.py``, and only then (prometheus_client is an optional extra)."""

from __future__ import annotations

from typing import Any

from ..reader import ReplicaRecord
from .observe import FollowerObserver


def attach_metrics(observers: list[FollowerObserver], record: ReplicaRecord, stream_url: str, host: str,
                   port: int | None) -> Any:
    """With ``port`` given, serve Prometheus metrics of ``record``'s follower or node agent (of the stream at
    ``stream_url``) at
    ``http://host:port/metrics`` (0: a free port), fed as one more of its ``observers``, and note their URL
    in the record; returns the metrics server to close (None without ``port``)."""
    if port is None:
        return None
    from .metrics import FollowerMetrics  # prometheus_client only when asked for (an optional extra)

    metrics = FollowerMetrics(record.replica_id, stream_url, adapter=record.adapter is not None)
    server = metrics.serve(host, port)
    observers.append(metrics)
    record.metrics_url = server.url
    return server

