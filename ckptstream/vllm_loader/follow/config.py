"""How a follower works: ``FollowerConfig``, which ``Follower``, ``NodeAgent``, ``serve`` and ``replay`` take."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ...reader import DEFAULT_LEASE_TTL
from ..observe import FollowerObserver
from .gate import UpdateGate


@dataclass(frozen=True)
class FollowerConfig:
    """How a follower works; ``Follower``, ``serve`` and ``replay`` take one (or its fields as keywords).

    Attributes:
        storage_options: fsspec options of the stream's storage.
        cache_dir: the cache root (default: ``default_cache_dir()``); versions are decoded into
            ``<cache_dir>/<stream id>/<version>/``, shared by the stream's followers on the host (see
            ``cache.py``); this follower holds at most the current and the incoming version (and the
            base of a delta), and a restarted follower adopts the version its servers report.
        pin: serve exactly this version and do not follow.
        replica_id: name of this follower's record in the stream (``replicas/<id>.json``)
            (default: ``<host>-<port of the first server>``).
        poll_interval: seconds between discovery probes (inotify wakes the follower earlier on local paths).
        pause_mode: vLLM ``/pause`` mode: ``keep`` (default: in-flight requests wait), ``wait``, ``abort``.
        api_key: for servers started with ``--api-key`` (given as URLs).
        heartbeat_interval: seconds between replica-record heartbeats (also during long pulls).
        list_every: list the manifests every this many polls even if the next version is absent (versions
            may skip numbers).
        observers: where the follower's reports go besides its log lines and replica record
            (``observe.FollowerObserver``: e.g. ``observe.JsonLines()``, ``observe.OnUpdate(callback)``).
        metrics_port: serve Prometheus metrics (``metrics.py``) at ``http://<metrics_host>:<port>/metrics``
            (0: a free port; the URL is logged and in the replica record's ``metrics_url``). None: no metrics.
        metrics_host: the address the metrics are served on.
        stand_aside: leave a server alone while another process has taken it over (``Takeover``); False
            for the taker itself.
        ephemeral_cache: on ``close()``, delete the versions it held that no other follower holds
            (nobody adopts them later: a replay).
        lease_ttl: time to live of the lease (``follower <replica id>``) held on each version while it is
            fetched, renewed every third of it, so that gc keeps the version meanwhile.
        nodes_ready_timeout: the servers are engines spanning nodes (started with ``--worker-extension-cls
            ckptstream.vllm_loader.worker.WorkerExtension``): before reloading a version, ask every rank until
            each reports it complete, with its manifest hash, at the path the reload names; give up on it
            for now after this many seconds (retried at the next round, never loaded into some ranks only).
            None: one-node servers, not asked.
        nnodes: nodes of the engine, for the replica record (None: one node).
        update_gate: entered around each server's update (``gate.UpdateGate``), e.g. a rolling update's
            ``ckptstream.fleet.rolling.RouterGate`` taking it out of a router meanwhile; None: none.
        apply_in_place: apply an update in place where it can be (see above); False: always reload.
        verify_apply: every this many updates applied in place on a server, reload the version fully there
            too and compare every runtime parameter's hash with the patched one: a mismatch stops in-place
            updates for good, loudly. None: never.
        cache_versions: whole versions kept in the cache once the servers loaded them: 1 (default) the served
            one (and the incoming one while it is prepared); 0 none (``cache.VersionCache.drop_copies``): an
            update applied in place needs only its change, and a full reload (a fallback, a restarted server)
            decodes the version from storage on demand, on every node of an engine spanning nodes.
    """

    storage_options: Mapping[str, Any] | None = None
    cache_dir: str | os.PathLike[str] | None = None
    pin: int | None = None
    replica_id: str | None = None
    poll_interval: float = 1.0
    pause_mode: str = "keep"
    api_key: str | None = None
    heartbeat_interval: float = 5.0
    list_every: int = 10
    observers: Sequence[FollowerObserver] = ()
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    stand_aside: bool = True
    ephemeral_cache: bool = False
    lease_ttl: float = DEFAULT_LEASE_TTL
    nodes_ready_timeout: float | None = None
    nnodes: int | None = None
    update_gate: UpdateGate | None = None
    apply_in_place: bool = True
    verify_apply: int | None = None
    cache_versions: int = 1

    def with_options(self, **options: Any) -> FollowerConfig:
        """A copy with ``options`` (field names; TypeError for any other) replaced."""
        fields = {f.name for f in dataclasses.fields(self)}
        unknown = set(options) - fields
        if unknown:
            raise TypeError(f"unknown follower option(s): {', '.join(sorted(unknown))}")
        return dataclasses.replace(self, **options)
