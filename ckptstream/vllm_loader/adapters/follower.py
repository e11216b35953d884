"""Following an adapter stream: each new version loaded into running vLLM servers as a LoRA adapter.

A version of an adapter stream (FORMAT.md, "Adapter streams") is decoded into the host's shared cache as a
PEFT directory (``adapter_config.json``, ``adapter_model.safetensors``), checked against the stream's rank
and every tensor's hash, then loaded into every server as ``<name>@<version>``; the stable ``<name>`` moves
to the newest version (``adapters.ResidentAdapters``). The newest ``keep`` versions stay resident; an older
one is unloaded once no request uses it, and its directory deleted once nothing can read it any more.
Nothing pauses: vLLM loads an adapter between two engine steps, while requests for the base model and the
other versions keep running. A version vLLM refuses (a corrupt file, a rank above ``--max-lora-rank``,
another base) is logged and skipped; every resident version keeps serving.
"""

from __future__ import annotations

import collections
import copy
import logging
import os
import socket
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ...errors import AdapterRefused, IntegrityError, MissingBaseError, VersionNotFoundError, VllmArgumentError
from ...format import STREAM_KIND_ADAPTER
from ...reader import DEFAULT_LEASE_TTL, ReplicaRecord, Stream, replica_path
from ...reader.adapter import check_adapter_fits
from ...reader.adapter import DEFAULT_KEEP
from ...reader.replicas import remember_refusal
from .resident import ResidentAdapters
from ..follow.cache import VersionCache, default_cache_dir, safe_owner
from ..client import AdapterControl, VllmClient
from ..follow.follower import default_replica_id
from ..metrics_server import attach_metrics
from ..observe import (FollowerObserver, ReplicaRecordWriter, UpdateRecord, commit_age, notify,
                       refusal_reason)

log = logging.getLogger("ckptstream.follow")


class AdapterFollower:
    """Keeps the newest ``keep`` versions of the adapter stream at ``url`` resident in running vLLM servers.

    It reports like a weights follower: a replica record in the stream (``replicas/<replica_id>.json``, with
    the stable name in ``adapter`` and the versions every server holds in ``resident``: what
    ``Stream.wait_for_version`` reads), ``observers`` (``on_update`` per version loaded, with
    ``pause_s`` 0: nothing pauses; per version the stable name moves to, not per older version loaded to
    fill the window), and Prometheus metrics with ``metrics_port``.

    Args:
        url: the adapter stream.
        vllm_urls: servers started with ``--enable-lora`` (``--max-loras`` at least ``keep`` + 1),
            ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` and ``VLLM_SERVER_DEV_MODE=1`` on the stream's base model.
        name: the stable adapter name (default the stream URL's last part); versions are ``<name>@<version>``.
        keep: versions kept resident.
        base_dir: the base model the servers serve, to check the stream's base identity against it.
        aliases: the alias file of the servers' ``CKPTSTREAM_LORA_ALIASES`` (``lora_aliases``), so that a
            request for ``<name>`` arriving while it moves is answered; None: such a request gets a 404.
        replica_id: the name of its replica record (default ``<host>-<port of the first server>``).
        observers: more ``FollowerObserver`` sinks (``JsonLines``, ``OnUpdate``, ...).
        metrics_port, metrics_host: serve Prometheus metrics there (port 0: a free one).
        heartbeat_interval: seconds between replica-record heartbeats.
        cache_dir, storage_options, api_key, poll_interval, lease_ttl: as for :class:`Follower`.
    """

    def __init__(self, url: str, vllm_urls: Sequence[str | Any], *, name: str | None = None, keep: int = DEFAULT_KEEP,
                 base_dir: str | Path | None = None, aliases: str | Path | None = None,
                 cache_dir: str | Path | None = None, storage_options: dict[str, Any] | None = None,
                 api_key: str | None = None, poll_interval: float = 1.0, lease_ttl: float = DEFAULT_LEASE_TTL,
                 replica_id: str | None = None, observers: Sequence[FollowerObserver] = (),
                 metrics_port: int | None = None, metrics_host: str = "127.0.0.1",
                 heartbeat_interval: float = 5.0):
        if not vllm_urls:
            raise ValueError("at least one vLLM server URL is needed")
        self.stream = Stream(url, storage_options=storage_options, lease_ttl=lease_ttl)
        self._reads = self.stream.meter  # what is fetch in a prepare
        self.stream.require_kind(STREAM_KIND_ADAPTER)
        info = self.stream.info()
        assert info.adapter is not None  # an adapter stream's stream.json has its block
        base_hash = None
        if base_dir is not None:
            from ...basehash import base_model_hash

            base_hash = base_model_hash(base_dir)
        check_adapter_fits(info.adapter, base_hash=base_hash, max_lora_rank=None, version=None,
                           server=f"--base-dir {base_dir}")
        self.name = name or default_adapter_name(url)
        self.poll_interval = poll_interval
        self.heartbeat_interval = heartbeat_interval
        clients = [VllmClient(u, api_key=api_key) if isinstance(u, str) else u for u in vllm_urls]
        for client in clients:  # refused now rather than every version by vLLM, one after another
            _check_slots(client, keep)
            check_adapter_fits(info.adapter, base_hash=None, max_lora_rank=client.max_lora_rank(), version=None,
                               server=client.url)
        self.servers = [ResidentAdapters(c, self.name, keep, aliases=None if aliases is None else Path(aliases))
                        for c in clients]
        replica_id = replica_id or default_replica_id(clients[0].url)
        replica_path(replica_id)  # a ValueError now, rather than every replica record failing later
        self.cache = VersionCache(cache_dir or default_cache_dir(), info.stream_id, safe_owner(f"lora-{self.name}"))
        self.refused: collections.OrderedDict[int, str] = collections.OrderedDict()
        self._dirs: set[int] = set()  # versions loaded whose directories something may still read
        self.keep = keep
        # (newest, the committed versions up to it that may fill its window): listed once per newest version
        self._window: tuple[int, list[int]] | None = None
        self.record = ReplicaRecord(replica_id=replica_id, urls=[c.url for c in clients],
                                    host=socket.gethostname(), pid=os.getpid(), adapter=self.name, keep=keep)
        self.observers: list[FollowerObserver] = [*observers, ReplicaRecordWriter(self.stream.storage, log)]
        self.metrics_server = attach_metrics(self.observers, self.record, url, metrics_host, metrics_port)
        self._reported = 0.0
        self._lock = threading.Lock()
        resident = [server.recover() for server in self.servers]  # a restarted follower takes them over
        for version in set().union(*resident):
            self._dirs.add(version)
            self.cache.hold(version)
        self._report(resident=_common(resident), version=self._stable_version(),
                     state="serving" if self._stable_version() is not None else "starting")

    def resident(self) -> list[int]:
        """The versions resident on every server (asked of each)."""
        return _common([server.resident() for server in self.servers])

    def step(self) -> int | None:
        """One round: bring every server to the newest version not refused (loaded where a server lacks it,
        the stable name moved where it means another), give a restarted server back every version the replica
        held, load the versions of the newest ``keep`` that came too quickly one after another to be loaded
        each in its round, then unload and release what is beyond the newest ``keep``; returns the newest
        version loaded, or None."""
        loaded = None
        target = self._target()
        if target is not None:
            notify(self.observers, "on_discovered", target)
            behind = [server for server in self.servers if not server.current(target)]
            if behind and (self._stable_version() is None or target >= self._stable_version()):
                loaded = self._load(target, behind)
        self._restore(self.record.resident)
        if target is not None and self._stable_version() == target:
            try:
                self._fill_below(target)
            except Exception as exc:  # noqa: BLE001 - the newest version serves; the rest is tried next round
                log.warning("adapter %s: versions below %d not all loaded yet (%s: %s); trying again next round",
                            self.name, target, type(exc).__name__, exc)
        evictions = [server.evict() for server in self.servers]
        resident = _common([e.resident for e in evictions])
        held_anywhere = set().union(*(e.resident for e in evictions))
        for version in {v for e in evictions for v in e.released} - held_anywhere:
            self._dirs.discard(version)
            self.cache.release(version)
        self.cache.prune(self._dirs)
        recovered = {"last_error": None} if self.record.state == "error" else {}  # from an outage
        changed = resident != self.record.resident or self._stable_version() != self.record.version or recovered
        if changed or time.monotonic() - self._reported >= self.heartbeat_interval:
            self._report(resident=resident, version=self._stable_version(),
                         state="serving" if self._stable_version() is not None else "starting", **recovered)
        return loaded

    def run(self, stop: threading.Event) -> None:
        """``step`` every ``poll_interval`` seconds until ``stop`` is set, the first at once; any failure (storage
        or a server away) is logged, reported and retried at the next round: every resident version keeps
        serving. The replica record's heartbeat is written every ``heartbeat_interval`` meanwhile, also during a
        long fetch."""
        heartbeat = threading.Thread(target=self._heartbeat, args=(stop,), name="ckptstream-adapter-heartbeat",
                                     daemon=True)
        heartbeat.start()
        try:
            while not stop.is_set():
                try:
                    self.step()
                except Exception as exc:  # noqa: BLE001 - storage or servers away must not end the follower
                    log.warning("adapter %s: %s: %s; retrying", self.name, type(exc).__name__, exc)
                    self._report(state="error", last_error=f"{type(exc).__name__}: {exc}")
                    notify(self.observers, "on_error", exc, self.poll_interval)
                stop.wait(self.poll_interval)
        finally:
            self._report(state="stopped")

    def close(self) -> None:
        """Release the cached versions it holds (a restarted follower takes the resident ones over); stop
        serving metrics."""
        self.cache.close()
        if self.metrics_server is not None:
            self.metrics_server.close()
            self.metrics_server = None

    def __enter__(self) -> AdapterFollower:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _stable_version(self) -> int | None:
        """The version the stable name means on every server: the oldest one of theirs (None while a server
        has none)."""
        stable = [server.stable for server in self.servers]
        return None if None in stable else min(v for v in stable if v is not None)

    def _target(self) -> int | None:
        """The newest committed version not refused (listing the versions only when the newest is refused)."""
        newest = self.stream.latest()
        if newest is None or newest not in self.refused:
            return newest
        return max((v for v in self.stream.versions() if v not in self.refused), default=None)

    def _fill_below(self, newest: int) -> None:
        """Have every server hold the versions among the newest ``keep`` not refused up to ``newest`` (the
        version the stable name means), loading them where a server lacks one: published while an earlier one
        was loading, before this follower started, or lost to a failed load. Newest first (the one a client
        told of the version before ``newest`` asks for next); the stable name stays on ``newest``. A version
        at fault is refused as the newest would be and lets the next older one in, down to the newest
        2 × ``keep`` committed versions (a server refusing every version does not walk the whole history); one
        retired meanwhile is dropped."""
        if self._window is None or self._window[0] != newest:
            self._window = (newest, [v for v in self.stream.versions() if v <= newest][-2 * self.keep:])
        committed = self._window[1]

        def window() -> list[int]:  # newest first
            return [v for v in committed if v not in self.refused][-self.keep:][::-1]

        if set(window()) - {newest} <= set(self.record.resident):
            return  # every server held them at the last round; _restore gives a restarted one them back
        held = [set(server.resident()) for server in self.servers]
        tried: set[int] = {newest}
        while todo := [v for v in window() if v not in tried]:
            version = todo[0]
            tried.add(version)
            lacking = [(server, has) for server, has in zip(self.servers, held) if version not in has]
            if not lacking:
                continue
            if self._load(version, [server for server, _ in lacking], announce=False) is not None:
                for _, has in lacking:
                    has.add(version)
            elif version not in self.refused:  # retired meanwhile: not to be fetched again
                committed.remove(version)

    def _load(self, version: int, servers: Sequence[ResidentAdapters], announce: bool = True) -> int | None:
        """Have ``version`` resident on ``servers``, and meant by the stable name where it is the newest; a
        version that is at fault (corrupt, of another rank or base, refused by a server) is refused on every
        server, a failure of storage raised (retried next round). ``announce``: tell the observers (an older
        version loaded to fill the window is only logged: its commit age is no measure of serving)."""
        started, read_before = time.perf_counter(), self._reads.read_seconds()
        try:
            path, base, fetched, decoded = self.cache.acquire(self.stream, version, keep=self._dirs,
                                                              holder=f"adapter follower {self.record.replica_id}")
        except VersionNotFoundError as exc:  # retired meanwhile (or its base): not the version's fault
            if isinstance(exc, MissingBaseError):
                self._refuse(version, exc)
            return None
        except IntegrityError as exc:  # corrupt, or not of the stream's rank: every resident version serves
            self._refuse(version, exc)
            return None
        prepared = time.perf_counter()
        fetch_s = min(prepared - started, self._reads.read_seconds() - read_before)
        self._dirs.add(version)
        previous = self._stable_version()
        took: list[ResidentAdapters] = []
        try:
            for server in servers:
                server.load(version, path)
                took.append(server)
        except AdapterRefused as exc:
            self._withdraw(version, took, previous)
            self._refuse(version, exc)
            return None
        loaded = time.perf_counter()
        log.info("adapter %s: version %d resident (as %s@%d, %.1f MB fetched, prepared in %.2f s, loaded in "
                 "%.2f s)%s", self.name, version, self.name, version, fetched / 1e6, prepared - started,
                 loaded - prepared, f"; {self.name} means it" if self._stable_version() == version else "")
        if not announce:
            return version
        notify(self.observers, "on_update", UpdateRecord(
            version, base, fetched, prepare_s=prepared - started, pause_s=0.0, reload_s=loaded - prepared,
            lag_s=commit_age(self.stream.manifest(version).created), decoded=decoded, fetch_s=fetch_s,
            decode_s=prepared - started - fetch_s))
        return version

    def _restore(self, versions: Sequence[int]) -> None:
        """Load ``versions`` (those the replica record names as resident) again on every server that lacks them
        (restarted meanwhile), newest first: a client holding ``<name>@<version>`` from the record finds it on
        every server. A version a server refuses now is left to the others (it is not the version's fault:
        every server took it before)."""
        wanted = sorted((v for v in versions if v in self._dirs and v not in self.refused), reverse=True)
        for server in self.servers:
            held = set(server.resident())
            lacking = [v for v in wanted if v not in held][:server.keep]
            for version in lacking:
                try:
                    server.load(version, self.cache.path(version))
                except AdapterRefused as exc:
                    log.warning("adapter %s: version %d not restored on %s: %s", self.name, version,
                                server.client.url, exc)
            if lacking:
                log.info("adapter %s: versions %s restored on %s", self.name, sorted(lacking), server.client.url)

    def _withdraw(self, version: int, took: Sequence[ResidentAdapters], previous: int | None) -> None:
        """Take a version refused by one server back from those that took it, so that every server's stable
        name means the same version; its directory is released where no server took it."""
        fallback = None if previous is None else (previous, self.cache.path(previous))
        for server in took:
            server.withdraw(version, fallback)
        if not took:
            self._dirs.discard(version)
            self.cache.release(version)

    def _refuse(self, version: int, exc: Exception) -> None:
        with self._lock:
            self.record.refused = remember_refusal(self.refused, version, str(exc))
        log.error("adapter %s: version %d refused: %s; every resident version keeps serving", self.name,
                  version, exc)
        notify(self.observers, "on_refused", version, refusal_reason(exc), exc)
        self._report(last_error=str(exc))

    def _heartbeat(self, stop: threading.Event) -> None:
        while not stop.wait(self.heartbeat_interval):
            self._report()

    def _report(self, **changes: Any) -> None:
        """Change the record (``changes``: its fields), stamp its heartbeat, tell the observers (a copy); from
        the loop and the heartbeat thread."""
        with self._lock:
            for key, value in changes.items():
                setattr(self.record, key, value)
            self.record.heartbeat = time.time()
            self._reported = time.monotonic()
            record = copy.deepcopy(self.record)
        notify(self.observers, "on_report", record)


def _check_slots(client: AdapterControl, keep: int) -> None:
    """Refuse a server whose ``--max-loras`` cannot hold ``keep`` versions and the stable name in one batch
    (requests for the others would wait for a batch of their own)."""
    slots = client.max_loras()
    if slots is not None and slots < keep + 1:
        smaller = f", or pass --keep {slots - 1}" if slots > 1 else ""
        hint = f"Restart it with --max-loras {keep + 1} or more{smaller}"
        raise VllmArgumentError(f"{client.url} runs with --max-loras {slots}, below --keep {keep} + 1 (the stable "
                                "name is an adapter of its own)", hint=hint)


def _common(resident: Sequence[Sequence[int]]) -> list[int]:
    """The versions in every one of the servers' resident lists, oldest first."""
    return sorted(set.intersection(*(set(r) for r in resident))) if resident else []


def default_adapter_name(url: str) -> str:
    """The stable adapter name of a stream: the last part of its URL's path (``s3://b/runs/policy`` →
    ``policy``); ``adapter`` for a stream at the root of an HTTP server (a relay: its host and port name no
    adapter)."""
    scheme, separator, rest = url.rstrip("/").partition("://")
    if separator and scheme in ("http", "https") and "/" not in rest:
        return "adapter"
    name = url.rstrip("/").rsplit("/", 1)[-1] or "adapter"
    return name.replace("@", "-").replace(",", "-")
