"""``Fleet``: a handle on a fleet of vLLM servers on a Ray cluster, following one stream.

The fleet itself is its controller actor (``controller.py``, detached and named in the ``ckptstream``
namespace): creating a ``Fleet`` starts one, ``Fleet.connect(url)`` finds it again from another driver,
and ``stop()`` ends it and every process it started.
"""

from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

from ..errors import FleetError, FleetNotFoundError, FleetTimeout
from ..reader import Stream
from ..format import STREAM_KIND_ADAPTER
from ..reader.adapter import DEFAULT_KEEP
from ..reader.replicas import ReplicaRecord
from ..reader.selection import select_versions
from .controller import FleetController
from .spec import (NAMESPACE, STATE_SERVING, FleetReplayResult, FleetSpec, ServerStatus, fleet_name,
                   stream_location)

# Record states that say more than the controller's "serving" (what the follower is doing right now).
_FOLLOWER_STATES = ("updating", "error")
_SERVING_STATES = (STATE_SERVING, *_FOLLOWER_STATES)


def _ray() -> Any:
    import ray

    if not ray.is_initialized():
        raise FleetError("not connected to a Ray cluster",
                         hint="Call ray.init(address=...) first (the CLI takes --address)")
    return ray


class Fleet:
    """A fleet of vLLM servers on the connected Ray cluster, each run by ``ckptstream serve`` on the stream.

    Args:
        stream_url: the stream (every node reads it: shared storage or an object store).
        replicas: servers to run.
        gpus_per_replica: GPUs of each server (0 on CPU), split evenly over its nodes.
        nodes_per_replica: nodes of each server's engine (one actor per node, kept together by a placement
            group of STRICT_SPREAD bundles).
        vllm_args: vLLM's arguments (as after ``ckptstream serve URL --``).
        cache_dir, api_key, storage_options, cache_versions: as for ``serve`` (``cache_versions``: whole versions
            kept in each node's cache once loaded, ``FollowerConfig.cache_versions``).
        router: None, ``"start"`` (start a ``vllm-router`` on this cluster) or a router's URL: servers are
            registered there once they serve the newest good version, deregistered when they leave.
        rolling: updates take one server at a time out of the router (needs ``router``).
        name: the controller's name (default ``fleet_name(stream_url)``).
        metrics_port: each server's Prometheus metrics port (``serve(metrics_port=)``); 0: a free port per
            server (for several servers per node), shown in ``status()`` as ``metrics_url``.
        vllm_log_dir: a directory (on each node) for the servers' vLLM output (default: the actors' logs).
        keep, adapter_name, base_dir: on an adapter stream, as for ``serve`` (``base_dir``: the base model's
            directory on every node); refused on a weights stream.

    Raises:
        FleetError: not connected to Ray, or a fleet of that name runs already.
    """

    def __init__(self, stream_url: str, replicas: int = 1, *, gpus_per_replica: float = 0, nodes_per_replica: int = 1,
                 vllm_args: Sequence[str] = (), cache_dir: str | None = None, api_key: str | None = None,
                 storage_options: Mapping[str, Any] | None = None, router: str | None = None, rolling: bool = False,
                 name: str | None = None, metrics_port: int | None = None, poll_interval: float = 1.0,
                 cpus_per_replica: float = 1, vllm_log_dir: str | None = None, keep: int | None = None,
                 adapter_name: str | None = None, base_dir: str | None = None, cache_versions: int = 1):
        url = stream_location(stream_url)
        spec = FleetSpec(url=url, name=name or fleet_name(url), replicas=replicas, gpus_per_replica=gpus_per_replica,
                         nodes_per_replica=nodes_per_replica, vllm_args=tuple(vllm_args), cache_dir=cache_dir,
                         api_key=api_key, storage_options=dict(storage_options) if storage_options else None,
                         router=router, rolling=rolling, poll_interval=poll_interval, metrics_port=metrics_port,
                         cpus_per_replica=cpus_per_replica, vllm_log_dir=vllm_log_dir,
                         keep=DEFAULT_KEEP if keep is None else keep, adapter_name=adapter_name, base_dir=base_dir,
                         cache_versions=cache_versions)
        stream = Stream(url, storage_options=spec.storage_options)
        stream.resolve("latest")  # a missing stream fails here
        adapter_options = [option for option, value in (("keep", keep), ("adapter_name", adapter_name),
                                                        ("base_dir", base_dir)) if value is not None]
        if adapter_options and stream.info().kind != STREAM_KIND_ADAPTER:  # else every server would fail to start
            raise FleetError(f"{', '.join(adapter_options)}: for adapter streams (LoRA); {url} is a weights stream",
                             hint="Leave them out")
        ray = _ray()
        if _find(spec.name) is not None:
            raise FleetError(f"a fleet named {spec.name} runs already on this cluster",
                             hint=f"Use Fleet.connect({url!r}), or stop it: `ckptstream fleet down {url}`")
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        # On this driver's node (the head, for `fleet up`), where a router it starts is expected; its loss
        # ends the fleet (its servers are the controller's actors).
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
        controller = ray.remote(FleetController).options(
            name=spec.name, namespace=NAMESPACE, lifetime="detached", max_concurrency=32, num_cpus=0,
            scheduling_strategy=here).remote(spec)
        try:
            ray.get(controller.servers.remote())
        except ray.exceptions.RayError as exc:
            ray.kill(controller, no_restart=True)
            raise FleetError(f"the fleet's controller did not start: {exc}",
                             hint="See the Ray logs of actor FleetController") from None
        self._controller, self.spec = controller, spec

    @classmethod
    def connect(cls, stream_url: str | None = None, *, name: str | None = None) -> Fleet:
        """The running fleet of ``stream_url`` (or named ``name``), started by any driver.

        Raises:
            FleetNotFoundError: none runs on the connected cluster.
        """
        _ray()
        if name is None:
            if stream_url is None:
                raise ValueError("give the stream URL or the fleet's name")
            name = fleet_name(stream_url)
        controller = _find(name)
        if controller is None:
            raise FleetNotFoundError(f"no fleet named {name} runs on this Ray cluster",
                                     hint="Start one with `ckptstream fleet up URL --replicas N`")
        fleet = cls.__new__(cls)
        fleet._controller = controller
        fleet.spec = fleet._call("info")["spec"]
        return fleet

    def _call(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        ray = _ray()
        try:
            return ray.get(getattr(self._controller, method).remote(*args), timeout=timeout)
        except ray.exceptions.RayActorError:
            raise FleetNotFoundError(f"the controller of fleet {self.spec.name} is gone",
                                     hint="Start the fleet again with `ckptstream fleet up`") from None

    @property
    def name(self) -> str:
        return self.spec.name

    def router_url(self) -> str | None:
        """The URL of the fleet's router (None: no router)."""
        router = self._call("info")["router"]
        return router["url"] if router else None

    def router_workers(self) -> list[str]:
        """The router's worker list, as the router reports it (empty without a router)."""
        router = self._call("info")["router"]
        return list(router["workers"]) if router else []

    def pids(self) -> list[int]:
        """Every process of the fleet on this machine's view: the controller's process and its children
        (the router), each server actor's process and its children (vLLM, its engine and workers)."""
        pids = list(self._call("info")["pids"])
        return pids + [pid for s in self._call("servers") for pid in s["pids"]]

    def status(self) -> list[ServerStatus]:
        """Per server: URL, version, state, lag, last pause, last error, from the stream's replica records
        (matched by replica id) and from the servers' actors."""
        stream = Stream(self.spec.url, storage_options=self.spec.storage_options)
        records: dict[str, ReplicaRecord] = {r.replica_id: r for r in stream.replicas()}
        versions = stream.versions()
        result = []
        for server in self._call("servers"):
            record = records.get(server["replica_id"])
            adapters = record is not None and record.adapter is not None
            version = server["version"] if server["version"] is not None else (
                record.version if record is not None and server["state"] == STATE_SERVING else None)
            state = server["state"]
            if state == STATE_SERVING and record is not None and record.state in _FOLLOWER_STATES:
                state = record.state
            last_update = server["last_update"] or {}
            result.append(ServerStatus(
                slot=server["slot"], replica_id=server["replica_id"], url=server["url"], node=server["node"],
                version=version, state=state,
                lag=None if version is None else sum(1 for v in versions if v > version),
                last_pause_s=last_update.get("pause_s"),
                last_error=(record.last_error if record is not None and record.last_error else None)
                or server["last_error"],
                restarts=server["restarts"], registered=server["registered"], metrics_url=server["metrics_url"],
                pids=server["pids"], resident=list(record.resident) if record is not None and adapters else []))
        return result

    def urls(self, min_version: int | None = None, *, resident: int | None = None) -> list[str]:
        """The URLs of the servers that serve ``min_version`` or newer (any version if None); on an adapter
        stream, with ``resident``, of those that hold that version as ``<name>@<version>``."""
        return [s.url for s in self.status() if s.url is not None and _serves(s, min_version, resident)]

    def wait_for_version(self, version: int, *, min_replicas: int | None = None, timeout: float | None = None,
                         poll_interval: float = 0.5, resident: bool = False) -> list[ServerStatus]:
        """Block until ``min_replicas`` servers (default: all the fleet's) serve ``version`` or newer (on an
        adapter stream with ``resident``: hold ``version`` itself as ``<name>@<version>``); returns the status
        of those.

        Raises:
            FleetTimeout: not reached within ``timeout`` seconds (naming what each server serves).
        """
        wanted = self.spec.replicas if min_replicas is None else min_replicas
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            status = self.status()
            serving = [s for s in status if _serves(s, None if resident else version, version if resident else None)]
            if len(serving) >= wanted:
                return serving
            if deadline is not None and time.monotonic() >= deadline:
                seen = ", ".join(f"{s.replica_id}: {s.state} v{s.version}" for s in status) or "no servers"
                raise FleetTimeout(f"{len(serving)} of {wanted} servers serve it after {timeout:.0f} s ({seen})",
                                   version=version, hint="See `ckptstream fleet status URL` for their errors")
            time.sleep(poll_interval)

    def scale(self, replicas: int) -> None:
        """Run ``replicas`` servers: new ones start on the newest version, the highest slots stop first."""
        self._call("scale", replicas)
        self.spec = self._call("info")["spec"]

    def replay(self, versions: str | Sequence[int], command: Sequence[str], *, servers: int | None = None
               ) -> list[FleetReplayResult]:
        """Evaluate versions on servers set aside from the fleet: ``servers`` of them (default: every server
        serving now) leave the router, their followers stand aside, the versions are spread over them, and
        each server runs ``command`` against each of its versions (with ``CKPTSTREAM_VERSION``,
        ``CKPTSTREAM_URL`` and ``CKPTSTREAM_VLLM_URL`` set) on its own node; then they follow again. On an
        adapter stream the versions are loaded as adapters beside what the servers serve (``CKPTSTREAM_MODEL``
        names the one to ask): no server leaves the router or stands aside.

        Returns one result per version, oldest first.
        """
        if not command:
            raise ValueError("give the evaluation command")
        stream = Stream(self.spec.url, storage_options=self.spec.storage_options)
        selected = select_versions(stream, versions) if isinstance(versions, str) else list(versions)
        if not selected:
            return []
        count = servers or len([s for s in self.status() if s.state == STATE_SERVING])
        if count < 1:
            raise FleetError("no server of the fleet serves now", hint="Wait for `ckptstream fleet status` "
                                                                       "to show servers serving")
        groups = [selected[i::count] for i in range(min(count, len(selected)))]
        results = [FleetReplayResult(version=r["version"], server=r["server"], exit_code=r["exit_code"],
                                     output=r["output"], load_s=r["load_s"], run_s=r["run_s"], error=r["error"])
                   for r in self._call("replay", groups, list(command))]
        return sorted(results, key=lambda r: r.version)

    def stop(self) -> None:
        """Stop every server and the router the fleet started, then the controller: no process is left."""
        ray = _ray()
        try:
            self._call("stop")
        finally:
            try:
                ray.kill(self._controller, no_restart=True)
            except ray.exceptions.RayError:
                pass


def _find(name: str) -> Any:
    import ray

    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return None


def _serves(server: ServerStatus, min_version: int | None, resident: int | None) -> bool:
    """Whether ``server`` serves, ``min_version`` or newer (any version if None), holding ``resident`` (an
    adapter stream's version) if given."""
    return (server.state in _SERVING_STATES and server.version is not None
            and (min_version is None or server.version >= min_version)
            and (resident is None or resident in server.resident))
