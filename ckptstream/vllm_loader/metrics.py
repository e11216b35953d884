"""Prometheus metrics of a follower (``--metrics-port``): a ``FollowerObserver`` on its own registry.

Each follower has its own ``CollectorRegistry`` (never prometheus_client's global one: several followers may
live in one process, e.g. the servers of a fleet in Ray actors), and every metric carries the labels
``replica`` (the replica id) and ``stream`` (the stream URL), so that the scrapes of a fleet are told apart.
The docs site lists the metrics (docs/reference/metrics.md, generated from the registries here).
"""

from __future__ import annotations

import logging
import math
import threading
import time
import urllib.parse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from ..credentials import redact
from ..reader import ReplicaRecord
from .observe import FollowerObserver, UpdateRecord

SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
"""Histogram buckets of the per-update durations: a small delta's reload takes milliseconds, a large model's
fetch minutes."""
LABELS = ("replica", "stream")

log = logging.getLogger("ckptstream.follow")


class FollowerMetrics(FollowerObserver):
    """The metrics of one follower, fed by its reports; ``registry`` is what a scrape reads."""

    def __init__(self, replica_id: str, stream_url: str, *, adapter: bool = False):
        self.registry = CollectorRegistry()
        self._lock = threading.Lock()
        self._resident: list[int] = []
        self.resident_versions: Gauge | None = None  # an adapter stream's follower only
        self._served: int | None = None
        self._newest: int | None = None
        self._heartbeat: float | None = None
        labels = {"replica": replica_id, "stream": _public_url(stream_url)}
        self._labels = labels

        def gauge(name: str, text: str) -> Gauge:
            return Gauge(name, text, LABELS, registry=self.registry).labels(**labels)

        def counter(name: str, text: str) -> Counter:
            return Counter(name, text, LABELS, registry=self.registry).labels(**labels)

        def histogram(name: str, text: str) -> Histogram:
            return Histogram(name, text, LABELS, buckets=SECONDS_BUCKETS, registry=self.registry).labels(**labels)

        gauge("ckptstream_version_served", "The version every server of the follower serves (an adapter "
              "stream's: the version its stable adapter name means; NaN before the first)"
              ).set_function(lambda: _or_nan(self._served))
        if adapter:  # the staleness window of an adapter stream: versions oldest..served answer by name
            gauge("ckptstream_adapter_versions_resident", "Versions of the adapter stream every server holds "
                  "as <name>@<version>").set_function(lambda: float(len(self._resident)))
            gauge("ckptstream_adapter_oldest_resident_version", "The oldest version every server holds "
                  "(NaN before the first)").set_function(lambda: _or_nan(min(self._resident, default=None)))
            # one series per resident version (--keep of them, and older ones while requests use them): a gap
            # left by a refused version shows, which a count and the oldest cannot say
            self.resident_versions = Gauge("ckptstream_adapter_version_resident", "1 for each version every "
                                           "server holds as <name>@<version>", (*LABELS, "version"),
                                           registry=self.registry)
        gauge("ckptstream_versions_behind", "Newest committed version not refused minus the version served "
              "(NaN while unknown: a pinned follower, or the newest was just refused)").set_function(self._behind)
        gauge("ckptstream_heartbeat_age_seconds", "Seconds since the follower last reported (its replica "
              "record's heartbeat), at scrape time").set_function(self._heartbeat_age)
        self.commit_to_serving = gauge("ckptstream_commit_to_serving_seconds",
                                       "Seconds from the commit of the last version loaded to serving it")
        self.commit_to_serving.set(math.nan)
        self.updates = counter("ckptstream_updates_total", "Versions loaded into the servers")
        self.fetched = counter("ckptstream_fetched_bytes_total", "Bytes the updates read from the stream's storage "
                               "(measured where the reads happen)")
        self.refused = Counter("ckptstream_refused_versions_total", "Versions refused, by reason (see "
                               "observe.REFUSAL_REASONS)", (*LABELS, "reason"), registry=self.registry)
        self.errors = counter("ckptstream_errors_total", "Rounds failed for a cause not the version's "
                              "(storage or a server away), retried")
        self.pause = histogram("ckptstream_pause_seconds", "Seconds the servers were paused per update "
                               "(all of them, one after the other)")
        self.fetch = histogram("ckptstream_fetch_seconds", "Seconds of an update's preparation with a storage "
                               "read in flight")
        self.decode = histogram("ckptstream_decode_seconds", "Seconds of an update's preparation spent decoding "
                                "with no read outstanding")
        self.reload = histogram("ckptstream_reload_seconds", "Seconds inside vLLM's reload_weights (or the "
                                "in-place apply) per update")
        self.in_place = counter("ckptstream_in_place_updates_total", "Server updates applied in place")
        self.fallbacks = Counter("ckptstream_full_reload_fallbacks_total", "Server updates reloaded fully instead "
                                 "of in place, by reason (see observe.FALLBACK_REASONS)", (*LABELS, "reason"),
                                 registry=self.registry)

    def serve(self, host: str = "127.0.0.1", port: int = 0) -> MetricsServer:
        """Serve these metrics at ``http://host:port/metrics`` (port 0: a free one) until the server's
        ``close()``; the URL is logged."""
        server = MetricsServer(self.registry, host, port)
        log.info("metrics at %s", server.url)
        return server

    def on_report(self, record: ReplicaRecord) -> None:
        with self._lock:
            self._heartbeat = record.heartbeat
            self._served = record.version
            left, self._resident = set(self._resident) - set(record.resident), list(record.resident)
            if self.resident_versions is not None:
                for version in left:
                    self.resident_versions.remove(self._labels["replica"], self._labels["stream"], str(version))
                for version in record.resident:
                    self.resident_versions.labels(**self._labels, version=str(version)).set(1)

    def on_discovered(self, newest: int) -> None:
        with self._lock:
            self._newest = newest

    def on_update(self, update: UpdateRecord) -> None:
        self.updates.inc()
        self.fetched.inc(update.bytes_fetched)
        self.commit_to_serving.set(update.lag_s)
        self.pause.observe(update.pause_s)
        self.fetch.observe(update.fetch_s)
        self.decode.observe(update.decode_s)
        self.reload.observe(update.reload_s)
        self.in_place.inc(update.applied_in_place)
        for reason, servers in update.fallbacks.items():
            self.fallbacks.labels(**self._labels, reason=reason).inc(servers)

    def on_refused(self, version: int, reason: str, error: BaseException) -> None:
        self.refused.labels(**self._labels, reason=reason).inc()
        with self._lock:
            if self._newest == version:  # not the newest good version after all: unknown until the next look
                self._newest = None

    def on_error(self, error: BaseException, retry_in: float) -> None:
        self.errors.inc()

    def _behind(self) -> float:
        with self._lock:
            if self._served is None or self._newest is None:
                return math.nan
            return float(max(0, self._newest - self._served))

    def _heartbeat_age(self) -> float:
        with self._lock:
            return math.nan if self._heartbeat is None else time.time() - self._heartbeat


class MetricsServer:
    """``/metrics`` of ``registry`` over HTTP on ``host:port`` (port 0: a free one, see ``url``), served by
    a daemon thread until ``close()``."""

    def __init__(self, registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0):
        self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        bound = self._server.server_address[1]
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{bound}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)


def _or_nan(value: int | None) -> float:
    return math.nan if value is None else float(value)


def _public_url(url: str) -> str:
    """``url`` without credentials or query (a label is visible to whoever scrapes)."""
    parts = urllib.parse.urlsplit(redact(url))
    if not parts.scheme or not parts.netloc:
        return parts.geturl()
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))
