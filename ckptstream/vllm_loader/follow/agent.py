"""The node agent: on every node of a multi-node vLLM engine but the head, prepare each new version into
this node's cache, at the path the head will name in ``reload_weights``, and the change the head applies in
place, at the path the head names in ``stage_change``.

Per new version, the agent first builds the change from the version the engine serves to the new one
(``change.py``: from the fetched deltas and its cached served version) into the node's cache, where every rank
of the node stages it once the head sees it on every node (``Follower._stage``); then it decodes the version
whole (from the same reads, kept in memory: each delta is read from storage once), for a full reload (a
fallback, a restart). With ``cache_versions`` 0 it decodes nothing on its own and keeps no whole version once
the engine loaded it: a version the head must reload is asked for through the engine's workers, which leave
a request file in the node's cache (``VersionCache.requested``), and the agent decodes it then.

vLLM's workers read ``weights_path`` on their own node, so the head (a ``Follower`` with
``nodes_ready_timeout``) reloads a version only once every rank reports it complete there
(``worker.WorkerExtension``). The agent drives no server: it discovers, decodes (a delta applied to its newest
cached version, as the follower does: ``VersionCache.acquire``) and reports, in a replica record of kind
``node`` naming its engine and node rank. It keeps the newest version and the one the engine serves (every
rank reloads that one if an update fails on any rank), which it learns from its own node: the engine's
workers there hold it in the cache by number (``cache.hold_served_version``, which the head has them do after
each update, in place or not), so
it needs no record of the head's, and a read-only stream (HTTP, a relay) serves as well as a writable one.
Until the workers hold a version (the head has them do it once the engine answers), the version prepared first
counts as served: the one vLLM was started on; while they hold none (the engine restarted), what they held last.
While the head applies a change, the workers hold the version it leads to (``cache.hold_staged``): the agent
keeps it, and prepares a newer version only once the engine serves it (the change to that one is built on it).
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
from ..inplace.change import (KEPT_DELTAS_BYTES, MAX_CHANGE_FRACTION, WHOLE, ChangeSummary,
                             build_change, build_change_from_stored)

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
            ``metrics_host``, ``apply_in_place``, ``cache_versions``); ``options`` override fields. Its
            observers get ``on_report``, ``on_discovered``, ``on_refused`` and ``on_error`` (it loads no server:
            no ``on_update``); in its metrics, ``ckptstream_version_served`` is the newest version prepared
            here.
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
        self._served: set[int] = set()  # what the workers held last (before they held any, the start version)
        self._held: set[int] = set()  # what they hold at this step's look (``_look``: one per step)
        self._staged: set[int] = set()  # what they stage a change to then (the head applies it)
        self._change_base: int | None = None  # the served version the change to the current one was built on
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
        path = self._decode(version)
        self._served = self._served or {version}  # the first one: vLLM's start version
        self.current = version
        self._report(version=version, state="serving", last_error=None)
        return path

    def update(self, version: int) -> None:
        """A new version: the change from the served version to it built into this node's cache first (what
        the head stages on every rank), then, unless ``cache_versions`` is 0, the version decoded whole (from
        the deltas' reads kept meanwhile). Logs what it read from storage."""
        read_before = self.stream.bytes_read()
        try:
            if self.config.cache_versions == 0:
                self.cache.prune(self._keep())  # no whole version: only the change
            base, problem = self._build_change(version)
            if self.config.cache_versions == 0:
                self.current = version
                self._report(version=version, state="serving", last_error=None)
            else:
                self.prepare(version)
                if base is not None and problem == WHOLE:  # (a keyframe between: both versions compared)
                    self._build_change(version, base)
        finally:
            self.stream.drop_kept_reads()
        log.info("version %d on node %d: %d bytes read from storage (cache_versions %d)", version,
                 self.record.node_rank, self.stream.bytes_read() - read_before, self.config.cache_versions)

    def _decode(self, version: int) -> Path:
        keep = self._keep()
        path, base, fetched, _ = self.cache.acquire(self.stream, version, keep=keep,
                                                    holder=f"node agent {self.record.replica_id}")
        self.cache.prune({version} | keep)  # the base is done with, unless the engine serves it
        log.info("version %d ready in %s (%.1f MB fetched%s)", version, path, fetched / 1e6,
                 "" if base is None or base == version else f", delta on cached {base}")
        return path

    def _build_change(self, version: int, compared: int | None = None) -> tuple[int | None, str | None]:
        """The change from the version the engine serves on this node to ``version`` in this node's cache, at
        the path the head stages (``VersionCache.change``): from the stored deltas alone where they carry change
        checks, else from them and the cached served version, or, with ``compared`` (the served version), by
        comparing both decoded versions. (The base used, or None where no change was built; the builder's
        problem, if any.)"""
        if not self.config.apply_in_place:
            return None, None
        base = compared
        if compared is None:
            base = self._change_base = self._served_base()
        if base is None or base >= version:
            return None, None  # nothing served yet
        held = base in self.cache.held()
        copy = self.cache.hold(base)
        if not copy:  # no copy of it here to build on (--cache-versions 0): from the deltas alone, or none
            if not held:
                self.cache.release(base)
            if compared is not None:
                return None, None
        built: list[ChangeSummary] = []
        stream_id = self.stream.info().stream_id

        def build(out: Path) -> None:
            if compared is not None:
                built.append(build_change(self.cache.path(base), self.cache.path(version), out,
                                          stream_id=stream_id, base=base, version=version,
                                          max_fraction=MAX_CHANGE_FRACTION))
                return
            with self.stream.keeping_reads(KEPT_DELTAS_BYTES):  # the decode reads them from memory
                built.append(build_change_from_stored(self.stream, out, base=base, version=version,
                                                      base_dir=self.cache.path(base) if copy else None,
                                                      max_fraction=MAX_CHANGE_FRACTION))

        try:
            change = self.cache.change(base, version, build)
        except Exception as exc:  # noqa: BLE001 - e.g. a corrupt delta: the decode refuses that; the head reloads
            self.stream.drop_kept_reads()
            log.warning("version %d: no change from version %d built here (%s); the head reloads it fully",
                        version, base, exc)
            return None, None
        problem = built[0].problem if built else None
        if change is not None:
            log.info("version %d: its change from version %d is in %s", version, base, change)
        elif problem != WHOLE:
            log.info("version %d: no change from version %d (%s); the head reloads it fully", version, base, problem)
        return base, problem

    def step(self) -> int | None:
        """Decode the versions the head asked for (``VersionCache.requested``), then prepare the newest version
        (or the pin) if it is not the current one (``update``), or else follow the engine to the version it
        serves now (``_rebase``); then delete what this node no longer needs. Returns the version prepared."""
        self._look()
        self._serve_requests()
        try:
            return self._advance()
        finally:
            self._tidy()

    def _advance(self) -> int | None:
        target = self._discover()
        if target is None or str(target) in self.record.refused:
            return None
        if self.pin is None:
            notify(self.observers, "on_discovered", target)
        if target == self.current:
            self._rebase()
            return None
        if self._staged - self._served:  # the head applies one: the next waits (no third whole copy, no change
            return None                  # built on the version served before it)
        try:
            self.update(target)
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

    def _serve_requests(self) -> None:
        """Decode each version the head asked for (a full reload of it is due: of a new version, or of the
        served one, which every rank reloads after a failed update or a restart) unless the engine serves a
        newer one already (the request is then dropped: the head moved on)."""
        served = self._held  # what the workers hold, never the start version standing in for it
        for version in sorted(self.cache.requested()):
            if served and version < max(served):
                self.cache.drop_request(version)
            elif version not in self.cache.held():  # (held: decoded here already)
                try:
                    self._decode(version)
                except CkptStreamError as exc:  # the head refuses it as well; asked again, decoded again
                    log.error("cannot prepare version %d asked for by the head: %s", version, exc)
                    self.cache.drop_request(version)

    def _tidy(self) -> None:
        """Delete what this node no longer needs (``_keep``); with ``cache_versions`` 0, every whole version the
        head does not ask for, once the engine holds what it serves (loaded: the workers then remove the head's
        requests, done or given up: ``cache.hold_served_version``)."""
        keep = self._keep()
        self.cache.prune(keep)
        if self.config.cache_versions == 0 and self._held:
            copies = keep - self.cache.requested()
            for version in copies:
                self.cache.release(version)
            self.cache.drop_copies(copies)

    def _keep(self) -> set[int]:
        """The versions this node keeps: those the engine serves (every rank reloads it after a failed update),
        stages a change to (the head applies it: the base of the next change once served, though a newer
        version was prepared meanwhile) and the head asked for, and the newest prepared."""
        return (set(self._served) | self._staged | self.cache.requested()
                | {v for v in (self.current,) if v is not None})

    def _served_base(self) -> int | None:
        """The version the engine serves on this node at this step's look, the base of the next change (None
        while its ranks hold different ones or stage a change to another, mid-update, or none)."""
        return next(iter(self._served)) if len(self._served) == 1 and self._staged <= self._served else None

    def _rebase(self) -> None:
        """Follow the engine to the version it serves now if it moved since the change to the current version
        was built (published while the head applied the one before it, that change was built on the version
        served before, or on none, and that version's copy was the base of the current one's decode, then
        deleted): its copy back (decoded from its delta on the copy of the version served before, still here;
        ``cache_versions`` 1: what every rank reloads after a failed update), then the change built again, on
        it."""
        base = self._served_base()
        if not self.config.apply_in_place or self.current is None or base in (None, self._change_base) \
                or base >= self.current:
            return
        self._change_base = base
        log.info("the engine serves version %d now: the change to version %d built on it", base, self.current)
        try:
            if self.config.cache_versions > 0:
                self._decode(base)
            built, problem = self._build_change(self.current)
            if self.config.cache_versions > 0 and built is not None and problem == WHOLE:
                self._build_change(self.current, built)
        except CkptStreamError as exc:  # (gone, corrupt: the head reloads the next version fully)
            log.warning("version %d: no change from version %d built here (%s)", self.current, base, exc)
        finally:
            self.stream.drop_kept_reads()

    def served(self) -> set[int]:
        """What the engine serves on this node: the versions its workers hold in the cache
        (``VersionCache.served``); while they hold none, what they held last (a restarted engine: the head
        brings it back to that version), and before they held any, the version prepared first (vLLM's start
        version)."""
        self._look()
        return set(self._served)

    def _look(self) -> None:
        """Read what the workers hold now (``cache.served``, ``cache.staged``; the step and what it calls use this
        look)."""
        self._held, self._staged = self.cache.served(), self.cache.staged()
        if self._held:
            self._served = set(self._held)

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
