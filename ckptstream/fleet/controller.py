"""The fleet's controller: a detached, named Ray actor that supervises the fleet's server actors.

It outlives the driver that started it (``ckptstream fleet up`` returns; ``fleet status/down`` find it by
name in the ``ckptstream`` namespace). Once a second (``SUPERVISE_INTERVAL``) it polls every server:

- a server whose serve() returned (vLLM died), whose actor died (process killed) or whose node was lost is
  deregistered from the router, its actors killed, and a new server started in its slot (same replica id)
  on the stream's newest version; a death watch (one open ``wait_exit`` call per actor, answered the moment
  its vLLM exits or the actor dies) does this at once, without waiting for the round;
- a server that serves the newest good version (the newest committed one that no follower of the fleet
  refused) is registered with the router; the router's own worker list is the proof (``Router.add``).

The server actors are owned by the controller: they die with it. It also serves the fleet-wide update slot
of rolling updates (``slot.py``).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..errors import CkptStreamError, FleetError
from ..format import STREAM_KIND_ADAPTER
from ..reader import Stream
from ..process import descendants, free_port
from .server import ServerActor, log_to_stderr
from .spec import STATE_ASIDE, STATE_RESTARTING, STATE_SERVING, STATE_STARTING, FleetSpec

log = logging.getLogger("ckptstream.fleet")

SUPERVISE_INTERVAL = 1.0
"""Seconds between two rounds of supervision."""
POLL_WAIT = 10.0
"""Seconds a round waits for a server actor's answer (a busy actor is polled again next round)."""
STOP_WAIT = 60.0
"""Seconds a stop waits for a server's serve() to stop vLLM before its actor is killed."""
RESTART_BACKOFF = 5.0
"""Seconds before restarting a server that died without ever serving, doubled at each such death (a server
that cannot start, e.g. bad vLLM arguments, is not restarted in a tight loop)."""
MAX_RESTART_BACKOFF = 300.0


@dataclass
class _Server:
    """One slot of the fleet: its actors (rank 0 first) and what the last poll said."""

    slot: int
    replica_id: str
    actors: list[Any]
    group: Any = None  # the placement group of a multi-node engine
    url: str | None = None
    metrics_url: str | None = None
    node: str | None = None
    version: int | None = None
    state: str = STATE_STARTING
    registered: bool = False
    aside: bool = False
    restarts: int = 0
    served: bool = False  # vLLM answered with a version at least once
    failures: int = 0  # deaths in a row without serving
    start_at: float | None = None  # a restart held back until then (no actors meanwhile)
    last_error: str | None = None
    last_update: dict[str, Any] | None = None
    pids: list[int] = field(default_factory=list)
    watches: list[Any] = field(default_factory=list)  # one wait_exit() call per actor, answered at its death


class FleetController:
    """Supervises one fleet (decorated with ``ray.remote`` and started detached by ``Fleet``)."""

    def __init__(self, spec: FleetSpec):
        import ray

        log_to_stderr()
        self.spec = spec
        self._ray = ray
        self._lock = threading.RLock()
        self._servers: dict[int, _Server] = {}
        self._slot_holder: str | None = None
        self._unrouted: set[str] = set()  # URLs to remove from the router
        self._stopped = threading.Event()
        self._stream = Stream(spec.url, storage_options=spec.storage_options)
        self._router = self._open_router(spec)
        self._self = ray.get_runtime_context().current_actor
        self._actor_class = ray.remote(ServerActor)
        with self._lock:
            for slot in range(spec.replicas):
                self._servers[slot] = self._start_server(slot)
        self._thread = threading.Thread(target=self._supervise, name="ckptstream-fleet", daemon=True)
        self._thread.start()
        self._watcher = threading.Thread(target=self._watch_deaths, name="ckptstream-fleet-deaths", daemon=True)
        self._watcher.start()

    # ------------------------------------------------------------------------------ starting servers

    def _open_router(self, spec: FleetSpec) -> Any:
        if not spec.router:
            return None
        from .router import Router

        if spec.router == "start":
            host = self._ray.util.get_node_ip_address()
            log_file = None
            if spec.vllm_log_dir is not None:
                os.makedirs(spec.vllm_log_dir, exist_ok=True)
                log_file = os.path.join(spec.vllm_log_dir, f"{spec.name}-router.log")
            return Router.start(host=host, port=free_port(host), policy=spec.router_policy, log=log_file)
        return Router(spec.router, api_key=spec.api_key)

    def _start_server(self, slot: int, restarts: int = 0) -> _Server:
        """Start the actors of one server (a placement group keeps a multi-node engine's nodes together, one
        node each) and their serve()."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        spec = self.spec
        replica_id = f"{spec.name}-{slot}"
        resources = {"num_cpus": spec.cpus_per_replica, "num_gpus": spec.gpus_per_node}
        gate = None
        if spec.rolling:
            from .slot import router_gate

            gate = functools.partial(router_gate, self._router.url, self._self, spec.api_key)
        group = None
        options: list[dict[str, Any]] = [resources]
        if spec.nodes_per_replica > 1:
            from ray.util.placement_group import placement_group

            bundle = {"CPU": spec.cpus_per_replica, **({"GPU": spec.gpus_per_node} if spec.gpus_per_node else {})}
            group = placement_group([bundle] * spec.nodes_per_replica, strategy="STRICT_SPREAD",
                                    name=f"{replica_id}-{restarts}")
            options = [{**resources, "scheduling_strategy": PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=rank)} for rank in range(spec.nodes_per_replica)]
        # Threaded actors: poll() and replay() are answered while serve() runs.
        actors = [self._actor_class.options(max_concurrency=8, **options[rank]).remote(
            spec, replica_id, node_rank=rank, gate=gate if rank == 0 else None)
            for rank in range(spec.nodes_per_replica)]
        # The other nodes learn the head's address when it is placed (Ray resolves the reference first):
        # nothing here waits for the placement.
        master = actors[0].node_address.remote() if len(actors) > 1 else None
        for actor in actors:
            actor.start.remote(master)
        log.info("fleet %s: server %s started (slot %d, restart %d)", spec.name, replica_id, slot, restarts)
        return _Server(slot=slot, replica_id=replica_id, actors=actors, group=group, restarts=restarts,
                       watches=[actor.wait_exit.remote() for actor in actors])

    def _kill(self, server: _Server, *, graceful: bool) -> None:
        """Deregister a server and end its actors (after stopping its serve(), when ``graceful``)."""
        self._deregister(server)
        if graceful:
            try:
                self._ray.get([a.stop.remote(STOP_WAIT) for a in server.actors], timeout=STOP_WAIT + 10)
            except Exception as exc:  # noqa: BLE001 - dead or stuck: killed below either way
                log.info("fleet %s: server %s did not stop by itself (%s)", self.spec.name, server.replica_id, exc)
        for actor in server.actors:
            self._ray.kill(actor, no_restart=True)
        if server.group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(server.group)
        if self._slot_holder is not None and self._slot_holder == server.url:
            self._slot_holder = None

    # ------------------------------------------------------------------------------ router

    def _register(self, server: _Server) -> None:
        if self._router is None or server.registered or server.url is None:
            return
        self._unrouted.discard(server.url)
        try:
            self._router.add(server.url)
        except CkptStreamError as exc:
            server.last_error = str(exc)
            log.warning("fleet %s: could not register %s with the router: %s", self.spec.name, server.url, exc)
            return
        server.registered = True
        log.info("fleet %s: %s registered with the router (version %s)", self.spec.name, server.url, server.version)

    def _deregister(self, server: _Server) -> None:
        if self._router is None or not server.registered or server.url is None:
            return
        server.registered = False
        self._unrouted.add(server.url)
        self._remove_unrouted()

    def _remove_unrouted(self) -> None:
        """Remove from the router the URLs of servers gone or set aside; what fails is retried next round
        (a dead server must not stay in the router's worker list)."""
        for url in sorted(self._unrouted):
            try:
                self._router.remove(url)
            except CkptStreamError as exc:
                log.warning("fleet %s: could not deregister %s from the router (retrying): %s", self.spec.name,
                            url, exc)
                continue
            self._unrouted.discard(url)
            log.info("fleet %s: %s deregistered from the router", self.spec.name, url)

    # ------------------------------------------------------------------------------ supervision

    def _supervise(self) -> None:
        while not self._stopped.wait(SUPERVISE_INTERVAL):
            try:
                self._round()
            except Exception as exc:  # noqa: BLE001 - storage away for a moment: supervise again next round
                log.warning("fleet %s: supervision round failed: %s", self.spec.name, exc)

    def _watch_deaths(self) -> None:
        """Replace a server the moment one of its actors answers its ``wait_exit`` (vLLM exited) or dies: a
        dead server leaves the router at once, not at the next round (which waits on busy servers' polls)."""
        while not self._stopped.is_set():
            with self._lock:
                watched = {ref: server for server in self._servers.values() for ref in server.watches}
            if not watched:
                self._stopped.wait(SUPERVISE_INTERVAL)
                continue
            # The timeout only picks up servers started meanwhile; a death answers at once.
            done, _ = self._ray.wait(list(watched), num_returns=1, timeout=SUPERVISE_INTERVAL)
            for ref in done:
                try:
                    why = self._ray.get(ref)
                except self._ray.exceptions.RayError as exc:  # actor process killed, node lost
                    why = f"server actor died: {type(exc).__name__}"
                try:
                    self._replace(watched[ref], why)
                except Exception as exc:  # noqa: BLE001 - the round replaces it then
                    log.warning("fleet %s: replacing %s failed: %s", self.spec.name, watched[ref].replica_id, exc)

    def _round(self) -> None:
        """Poll every server; replace the dead; register those on the newest good version."""
        ray = self._ray
        with self._lock:
            for slot, server in list(self._servers.items()):
                if server.start_at is not None and time.monotonic() >= server.start_at:
                    fresh = self._start_server(slot, server.restarts)
                    fresh.failures, fresh.last_error = server.failures, server.last_error
                    self._servers[slot] = fresh
            servers = [s for s in self._servers.values() if s.actors]
            polls = {s.slot: [a.poll.remote() for a in s.actors] for s in servers}
        refs = [ref for batch in polls.values() for ref in batch]
        if not refs:
            return
        # One wait for all: a server still being placed (or busy) is polled again next round.
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=POLL_WAIT)
        answered = set(done)
        target = self._newest_good()
        if self._unrouted:
            with self._lock:
                self._remove_unrouted()
        for server in servers:
            if not all(ref in answered for ref in polls[server.slot]):
                continue
            try:
                infos = ray.get(polls[server.slot])
            except ray.exceptions.RayError as exc:  # actor process killed, node lost
                self._replace(server, f"server actor died: {type(exc).__name__}")
                continue
            exited = next((i["exit"] for i in infos if i["exit"] is not None), None)
            if exited is not None:
                self._replace(server, exited)
                continue
            with self._lock:
                if self._servers.get(server.slot) is not server:
                    continue  # scaled away or replaced meanwhile
                head = infos[0]
                server.url, server.node, server.version = head["url"], head["node"], head["version"]
                server.metrics_url = head["metrics_url"]
                server.last_update = head["last_update"] or server.last_update
                server.pids = [pid for info in infos for pid in info["pids"]]
                if server.aside:
                    server.state = STATE_ASIDE
                elif server.version is not None:
                    server.state, server.served = STATE_SERVING, True
                    if target is None or server.version >= target:
                        self._register(server)

    def _replace(self, server: _Server, why: str) -> None:
        with self._lock:
            if self._servers.get(server.slot) is not server or self._stopped.is_set():
                return
            failures = 0 if server.served else server.failures + 1
            delay = 0.0 if not failures else min(RESTART_BACKOFF * 2 ** (failures - 1), MAX_RESTART_BACKOFF)
            log.warning("fleet %s: server %s (%s) is gone: %s; starting a new one%s", self.spec.name,
                        server.replica_id, server.url, why, f" in {delay:.0f} s" if delay else "")
            self._kill(server, graceful=False)
            if delay:
                fresh = _Server(slot=server.slot, replica_id=server.replica_id, actors=[], state=STATE_RESTARTING,
                                restarts=server.restarts + 1, start_at=time.monotonic() + delay)
            else:
                fresh = self._start_server(server.slot, server.restarts + 1)
            fresh.failures, fresh.last_error = failures, why
            self._servers[server.slot] = fresh

    def _newest_good(self) -> int | None:
        """The newest committed version that no follower of this fleet refused (None: none committed)."""
        ids = {s.replica_id for s in self._servers.values()}
        refused = {int(v) for r in self._stream.replicas() if r.replica_id in ids for v in r.refused if v.isdigit()}
        good = [v for v in self._stream.versions() if v not in refused]
        return good[-1] if good else None

    # ------------------------------------------------------------------------------ the public calls

    def servers(self) -> list[dict[str, Any]]:
        """What the controller knows of each server (the handle adds the replica records)."""
        with self._lock:
            return [{"slot": s.slot, "replica_id": s.replica_id, "url": s.url, "metrics_url": s.metrics_url,
                     "node": s.node, "version": s.version,
                     "state": s.state, "registered": s.registered, "restarts": s.restarts,
                     "last_error": s.last_error, "last_update": s.last_update, "pids": list(s.pids)}
                    for s in sorted(self._servers.values(), key=lambda s: s.slot)]

    def info(self) -> dict[str, Any]:
        """The fleet's settings, its router's URL and worker list, and the PIDs of the controller's process
        and of what it started (the router)."""
        router = None
        if self._router is not None:
            try:
                workers, error = self._router.workers(), None
            except CkptStreamError as exc:  # the router is away: the fleet's own state still answers
                workers, error = [], str(exc)
            router = {"url": self._router.url, "workers": workers, "error": error}
        return {"spec": self.spec, "router": router, "pids": [os.getpid(), *descendants(os.getpid())]}

    def scale(self, replicas: int) -> None:
        """Start or stop servers until the fleet has ``replicas`` (the highest slots are stopped first)."""
        if replicas < 0:
            raise FleetError(f"cannot scale to {replicas} servers", hint="Give 0 or more")
        with self._lock:
            for slot in range(replicas):
                if slot not in self._servers:
                    self._servers[slot] = self._start_server(slot)
            leaving = [self._servers.pop(slot) for slot in sorted(self._servers) if slot >= replicas]
        for server in leaving:
            self._kill(server, graceful=True)
        self.spec = _with_replicas(self.spec, replicas)

    def replay(self, groups: list[list[int]], command: Sequence[str]) -> list[dict[str, Any]]:
        """Set ``len(groups)`` servers aside (out of the router), run the replay of ``groups[i]`` on the i-th
        inside its actor, and give them back to following; the results of every version. On an adapter stream
        no server is set aside: the versions are loaded as adapters beside what it serves, and it keeps
        serving through the router."""
        beside = self._stream.info().kind == STREAM_KIND_ADAPTER
        with self._lock:
            ready = [s for s in sorted(self._servers.values(), key=lambda s: s.slot)
                     if s.state == STATE_SERVING and not s.aside]
            if len(ready) < len(groups):
                raise FleetError(f"{len(groups)} servers asked for the replay, {len(ready)} serve now",
                                 hint="Wait for the fleet to serve (`ckptstream fleet status`), or ask for fewer")
            chosen = ready[:len(groups)]
            for server in () if beside else chosen:
                server.aside = True
                server.state = STATE_ASIDE
                self._deregister(server)
        try:
            calls = [s.actors[0].replay.remote(g, list(command)) for s, g in zip(chosen, groups)]
            results = []
            for server, group, call in zip(chosen, groups, calls):
                try:
                    results += self._ray.get(call)
                except self._ray.exceptions.RayError as exc:  # the server died meanwhile: its versions failed
                    error = f"the replay on {server.url} failed: {type(exc).__name__}: {exc}"[:2000]
                    results += [{"version": v, "server": server.url, "exit_code": None, "output": None,
                                 "load_s": 0.0, "run_s": 0.0, "error": error} for v in group]
        finally:
            with self._lock:
                for server in () if beside else chosen:
                    server.aside = False  # registered again once its follower brought it back to the newest
                    server.state = STATE_STARTING
        return results

    def try_slot(self, holder: str) -> bool:
        """Take the fleet-wide update slot for ``holder`` if free (or already its own)."""
        with self._lock:
            if self._slot_holder in (None, holder):
                self._slot_holder = holder
                return True
            return False

    def release_slot(self, holder: str) -> None:
        with self._lock:
            if self._slot_holder == holder:
                self._slot_holder = None

    def stop(self) -> None:
        """Stop every server (serve stops vLLM; then the actors are killed) and the router if it started it."""
        self._stopped.set()
        self._thread.join(timeout=POLL_WAIT + 5)
        self._watcher.join(timeout=SUPERVISE_INTERVAL + 5)
        with self._lock:
            leaving = list(self._servers.values())
            self._servers.clear()
        for server in leaving:
            self._kill(server, graceful=True)
        if self._router is not None:
            self._router.close()


def _with_replicas(spec: FleetSpec, replicas: int) -> FleetSpec:
    import dataclasses

    return dataclasses.replace(spec, replicas=replicas)
