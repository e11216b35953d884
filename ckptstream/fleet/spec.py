"""What a fleet is: its settings (``FleetSpec``), its name on the Ray cluster, and what it reports.

Plain data, no Ray: the handle, the controller actor and the server actors all pass these around.
"""

from __future__ import annotations

import hashlib
import os
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from ..reader.adapter import DEFAULT_KEEP
from ..vllm_loader.follow.cache import safe_owner

NAMESPACE = "ckptstream"
"""The Ray namespace of every fleet's controller actor (detached, found again by name)."""
NAME_PREFIX = "fleet-"

STATE_STARTING = "starting"  # the server actor runs, vLLM is not generating yet
STATE_SERVING = "serving"
STATE_ASIDE = "aside"  # set aside from the fleet for a replay (deregistered from the router)
STATE_RESTARTING = "restarting"  # died; a new actor is being started in its place


def stream_location(url: str) -> str:
    """The stream URL as every node of the cluster reads it: a local path made absolute (Ray's workers run in
    another working directory), any other URL as given."""
    if urllib.parse.urlsplit(url).scheme in ("", "file"):
        path = url[len("file://"):] if url.startswith("file://") else url
        return os.path.abspath(os.path.expanduser(path))
    return url


def fleet_name(url: str) -> str:
    """The default name of the fleet of a stream: readable (the stream's last path component) and unique
    (a hash of its location), usable as a replica id prefix."""
    location = stream_location(url)
    tail = location.rstrip("/").rsplit("/", 1)[-1] or "stream"
    return f"{NAME_PREFIX}{safe_owner(tail)[:40]}-{hashlib.sha256(location.encode()).hexdigest()[:8]}"


@dataclass(frozen=True)
class FleetSpec:
    """A fleet's settings, kept by its controller actor (see ``Fleet`` for their meaning)."""

    url: str
    name: str
    replicas: int
    gpus_per_replica: float = 0
    nodes_per_replica: int = 1
    vllm_args: Sequence[str] = ()
    cache_dir: str | None = None
    api_key: str | None = None
    storage_options: Mapping[str, Any] | None = None
    router: str | None = None  # None, "start", or a router URL
    router_policy: str = "round_robin"
    rolling: bool = False
    poll_interval: float = 1.0
    metrics_port: int | None = None
    cpus_per_replica: float = 1
    vllm_log_dir: str | None = None
    keep: int = DEFAULT_KEEP  # adapter streams only, like the two below
    adapter_name: str | None = None
    base_dir: str | None = None
    cache_versions: int = 1  # FollowerConfig.cache_versions

    def __post_init__(self) -> None:
        if self.replicas < 0:
            raise ValueError("replicas must be 0 or more")
        if self.nodes_per_replica < 1:
            raise ValueError("nodes_per_replica must be 1 or more")
        if self.gpus_per_replica % self.nodes_per_replica:
            raise ValueError(f"gpus_per_replica ({self.gpus_per_replica}) must split evenly over "
                             f"nodes_per_replica ({self.nodes_per_replica})")
        if self.cache_versions not in (0, 1):
            raise ValueError("cache_versions must be 0 or 1")
        if self.keep < 1:
            raise ValueError("keep must be 1 or more")
        if self.rolling and not self.router:
            raise ValueError("rolling updates take servers out of a router: give router='start' or a URL")

    @property
    def gpus_per_node(self) -> float:
        return self.gpus_per_replica / self.nodes_per_replica


@dataclass(frozen=True)
class ServerStatus:
    """One server of a fleet, as ``Fleet.status()`` reports it.

    Attributes:
        slot: its place in the fleet (0 .. replicas-1; a replacement keeps the slot).
        replica_id: its follower's record in the stream (``replicas/<id>.json``).
        url: the vLLM server's base URL (None until its actor has a port).
        node: the IP address of its node (the head node of a multi-node engine).
        version: the version it serves (vLLM's ``/weight_info``, else its replica record's).
        state: ``starting``, ``serving``, ``updating``, ``error``, ``aside``, ``restarting``.
        lag: committed versions newer than the one it serves.
        last_pause_s: the pause of its last update (None before the first).
        last_error: its follower's last error, or why its actor died.
        restarts: how many times the fleet replaced it.
        registered: whether the fleet's router sends it requests.
        metrics_url: its Prometheus metrics (None without ``metrics_port``).
        pids: its processes (the actor's and their descendants: vLLM, its engine, its workers).
        resident: on an adapter stream, the versions it holds as ``<name>@<version>`` (its replica record's;
            ``version`` is the one the stable name means).
    """

    slot: int
    replica_id: str
    url: str | None
    node: str | None
    version: int | None
    state: str
    lag: int | None
    last_pause_s: float | None
    last_error: str | None
    restarts: int
    registered: bool
    metrics_url: str | None = None
    pids: list[int] = field(default_factory=list)
    resident: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class FleetReplayResult:
    """One version of a fleet's replay: which server ran it, and what the command returned (``exit_code``
    None: the version could not be loaded, see ``error``)."""

    version: int
    server: str
    exit_code: int | None
    output: str | None
    load_s: float
    run_s: float
    error: str | None = None
