"""The follower: keeps vLLM servers on the newest good version of a stream.

Per new version: discover it (a cheap probe of the next manifest; a listing now and then), decode it into
a local cache directory while the servers keep generating (a delta is applied to the cached current
version), check it against the served model (names, dtypes, shapes) and against its hashes, then per
server: pause → ``reload_weights`` → reset prefix cache → set weight version → resume → one-token probe.
Where the server serves the version the new one changes (and ckptstream's worker extension runs in it), the
update is applied in place instead: the change between the two (``change.py``, built once per host in the
cache) is staged by every worker while the server generates, and the pause holds only its writes
(``apply.py``); any reason against it, or any failure of it on any rank, ends in the full reload of the
version, counted by reason (``observe.FALLBACK_REASONS``).
A version that fails any check is refused and recorded; the servers keep the last good version. Every
report (log lines, the replica record, ``--json`` lines, metrics) goes through the follower's observers
(``observe.py``).

The decoded versions live in a ``VersionCache`` (``cache.py``) that the followers of the stream on the
host share: each version is decoded once, by whichever follower comes first. A server
that another process has taken over (``takeover.py``: a ``replay``) is left alone until it is given
back; then it is reconciled to the follower's version. Per-version state is bounded (the last
``REFUSED_KEPT`` refusals, ``reader/replicas.py``; the reader's manifest cache is an LRU), so a follower of a stream of
thousands of versions holds O(1) of them.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

from ...credentials import redact
from ...errors import CkptStreamError, MissingBaseError, NodesNotReady, RouterError, VersionNotFoundError
from ...format import MANIFESTS_DIR, MARKER_FILE, STREAM_KIND_WEIGHTS, Manifest
from ...reader import ReplicaRecord, Stream, replica_path
from ...reader.replicas import STATE_ASIDE, remember_refusal
from ...storage import Watch
from ...locks import unlock
from ...polling import poll
from . import takeover
from .config import FollowerConfig
from .in_place import InPlaceUpdates
from .model_fit import ServedModelFit
from .nodes import EngineNodes
from .pause import ServerPause
from .cache import Acquired, VersionCache, default_cache_dir, safe_owner
from ..client import VllmClient, VllmControl, VllmError, VllmUnreachable
from ..metrics_server import attach_metrics
from ..observe import (FollowerObserver, LogLines, ReplicaRecordWriter, UpdateRecord, commit_age,
                       notify, refusal_reason)

log = logging.getLogger("ckptstream.follow")


class Follower:
    """Keeps one or more vLLM servers (e.g. eight TP=1 servers of one node) on a stream's newest version.

    The version is fetched and decoded once, then loaded into each server in turn.

    Args:
        url: stream URL.
        vllm_urls: the servers: base URLs (started with ``VLLM_SERVER_DEV_MODE=1``) or ``VllmControl``
            objects (a ``VllmClient``, or a fake in tests).
        config: the follower's options (``FollowerConfig``); ``options`` (its field names as keywords)
            override single fields, e.g. ``Follower(url, urls, cache_dir=..., poll_interval=0.1)``.

    ``close()`` (or ``with``) releases the versions it holds in the cache.
    """

    def __init__(self, url: str, vllm_urls: Sequence[str | VllmControl], config: FollowerConfig | None = None,
                 **options: Any):
        if not vllm_urls:
            raise ValueError("at least one vLLM server URL is needed")
        config = (config or FollowerConfig()).with_options(**options)
        self.config = config
        self.stream = Stream(url, storage_options=config.storage_options, lease_ttl=config.lease_ttl)
        self._reads = self.stream.meter  # what is fetch in a prepare, and what an update read
        info = self.stream.info()
        self.stream.require_kind(STREAM_KIND_WEIGHTS)  # an adapter stream is served by adapter followers
        self.clients: list[VllmControl] = [VllmClient(u, api_key=config.api_key) if isinstance(u, str) else u
                                           for u in vllm_urls]
        replica_id = config.replica_id or default_replica_id(self.clients[0].url)
        replica_path(replica_id)  # a ValueError now, rather than every replica record failing later
        self.cache = VersionCache(config.cache_dir or default_cache_dir(), info.stream_id, replica_id,
                                  ephemeral=config.ephemeral_cache)
        self.in_place = InPlaceUpdates(config, self.stream, self.cache, self.clients)
        self.nodes = EngineNodes(config, self.cache, lambda lagging: self._report(lagging=lagging))
        self.pauses = ServerPause(self.in_place, self.nodes, config.pause_mode)
        self.pin = config.pin
        self.poll_interval = config.poll_interval
        self.heartbeat_interval = config.heartbeat_interval
        self.list_every = max(1, config.list_every)
        self.current: int | None = None
        self.refused: collections.OrderedDict[int, str] = collections.OrderedDict()
        self.fit = ServedModelFit(self.clients[0])
        self._polls = 0
        self._lock = threading.Lock()
        self._aside: set[str] = set()  # URLs of servers another process has taken over
        self.record = ReplicaRecord(replica_id=replica_id, urls=[c.url for c in self.clients],
                                    host=socket.gethostname(), pid=os.getpid(), pin=config.pin,
                                    engine=replica_id if config.nnodes else None,
                                    node_rank=0 if config.nnodes else None, nnodes=config.nnodes)
        self.wake = threading.Event()
        self.observers: list[FollowerObserver] = [LogLines(log), *config.observers,
                                                  ReplicaRecordWriter(self.stream.storage)]
        self.metrics_server = attach_metrics(self.observers, self.record, url, config.metrics_host, config.metrics_port)

    def close(self) -> None:
        """Release the cached versions it holds (a restarted follower adopts the one its servers serve);
        stop serving metrics."""
        self.cache.close()
        if self.metrics_server is not None:
            self.metrics_server.close()
            self.metrics_server = None

    def __enter__(self) -> Follower:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------- main loop

    def run(self, stop: threading.Event) -> None:
        """Follow until ``stop`` is set: discover, update, reconcile restarted servers, heartbeat."""
        heartbeat = threading.Thread(target=self._heartbeat, args=(stop,), name="ckptstream-heartbeat", daemon=True)
        heartbeat.start()
        watcher = self._watch()

        def look() -> None:
            self.step()
            if self.record.state == "error":  # recovered from an outage
                self._report(state="serving" if self.current is not None else "starting")

        def failed(exc: Exception, wait: float) -> None:  # storage or servers away: keep serving, retry
            self._report(state="error", last_error=f"{type(exc).__name__}: {redact(exc)}")
            self._notify("on_error", exc, wait)

        try:
            # any error: storage or servers away must not end the follower, which keeps serving
            poll(stop, self.wake, look, interval=self.poll_interval, on_error=failed, retry=(Exception,))
        finally:
            if watcher is not None:
                watcher.stop()
            self._report(state="stopped")

    def step(self) -> UpdateRecord | None:
        """One round: bring restarted servers back to the current version, then load a newer one if any.
        Servers another process has taken over are left alone (all of them: nothing to do)."""
        with self._claim() as clients:
            if not clients:
                return None
            return self._step(clients)

    def _step(self, clients: list[VllmControl]) -> UpdateRecord | None:
        try:
            self._reconcile(clients)
        except NodesNotReady as exc:  # a restarted engine, reloaded once every node has the version
            log.info("%s; bringing the engine back to version %s once they have it", exc, self.current)
            return None
        target = self._discover()
        if target is not None and self.pin is None:
            self._notify("on_discovered", target)
        if target is None or target == self.current or target in self.refused:
            return None
        if self.pin is None and self.current is not None and target < self.current:
            return None
        try:
            update = self.load(target, clients)
        except MissingBaseError as exc:
            self._refuse(target, exc, clients)
            return None
        except VersionNotFoundError as exc:  # retired between discovery and fetch: normal, move on
            log.info("version %d is gone (%s); looking for a newer one", target, exc)
            return None
        except NodesNotReady as exc:  # not the version's fault: the lagging nodes get it later
            log.info("%s; still serving version %s, retrying", exc, self.current)
            self._report(state="serving" if self.current is not None else "starting")
            return None
        except (VllmUnreachable, RouterError):
            raise  # not the version's fault: run() retries it once the server (or the gate's router) is back
        except CkptStreamError as exc:  # corrupt, foreign, misshapen, or a reload the server refused
            self._refuse(target, exc, clients)
            return None
        return update

    # --------------------------------------------------------------------------------------- updating

    def adopt(self, version: int) -> None:
        """Declare that the servers already serve ``version`` from its cache directory (e.g. started on it); the
        follower holds it in the cache from now on (and the workers of an engine spanning nodes, each on its node:
        ``EngineNodes.hold_served``), and the workers trace their loaders on it (``InPlaceUpdates.prepare``)."""
        self.cache.hold(version)
        self.current = version
        self.fit.adopt(self.stream.manifest(version))
        for client in self.clients:
            self.nodes.hold_served(client, version)
        self._report(version=version, state="serving")
        self.in_place.prepare(self.clients, self.cache.path(version))  # (after the report: they serve meanwhile)
        if self.config.cache_versions == 0:  # loaded (and its headers read): its copy is no longer needed here
            self._keep_served()

    def load(self, version: int, clients: Sequence[VllmControl] | None = None) -> UpdateRecord:
        """Prepare ``version`` in the cache, check it, and load it into every server (or ``clients``).

        Where the servers take it in place and it is a delta chain on the version they serve, the change
        is built from the fetched deltas and applied before ``version`` is decoded into the cache: servers
        serve it sooner. The decode then checks every tensor's hash; a mismatch brings every server back
        to the version it served (and ``version`` is refused).

        Raises:
            IntegrityError / CkptStreamError: the version is refused (servers untouched, or back on theirs).
            NodesNotReady: a node of an engine lacks it after ``nodes_ready_timeout`` (servers untouched).
            VllmError: a server failed to load it (servers reverted to the current version).
        """
        try:
            return self._load(version, clients)
        finally:
            self.stream.drop_kept_reads()  # what the change was built from and the decode did not read

    def _load(self, version: int, clients: Sequence[VllmControl] | None) -> UpdateRecord:
        bytes_before = self._reads.bytes_read()
        manifest = self.stream.manifest(version)
        found_s = commit_age(manifest.created)
        self.fit.check(manifest)  # before fetching anything
        self._report(state="updating")
        started, read_before = time.perf_counter(), self._reads.read_seconds()
        path: Path | None = None
        change, why_not = self.in_place.change(version, None, self.current)  # from the fetched deltas, before a decode
        if change is not None:
            assert self.current is not None
            base, decoded = self.current, False
        else:
            path, base, _, decoded = self.prepare(version)
        prepare_s = time.perf_counter() - started
        fetch_s = min(prepare_s, self._reads.read_seconds() - read_before)
        targets = list(self.clients if clients is None else clients)
        if path is not None and self.config.nodes_ready_timeout is not None:
            for client in targets:
                self.nodes.wait_for(client, manifest, path)
        restore = self.cache.path(self.current) if self.current is not None and self.current != version else None
        if restore is not None and not (restore / MARKER_FILE).is_file():
            restore = None  # gone: _revert decodes it again, outside the pause
        if path is not None and change is None and why_not is None:  # e.g. across a keyframe: both versions compared
            change, why_not = self.in_place.change(version, path, self.current)
        pause_s = reload_s = stage_s = servers_s = 0.0
        in_place = 0
        fallbacks: collections.Counter[str] = collections.Counter()
        done: list[VllmControl] = []
        fully_reloaded: list[VllmControl] = []
        waiting: list[tuple[VllmControl, str]] = []  # to reload fully once decoded, and why
        verify: list[VllmControl] = []
        for client in targets:
            if change is not None and client.url not in self.in_place.off:
                stage_started = time.perf_counter()
                staged, fallback = self._stage(client, change, manifest)
                stage_s += time.perf_counter() - stage_started
            else:
                staged, fallback = None, why_not or "disabled"
            if staged is None and path is None:
                waiting.append((client, fallback or "disabled"))
                continue
            paused, reloaded, failed, took = self._update_server(client, version, path, restore, staged, done)
            pause_s, reload_s, servers_s = pause_s + paused, reload_s + reloaded, servers_s + took
            fallback = fallback or failed
            if fallback is not None and path is None:
                waiting.append((client, fallback))  # back on the served version, every rank
                continue
            done.append(client)
            if fallback is not None:
                fallbacks[fallback] += 1
                fully_reloaded.append(client)
            else:
                in_place += 1
                if self.in_place.verify_due(client):
                    verify.append(client)
        lag_s = commit_age(manifest.created)
        cache_s = 0.0
        if path is None and (waiting or self.config.cache_versions > 0):
            if not waiting:
                self._report(version=version, state="serving", last_error=None)  # what wait_for_version sees
            cache_started = time.perf_counter()
            try:
                path, _, _, decoded = self.prepare(version)
                if self.config.nodes_ready_timeout is not None:
                    for client, _ in waiting:  # every node needs it whole for the full reload
                        self.nodes.wait_for(client, manifest, path)
            except (CkptStreamError, NodesNotReady) as exc:
                if done or not isinstance(exc, NodesNotReady):  # (a node lagging before anything changed: info)
                    log.error("version %d, applied in place, %s; every server goes back to version %s", version,
                              "is not on every node for a full reload" if isinstance(exc, NodesNotReady) else
                              "failed its decode", self.current)
                for client in done:
                    with self._gate(client.url, version):
                        self._revert([client])
                self._report(version=self.current, state="serving")
                raise
            cache_s = time.perf_counter() - cache_started
            for client, fallback in waiting:
                paused, reloaded, _, took = self._update_server(client, version, path, restore, None, done)
                pause_s, reload_s, servers_s = pause_s + paused, reload_s + reloaded, servers_s + took
                done.append(client)
                fully_reloaded.append(client)
                fallbacks[fallback] += 1
            if waiting:
                lag_s = commit_age(manifest.created)
        for client in verify:
            path = path if path is not None else self.prepare(version)[0]  # (--cache-versions 0)
            if self.nodes.ready_to_check(client, manifest, path):  # the check reloads it on every rank
                with self._gate(client.url, version):
                    self.in_place.verify(client, version, path)
                self.nodes.hold_served(client, version)  # (reloaded: what the head asked the nodes for is over)
                fallbacks["verify"] += 1
        self.current = version
        self._keep_served()
        fetched = self._reads.bytes_read() - bytes_before  # measured: what this update read from storage
        update = UpdateRecord(version, base, fetched, prepare_s, pause_s, reload_s, lag_s, decoded, fetch_s=fetch_s,
                              decode_s=prepare_s - fetch_s, applied_in_place=in_place, fallbacks=dict(fallbacks),
                              cache_s=cache_s, stage_s=stage_s, found_s=found_s, servers_s=servers_s)
        self._notify("on_update", update)
        self._report(version=version, state="serving", last_error=None)  # what wait_for_version sees
        if path is not None:  # (after the report: each call waits for an engine step; the others traced already)
            self.in_place.prepare(fully_reloaded, path)
        return update

    def _update_server(self, client: VllmControl, version: int, path: Path | None, restore: Path | None,
                       staged: Path | None, done: list[VllmControl]) -> tuple[float, float, str | None, float]:
        """``ServerPause.load_into`` one server under the update gate (its answer, and the seconds it all took); if it
        fails, the servers ``done`` before it go back to the current version too. What a failed update staged is
        discarded."""
        started = time.perf_counter()
        restored: list[VllmControl] = []
        loaded = False
        if restore is not None and self.config.nodes_ready_timeout is not None:  # on every node?
            restore = self.nodes.restorable(client, self.stream.manifest(self.current or 0), restore)
        try:
            with self._gate(client.url, version):
                try:
                    result = self.pauses.load_into(client, version, path, self.current, restore=restore,
                                                   restored=restored, change=staged)
                except VllmError:
                    # A server whose reload failed got the last good version back inside its pause,
                    # else gets it now, before the gate lets it serve again.
                    if restored:  # (what the head asked the nodes for is over)
                        self.nodes.hold_served(client, self.current)
                    else:
                        self._revert([client])
                    raise
            loaded = True
            return (*result, time.perf_counter() - started)
        except VllmError:
            for other in done:
                with self._gate(other.url, version):
                    self._revert([other])
            raise
        finally:
            if staged is not None and not loaded:
                with contextlib.suppress(VllmError):
                    client.discard_change()  # what a failed update staged on the device

    def prepare(self, version: int) -> Acquired:
        """``version`` proven in the cache and held for this follower (``VersionCache.acquire``): (path, the
        version its delta was applied to, bytes fetched, whether this follower decoded it)."""
        return self.cache.acquire(self.stream, version, keep={self.current} - {None},
                                  holder=f"follower {self.record.replica_id}")

    def _current_path(self, client: VllmControl | None = None) -> Path:
        """The cache directory of the current version, decoded again if it went missing (``cache_versions``
        0: decoded on demand), and, on an engine spanning nodes (``client``), complete on every node (each
        node lacking it is asked for it); NodesNotReady if a node still lacks it after ``nodes_ready_timeout``."""
        assert self.current is not None
        path = self.prepare(self.current)[0]
        if client is not None and self.config.nodes_ready_timeout is not None:
            self.nodes.wait_for(client, self.stream.manifest(self.current), path)
        return path

    def _keep_served(self) -> None:
        """Keep the current version in the cache (held) and delete the others nobody holds; with
        ``cache_versions`` 0, not even its copy (once loaded, a change needs no whole version)."""
        self.cache.prune({self.current} - {None})
        if self.config.cache_versions == 0 and self.current is not None:
            self.cache.release(self.current)
            self.cache.drop_copies({self.current})

    def _gate(self, url: str, version: int) -> contextlib.AbstractContextManager[None]:
        gate = self.config.update_gate
        return gate.hold(url, version) if gate is not None else contextlib.nullcontext()

    def _stage(self, client: VllmControl, change: Path, manifest: Manifest) -> tuple[Path | None, str | None]:
        """``InPlaceUpdates.stage``, on an engine spanning nodes only once every rank has the change in its
        node's cache (each node's agent builds it: ``agent.py``); a node lacking it after
        ``nodes_ready_timeout`` makes the version a full reload (``multi_node``)."""
        if self.config.nodes_ready_timeout is not None:
            try:
                self.nodes.wait_for(client, manifest, change)
            except NodesNotReady as exc:
                self.in_place.explain("multi_node", f"{client.url}: {exc}")
                return None, "multi_node"
        return self.in_place.stage(client, change)

    def _revert(self, clients: list[VllmControl]) -> None:
        """Reload the current version into servers that took (part of) a failed update."""
        if self.current is None:
            return
        for client in clients:
            try:
                self.pauses.load_into(client, self.current, self._current_path(client), self.current)
            except (VllmError, CkptStreamError, NodesNotReady) as exc:
                log.error("could not restore version %d on %s: %s", self.current, client.url, exc)

    def _claim(self) -> contextlib.AbstractContextManager[list[VllmControl]]:
        """The servers this round may touch, held (shared) against a takeover until the round ends."""
        if not self.config.stand_aside:
            return contextlib.nullcontext(self.clients)
        return self._shared_holds()

    @contextlib.contextmanager
    def _shared_holds(self) -> Iterator[list[VllmControl]]:
        holds: list[int] = []
        free = []
        was_aside = bool(self._aside)
        try:
            for client in self.clients:
                hold = takeover.try_share(client.url)
                if hold is None:
                    if client.url not in self._aside:
                        log.info("%s is taken over by another process (a replay?); standing aside", client.url)
                        self._aside.add(client.url)
                    continue
                holds.append(hold)
                if client.url in self._aside:
                    log.info("%s was given back; bringing it to version %s", client.url, self.current)
                    self._aside.discard(client.url)
                free.append(client)
            if self._aside and not was_aside:  # what wait_for_version must not count as serving the stream
                self._report(state=STATE_ASIDE)
            yield free
            if was_aside and not self._aside and self.record.state == STATE_ASIDE:
                self._report(state="serving" if self.current is not None else "starting")
        finally:
            for hold in holds:
                unlock(hold)

    def _reconcile(self, clients: list[VllmControl]) -> None:
        """A server that restarted or was given back (its weight version is not ours) gets the current version
        again, and traces. A restarted follower adopts the version its servers report, if cached here."""
        if self.current is None:
            self._adopt_served(clients)
            if self.current is None:
                return
        for client in clients:
            try:
                served = client.weight_version()
            except VllmUnreachable:
                continue
            if served != str(self.current):
                log.info("%s serves %r, not version %d; reloading it", client.url, served, self.current)
                client.wait_ready(timeout=60)
                path = self._current_path(client)
                self.pauses.load_into(client, self.current, path, self.current)
                self.in_place.prepare([client], path)  # (a restarted server's workers have traced nothing)

    def _adopt_served(self, clients: list[VllmControl]) -> None:
        try:
            served = {client.weight_version() for client in clients}
        except VllmUnreachable:
            return
        if len(served) != 1:
            return
        reported = served.pop()
        version = int(reported) if reported.isdigit() else None
        if version is None or self.cache.acquire_cached(self.stream, version) is None:
            return  # not cached here, or not that version (``proven`` says why): the servers get ours
        log.info("servers already serve version %d (cached); resuming from it", version)
        self.adopt(version)

    # ------------------------------------------------------------------------------------- discovery

    def _discover(self) -> int | None:
        """The version to serve: the pin, or the newest version. Per poll, cheap probes of the manifests
        after the current version (they usually come one at a time); a listing when nothing is served
        yet, when more than ``list_every`` versions are new, and every ``list_every`` polls (versions may
        skip numbers). A listing per update would cost O(versions in the stream) each time."""
        if self.pin is not None:
            return self.pin
        self._polls += 1
        if self.current is not None and self._polls % self.list_every:
            newest, probe = self.current, self.current + 1
            while probe - self.current <= self.list_every and self.stream.has_version(probe):
                if probe not in self.refused:
                    newest = probe
                probe += 1
            if probe - self.current <= self.list_every:
                return newest
        listed = [v for v in self.stream.versions() if v not in self.refused]
        return listed[-1] if listed else None

    def _watch(self) -> Watch | None:
        """Wake the loop on manifest writes where the storage notifies (inotify on local paths). NFS clients
        do not see other clients' writes this way, so polling continues regardless."""
        return self.stream.storage.watch(MANIFESTS_DIR, self.wake.set)

    # ------------------------------------------------------------------------------------- reporting

    def _refuse(self, version: int, exc: Exception, clients: Sequence[VllmControl] = ()) -> None:
        self.nodes.end_requests(clients, self.current)  # what it asked the nodes for is over
        with self._lock:
            self.record.refused = remember_refusal(self.refused, version, str(exc))
        self._notify("on_refused", version, refusal_reason(exc), exc)
        self._report(state="serving" if self.current is not None else "error", last_error=str(exc))

    def _report(self, **changes: Any) -> None:
        """Change the follower's record (``changes``: its fields), stamp its heartbeat, tell the observers."""
        with self._lock:
            for key, value in changes.items():
                setattr(self.record, key, value)
            self.record.heartbeat = time.time()
            record = ReplicaRecord(**{**self.record.__dict__, "refused": dict(self.record.refused),
                                      "urls": list(self.record.urls), "lagging": list(self.record.lagging)})
        self._notify("on_report", record)

    def _notify(self, event: str, *args: Any) -> None:
        notify(self.observers, event, *args)

    def _heartbeat(self, stop: threading.Event) -> None:
        while not stop.wait(self.heartbeat_interval):
            self._report()


def default_replica_id(url: str) -> str:
    """A follower's replica id unless given one: the host's name and the first server's port."""
    port = url.rstrip("/").rsplit(":", 1)[-1]
    return safe_owner(f"{socket.gethostname()}-{port if port.isdigit() else 'vllm'}")
