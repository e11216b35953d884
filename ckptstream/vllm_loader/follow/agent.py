"""The node agent: on every node of a multi-node vLLM engine but the head, prepare each new version into
this node's cache, at the path the head will name in ``reload_weights``.

vLLM's workers read ``weights_path`` on their own node, so the head (a ``Follower`` with
``nodes_ready_timeout``) reloads a version only once every rank reports it complete there
(``worker.WorkerExtension``). The agent drives no server: it discovers, decodes (a delta applied to its newest
cached version, as the follower does: ``VersionCache.acquire``) and reports, in a replica record of kind
``node`` naming its engine and node rank. It keeps the newest version and the one the engine serves (every
rank reloads that one if an update fails on any rank), which it learns from its own node: the engine's
workers there hold it in the cache (``cache.hold_served``, which the head has them do after each update), so
it needs no record of the head's, and a read-only stream (HTTP, a relay) serves as well as a writable one.
Until the workers hold a version (the head has them do it once the engine answers), the version prepared last
counts as served: the one vLLM was started on.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from ...credentials import redact
from ...errors import CkptStreamError, VersionNotFoundError
from ...polling import poll
from ...reader import ReplicaRecord, Stream, replica_path
from ...reader.replicas import KIND_NODE
from ...storage import Watch
from ...format import MANIFESTS_DIR, STREAM_KIND_WEIGHTS
from .cache import VersionCache, default_cache_dir, safe_owner
from .config import FollowerConfig
from ..metrics_server import attach_metrics
from ..observe import FollowerObserver, ReplicaRecordWriter, notify, refusal_reason

log = logging.getLogger("ckptstream.agent")


def node_record_id(engine: str, node_rank: int) -> str:
    """The replica id of node ``node_rank``'s agent of ``engine``."""
    return f"{engine}-node{node_rank}"


class NodeAgent:
    """Keeps one node's cache on the stream's newest version for a multi-node engine.

    Args:
        url: stream URL.
        engine: the engine's id: its head's replica id (the same on every node; it also names the cache
            directory, so that the version's path is the same on every node).
        node_rank: this node's rank in the engine (1 .. nnodes-1).
        nnodes: nodes of the engine.
        config: the follower options that apply (``storage_options``, ``cache_dir``, ``pin``,
            ``poll_interval``, ``heartbeat_interval``, ``list_every``, ``observers``, ``metrics_port``,
            ``metrics_host``); ``options`` override fields. Its observers get ``on_report``,
            ``on_discovered``, ``on_refused`` and ``on_error`` (it loads no server: no ``on_update``); in its
            metrics, ``ckptstream_version_served`` is the newest version complete in this node's cache.
    """

    def __init__(self, url: str, *, engine: str, node_rank: int, nnodes: int,
                 config: FollowerConfig | None = None, **options: Any):
        config = (config or FollowerConfig()).with_options(**options)
        self.config = config
        self.engine = safe_owner(engine)
        self.stream = Stream(url, storage_options=config.storage_options)
        self.stream.require_kind(STREAM_KIND_WEIGHTS)
        record_id = node_record_id(self.engine, node_rank)
        replica_path(record_id)  # a ValueError now rather than at every report
        self.cache = VersionCache(config.cache_dir or default_cache_dir(), self.stream.info().stream_id,
                                  self.engine)
        self.pin = config.pin
        self.current: int | None = None
        self.record = ReplicaRecord(replica_id=record_id, kind=KIND_NODE, engine=self.engine, node_rank=node_rank,
                                    nnodes=nnodes, host=socket.gethostname(), pid=os.getpid(), pin=config.pin)
        self.wake = threading.Event()
        self._lock = threading.Lock()
        self._polls = 0
        self.observers: list[FollowerObserver] = [ReplicaRecordWriter(self.stream.storage, log), *config.observers]
        self.metrics_server = attach_metrics(self.observers, self.record, url, config.metrics_host,
                                             config.metrics_port)

    def close(self) -> None:
        """Release the cached versions it holds; stop serving metrics."""
        self.cache.close()
        if self.metrics_server is not None:
            self.metrics_server.close()
            self.metrics_server = None

    def __enter__(self) -> NodeAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def prepare(self, version: int) -> Path:
        """Decode ``version`` into this node's cache (complete, with its marker) and report it."""
        served = self.served()
        path, base, fetched, _ = self.cache.acquire(self.stream, version, keep=served,
                                                    holder=f"node agent {self.record.replica_id}")
        self.current = version
        self.cache.prune({version} | served)  # the base is done with, unless the engine serves it
        log.info("version %d ready in %s (%.1f MB fetched%s)", version, path, fetched / 1e6,
                 "" if base is None or base == version else f", delta on cached {base}")
        self._report(version=version, state="serving", last_error=None)
        return path

    def step(self) -> int | None:
        """Prepare the newest version (or the pin) if it is not the current one; returns it if prepared."""
        target = self._discover()
        if target is None or str(target) in self.record.refused:
            return None
        if self.pin is None:
            notify(self.observers, "on_discovered", target)
        if target == self.current:
            return None
        try:
            self.prepare(target)
        except VersionNotFoundError as exc:  # retired between discovery and fetch: move on
            log.info("version %d is gone (%s)", target, exc)
            return None
        except CkptStreamError as exc:  # corrupt or foreign: the head refuses it too
            with self._lock:
                self.record.refused[str(target)] = str(exc)
            log.error("cannot prepare version %d: %s", target, exc)
            notify(self.observers, "on_refused", target, refusal_reason(exc), exc)
            self._report(last_error=str(exc))
            return None
        return target

    def run(self, stop: threading.Event) -> None:
        """Prepare new versions until ``stop`` is set, heartbeating meanwhile (also during long decodes)."""
        heartbeat = threading.Thread(target=self._heartbeat, args=(stop,), daemon=True,
                                     name="ckptstream-agent-heartbeat")
        heartbeat.start()
        watcher: Watch | None = self.stream.storage.watch(MANIFESTS_DIR, self.wake.set)

        def failed(exc: Exception, wait: float) -> None:  # storage away: keep what is cached, retry
            self._report(state="error", last_error=f"{type(exc).__name__}: {redact(exc)}")
            log.warning("%s; retrying in %.0f s", redact(exc), wait)
            notify(self.observers, "on_error", exc, wait)

        try:
            # any error: storage away must not end the agent, which keeps what is cached
            poll(stop, self.wake, self.step, interval=self.config.poll_interval, on_error=failed,
                 retry=(Exception,))
        finally:
            if watcher is not None:
                watcher.stop()
            self._report(state="stopped")

    def _discover(self) -> int | None:
        """The pin, or the newest version: a probe of the next manifest per poll, a listing at first and
        every ``list_every`` polls (versions may skip numbers)."""
        if self.pin is not None:
            return self.pin
        self._polls += 1
        if self.current is not None and self._polls % max(1, self.config.list_every):
            newest = self.current
            while self.stream.has_version(newest + 1):
                newest += 1
            return newest
        listed = self.stream.versions()
        return listed[-1] if listed else None

    def served(self) -> set[int]:
        """What the engine serves on this node: the versions its workers hold in the cache
        (``VersionCache.served``); until they hold one, the version prepared last (vLLM's start version)."""
        return self.cache.served() or {v for v in (self.current,) if v is not None}

    def _report(self, **changes: Any) -> None:
        with self._lock:
            for key, value in changes.items():
                setattr(self.record, key, value)
            self.record.heartbeat = time.time()
            record = ReplicaRecord(**{**self.record.__dict__, "refused": dict(self.record.refused)})
        notify(self.observers, "on_report", record)

    def _heartbeat(self, stop: threading.Event) -> None:
        while not stop.wait(self.config.heartbeat_interval):
            self._report()
