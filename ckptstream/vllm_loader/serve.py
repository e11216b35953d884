"""``ckptstream serve``: materialize a version, start vLLM on it as a child process, follow the stream.

On a CPU machine ``serve`` needs no vLLM arguments: when vLLM's platform is CPU (decided the way vLLM
decides it, from the installed distribution, without importing vLLM: ``vllm_platform_is_cpu``) and the
user set neither, it passes ``VLLM_CPU_KVCACHE_SPACE`` and ``--gpu-memory-utilization`` sized for a CPU
(vLLM's CPU backend otherwise reserves 92 % of the memory node and refuses to start when that much is
not free), and ``--skip-tokenizer-init`` for a model without tokenizer files; it logs what it added.

vLLM runs as a child process (``vllm_child``; from a terminal, in a session of its own): its output goes through
this process (to the log file, or to stderr), and its last lines are kept so that a start that fails is reported
with vLLM's own error line.

An engine spanning nodes (``nnodes`` > 1) is served by one ``serve`` per node, with the same stream and
vLLM arguments: node rank 0 starts vLLM's head (the API server) with the follower, which reloads a version
only once every rank holds it (``worker.WorkerExtension``, passed as ``--worker-extension-cls``); every other
rank starts vLLM ``--headless`` (its workers only) with a ``NodeAgent`` preparing each version into that
node's cache at the same path. Every node materializes the start version first: vLLM's workers load the
model from their own node's disk.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import signal
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Sequence

from ..basehash import base_model_hash
from ..credentials import redact
from ..errors import SourceNotFoundError, VllmArgumentError, VllmUnreachable
from ..format import LATEST, STREAM_KIND_ADAPTER
from ..lora_aliases import ALIASES_ENV
from ..process import free_port
from ..reader import Stream
from ..reader.adapter import DEFAULT_KEEP, check_adapter_fits
from ..shm import EngineSegments
from .adapters.follower import AdapterFollower, default_adapter_name
from .follow.agent import NodeAgent
from .follow.cache import safe_owner
from .client import VllmClient
from .follow.config import FollowerConfig
from .follow.follower import Follower
from .load_format import LOAD_FORMAT, PLUGIN, loader_installed
from .pause_route import MIDDLEWARE
from .observe import OnUpdate, UpdateRecord
from .worker import EXTENSION_CLASS
from .vllm_args import has_option, int_option
from .vllm_child import last_error_line, start_child, stop_child, stop_on_signals, watch_child

log = logging.getLogger("ckptstream.serve")

CPU_KVCACHE_SPACE_GIB = "1"
"""``VLLM_CPU_KVCACHE_SPACE`` (GiB) that ``serve`` sets on a CPU platform when the user set none."""
CPU_MEMORY_FRACTION = "0.3"
"""``--gpu-memory-utilization`` (on CPU: the fraction of the memory node) ``serve`` passes on a CPU platform."""
CPU_VLLM_ARGS = ["--skip-tokenizer-init", "--enforce-eager", "--dtype", "bfloat16",
                 "--gpu-memory-utilization", CPU_MEMORY_FRACTION, "--max-model-len", "512", "--max-num-seqs", "8"]
"""vLLM arguments for a tiny model on vllm-cpu on a small machine (DESIGN.md, "What was verified")."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
READY_TIMEOUT = 900.0
"""Seconds a vLLM server may take from its start to its first answer (loading a large model included)."""
NODES_READY_TIMEOUT = 60.0
API_KEY_ENV = "VLLM_API_KEY"
"""The environment variable vLLM reads its API key from (``--api-key`` wins over it)."""
"""Seconds the head of a multi-node engine waits for every node to hold a version before retrying later."""
VLLM_MASTER_PORT = 29501
"""vLLM's default ``--master-port`` (``ParallelConfig.master_port``): part of a multi-node engine's default id."""

def vllm_command(model_dir: str, host: str, port: int, vllm_args: Sequence[str], served_name: str) -> list[str]:
    """The vLLM OpenAI server command line (``python -m``: the ``vllm`` script fails under vllm-cpu), with
    ckptstream's worker extension unless the user names their own (vLLM takes one: then only a vLLM that
    labels versions itself, 0.25 on, can be followed, and no update is applied in place), and ckptstream's
    middleware (``pause_route``: an in-place update's pause in one call; vLLM takes several)."""
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
               "--host", host, "--port", str(port)]
    if "--served-model-name" not in vllm_args:
        command += ["--served-model-name", served_name]
    if not has_option(vllm_args, "--worker-extension-cls"):
        command += ["--worker-extension-cls", EXTENSION_CLASS]
    if not any(arg == MIDDLEWARE or arg.endswith(f"={MIDDLEWARE}") for arg in vllm_args):
        command += ["--middleware", MIDDLEWARE]
    return command + list(vllm_args)


def vllm_headless_command(model_dir: str, vllm_args: Sequence[str]) -> list[str]:
    """vLLM's CLI ``serve MODEL ... --headless`` command line (a node that runs only workers)."""
    return [sys.executable, "-m", "ckptstream.vllm_loader.vllm_main", "serve", model_dir, *vllm_args, "--headless"]


def multinode_vllm_args(vllm_args: Sequence[str], nnodes: int, node_rank: int, master_addr: str,
                        master_port: int | None) -> list[str]:
    """The user's vLLM arguments plus what every node of a multi-node engine needs: its place in the
    engine, the multiprocessing executor (unless chosen), and ckptstream's worker extension."""
    args = [*vllm_args, "--nnodes", str(nnodes), "--node-rank", str(node_rank), "--master-addr", master_addr]
    if master_port is not None:
        args += ["--master-port", str(master_port)]
    if not has_option(args, "--distributed-executor-backend"):
        args += ["--distributed-executor-backend", "mp"]
    if has_option(args, "--worker-extension-cls"):
        raise ValueError("serve passes vLLM --worker-extension-cls itself (ckptstream's, to ask each node "
                         "what it holds); vLLM takes only one")
    return args + ["--worker-extension-cls", EXTENSION_CLASS]


def engine_id(master_addr: str, master_port: int | None) -> str:
    """The default id of a multi-node engine, the same on every node: its master address and port."""
    return safe_owner(f"{master_addr}-{master_port or VLLM_MASTER_PORT}")


def vllm_platform_is_cpu(environ: dict[str, str] | None = None) -> bool:
    """Whether vLLM, started here, runs on its CPU platform: vLLM's own rule (``vllm/platforms``:
    ``VLLM_TARGET_DEVICE=cpu``, a version string containing ``cpu``, which the ``vllm-cpu`` distribution
    gets, or macOS), read from package metadata: importing vLLM here would cost seconds and memory in a
    process that only talks HTTP to it."""
    environ = os.environ if environ is None else environ
    if environ.get("VLLM_TARGET_DEVICE") == "cpu" or sys.platform.startswith("darwin"):
        return True
    try:
        version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        try:
            version = importlib.metadata.version("vllm-cpu") + "+cpu"
        except importlib.metadata.PackageNotFoundError:
            return False
    return "cpu" in version


def default_vllm_settings(vllm_args: Sequence[str], environ: dict[str, str], model_dir: str | os.PathLike[str],
                          *, cpu: bool, api_key: str | None = None) -> tuple[list[str], dict[str, str], list[str]]:
    """The vLLM arguments and environment ``serve`` starts vLLM with: the user's, plus defaults for what
    they left unset that vLLM cannot start without here, ``--load-format ckptstream`` for an engine of several
    ranks (``load_format``; tensor and pipeline parallel sizes as given on the command line), and ``api_key``
    in the environment (``API_KEY_ENV``: on vLLM's command line every user of the host could read it, in
    ``/proc/PID/cmdline``). Returns (args, environment, what was added)."""
    args, env, added = list(vllm_args), dict(environ), []
    ranks = (int_option(args, "--tensor-parallel-size") or int_option(args, "-tp") or 1) * (
        int_option(args, "--pipeline-parallel-size") or int_option(args, "-pp") or 1)
    if ranks > 1 and not has_option(args, "--load-format"):
        if loader_installed(env):
            args += ["--load-format", LOAD_FORMAT]
            added.append(f"--load-format {LOAD_FORMAT}")
        else:
            log.warning("vLLM plugin %s not installed (pip install ckptstream again) or left out by VLLM_PLUGINS: "
                        "each rank reads the whole model at start", PLUGIN)
    if api_key:
        env[API_KEY_ENV] = api_key
    if cpu:
        if "VLLM_CPU_KVCACHE_SPACE" not in env and not has_option(args, "--kv-cache-memory-bytes"):
            env["VLLM_CPU_KVCACHE_SPACE"] = CPU_KVCACHE_SPACE_GIB
            added.append(f"VLLM_CPU_KVCACHE_SPACE={CPU_KVCACHE_SPACE_GIB}")
        if not has_option(args, "--gpu-memory-utilization"):
            args += ["--gpu-memory-utilization", CPU_MEMORY_FRACTION]
            added.append(f"--gpu-memory-utilization {CPU_MEMORY_FRACTION}")
    if not any(has_option(args, o) for o in ("--skip-tokenizer-init", "--tokenizer")) and \
            not any((Path(model_dir) / name).is_file() for name in TOKENIZER_FILES):
        args.append("--skip-tokenizer-init")
        added.append("--skip-tokenizer-init")
    return args, env, added


# ------------------------------------------------------------------------------ adapter streams (LoRA)

MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM (0.32) takes for ``--max-lora-rank`` (``config/lora.py:26``)."""
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
"""Without it vLLM has no ``/v1/load_lora_adapter`` (``entrypoints/serve/lora/api_router.py:30``) and asks no
resolver for an unknown adapter name."""


def adapter_vllm_settings(vllm_args: Sequence[str], *, keep: int, rank: int,
                          aliases: str | os.PathLike[str]) -> tuple[list[str], dict[str, str]]:
    """The vLLM arguments and environment variables for serving an adapter stream's newest ``keep`` versions
    of rank ``rank`` beside the base model: the user's arguments plus what they left unset. Returns (args,
    environment variables to add).

    - ``--enable-lora``, and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` for vLLM's runtime adapter routes;
    - ``--max-loras`` (adapters in one batch): ``keep + 1``, the stable name being an adapter of its own
      beside the version it means; more adapters than that wait for a batch, none fails;
    - ``--max-cpu-loras`` (adapters vLLM's engine keeps loaded): ``keep + 2``, room for the version being
      loaded, so that no resident adapter is dropped and read from its directory again at its next request;
    - ``--max-lora-rank``: the smallest value vLLM takes that is at least ``rank``;
    - ``lora_aliases.ALIASES_ENV`` = ``aliases``, the alias file of the stable name's resolver.

    Raises:
        VllmArgumentError: the user's arguments contradict these (fewer slots, a smaller rank, no request
            statistics, which tell which adapters are in use), or ``rank`` is above what vLLM can serve.
    """
    if keep < 1:
        raise VllmArgumentError(f"--keep must be at least 1, not {keep}")
    fitting = [r for r in MAX_LORA_RANKS if r >= rank]
    if not fitting:
        raise VllmArgumentError(f"the adapters' rank {rank} is above vLLM's largest --max-lora-rank "
                                f"{MAX_LORA_RANKS[-1]}")
    if has_option(vllm_args, "--disable-log-stats"):
        raise VllmArgumentError("an adapter stream needs vLLM's request statistics (they tell which adapter "
                                "versions requests use, so that none is unloaded under a request)",
                                hint="Leave out --disable-log-stats")
    args = list(vllm_args)
    if not has_option(args, "--enable-lora"):
        args.append("--enable-lora")
    slots = keep + 1
    max_loras = int_option(args, "--max-loras")
    if max_loras is None:
        args += ["--max-loras", str(slots)]
    elif max_loras < slots:
        raise VllmArgumentError(f"--max-loras {max_loras} is below --keep {keep} + 1 (the stable name is an "
                                f"adapter of its own)", hint=f"Pass --max-loras {slots} or more, or a smaller --keep")
    if int_option(args, "--max-cpu-loras") is None:
        args += ["--max-cpu-loras", str(max(keep + 2, max_loras or slots))]
    max_rank = int_option(args, "--max-lora-rank")
    if max_rank is None:
        args += ["--max-lora-rank", str(fitting[0])]
    elif max_rank < rank:
        raise VllmArgumentError(f"--max-lora-rank {max_rank} is below the adapters' rank {rank}",
                                hint=f"Pass --max-lora-rank {fitting[0]} or leave it out")
    return args, {RUNTIME_LORA_ENV: "True", ALIASES_ENV: str(aliases)}


def serve(url: str, vllm_args: Sequence[str], *, version: int | str = LATEST, pin: bool = False,
          host: str = "127.0.0.1", port: int = 8000, ready_timeout: float = READY_TIMEOUT,
          stop: threading.Event | None = None, vllm_log: str | os.PathLike[str] | None = None,
          nnodes: int = 1, node_rank: int = 0, master_addr: str | None = None, master_port: int | None = None,
          config: FollowerConfig | None = None, on_exit: Callable[[int], object] | None = None,
          keep: int = DEFAULT_KEEP, adapter_name: str | None = None, base_dir: str | os.PathLike[str] | None = None,
          **options: Any) -> int:
    """Serve ``version`` of the stream with a vLLM child process and keep it on the newest version.

    On an adapter stream (LoRA) vLLM serves the base model, with the stream's newest ``keep`` versions as
    runtime adapters ``<adapter_name>@<version>`` and the stable name ``adapter_name`` meaning the newest
    (``AdapterFollower``; vLLM's LoRA arguments from ``adapter_vllm_settings``). The base model is
    ``base_dir``, by default the directory the stream's ``stream.json`` names, and is served as its directory's
    name (``--served-model-name`` to choose). Each new version is loaded without pausing anything;
    ``version``, ``pin`` and ``nnodes`` are for weights streams.

    Args:
        vllm_args: arguments for vLLM's OpenAI server (``--model``, ``--host`` and ``--port`` are set
            here; CPU-sized memory settings and ``--skip-tokenizer-init`` are added when needed and unset).
        pin: serve ``version`` only; do not follow.
        stop: set it to stop (Ctrl-C and SIGTERM set it too when called from the main thread).
        vllm_log: a file for vLLM's output (default: this process's stderr).
        nnodes, node_rank, master_addr, master_port: one node of an engine spanning ``nnodes`` nodes
            (vLLM's options of those names; run ``serve`` on every node). Rank 0 runs the API server and
            the follower; the others vLLM ``--headless`` and a node agent. The engine's id (its head's
            replica id, naming the cache directory on every node) is ``replica_id`` if given (the same on
            every node), else ``<master_addr>-<master_port>``.
        on_exit: called with vLLM's exit code the moment its process exits (also when serve stopped it),
            before serve stops the follower and collects vLLM's last output: a supervisor learns of a death
            at once, while serve's return waits for that output, whose pipe vLLM's orphaned children may
            hold open for seconds.
        config, options: the follower's options (``FollowerConfig`` and/or its fields as keywords:
            ``cache_dir``, ``replica_id``, ``poll_interval``, ``api_key``, ``observers``,
            ``metrics_port``, ...).
        keep, adapter_name, base_dir: for an adapter stream (see above; ``adapter_name`` defaults to the
            stream URL's last part).

    Returns the exit code: 0 after a stop request, 1 if vLLM exited on its own after starting.

    Raises:
        VllmUnreachable: vLLM did not start (with vLLM's own last error line).
        VllmArgumentError: vLLM's arguments contradict what an adapter stream needs, or options of the other
            stream kind were given.
        SourceNotFoundError: an adapter stream's base model is not at ``base_dir`` (or where stream.json says).
    """
    if host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("vLLM's dev-mode control routes are unauthenticated: binding them to %s exposes them; "
                    "use --api-key and network isolation", host)
    config = (config or FollowerConfig()).with_options(**options)
    if Stream(url, storage_options=config.storage_options).info().kind == STREAM_KIND_ADAPTER:
        weights_only = [name for name, given in (("version", version != LATEST), ("pin", pin), ("nnodes", nnodes > 1),
                                                 ("pin", config.pin is not None)) if given]
        if weights_only:
            raise VllmArgumentError(f"{', '.join(sorted(set(weights_only)))}: for weights streams; {url} is an "
                                    "adapter stream", hint="Leave them out: its newest versions are served")
        return _serve_adapters(url, vllm_args, keep=keep, name=adapter_name, base_dir=base_dir, host=host, port=port,
                               ready_timeout=ready_timeout, stop=stop or threading.Event(), vllm_log=vllm_log,
                               on_exit=on_exit, config=config)
    adapters_only = [name for name, given in (("keep", keep != DEFAULT_KEEP), ("adapter_name", adapter_name),
                                              ("base_dir", base_dir)) if given]
    if adapters_only:
        raise VllmArgumentError(f"{', '.join(adapters_only)}: for adapter streams; {url} is a weights stream",
                                hint="Leave them out")
    if nnodes > 1:
        if master_addr is None:
            raise ValueError("an engine spanning nodes needs master_addr (the head node's address)")
        if not 0 <= node_rank < nnodes:
            raise ValueError(f"node_rank {node_rank} is not in 0..{nnodes - 1}")
        vllm_args = multinode_vllm_args(vllm_args, nnodes, node_rank, master_addr, master_port)
        config = config.with_options(replica_id=config.replica_id or engine_id(master_addr, master_port),
                                     nnodes=nnodes,
                                     nodes_ready_timeout=config.nodes_ready_timeout or NODES_READY_TIMEOUT)
        if node_rank > 0:
            return _serve_node(url, vllm_args, version=version, pin=pin, stop=stop or threading.Event(),
                               vllm_log=vllm_log, nnodes=nnodes, node_rank=node_rank, config=config,
                               on_exit=on_exit)
    base_url = f"http://{'[::1]' if host == '::1' else host}:{port}"
    with Follower(url, [base_url], config) as follower:
        first = follower.stream.resolve(version)
        if pin:
            follower.pin = follower.record.pin = first
        path, _, fetched, _ = follower.prepare(first)
        log.info("version %d materialized in %s (%.1f MB fetched); starting vLLM", first, path, fetched / 1e6)
        cpu = vllm_platform_is_cpu()
        args, env, added = default_vllm_settings(vllm_args, {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}, path,
                                                 cpu=cpu, api_key=config.api_key)
        if added:
            log.info("passing vLLM %s, which you did not set%s (set them to override)", ", ".join(added),
                     " and its CPU platform needs" if cpu else "")
        served_name = url.rstrip("/").rsplit("/", 1)[-1] or "ckptstream"
        stop = stop or threading.Event()

        def follow(client: VllmClient) -> None:
            client.set_weight_version(str(first))
            follower.adopt(first)
            log.info("vLLM serves version %d at %s", first, base_url)
            if not stop.is_set():
                follower.run(stop)

        return _run_child(vllm_command(str(path), host, port, args, served_name), env, base_url, config.api_key,
                          ready_timeout, stop, vllm_log, on_exit, follow)


def _serve_adapters(url: str, vllm_args: Sequence[str], *, keep: int, name: str | None,
                    base_dir: str | os.PathLike[str] | None, host: str, port: int, ready_timeout: float,
                    stop: threading.Event, vllm_log: str | os.PathLike[str] | None,
                    on_exit: Callable[[int], object] | None, config: FollowerConfig) -> int:
    """``serve`` on an adapter stream: vLLM on the base model with LoRA on, the adapter follower beside it."""
    adapter = Stream(url, storage_options=config.storage_options).info().adapter
    assert adapter is not None  # an adapter stream's stream.json has its block
    base = Path(base_dir if base_dir is not None else adapter.base_name)
    if not (base / "config.json").is_file():
        raise SourceNotFoundError(f"the base model of the adapter stream {url}, {str(base)!r}, is no model "
                                  "directory here",
                                  hint="Pass --base-dir DIR: the base model's directory (config.json and weights)")
    check_adapter_fits(adapter, base_hash=base_model_hash(base), max_lora_rank=None, version=None,  # before vLLM
                       server=str(base))
    name = name or default_adapter_name(url)
    served_name = base.resolve().name
    if served_name == name:  # vLLM refuses an adapter named like the model it serves
        served_name = f"{name}-base"
    with tempfile.TemporaryDirectory(prefix="ckptstream-lora-") as private:
        aliases = Path(private) / "aliases.json"
        args, adapter_env = adapter_vllm_settings(vllm_args, keep=keep, rank=adapter.rank, aliases=aliases)
        cpu = vllm_platform_is_cpu()
        args, env, added = default_vllm_settings(args, {**os.environ, "VLLM_SERVER_DEV_MODE": "1", **adapter_env},
                                                 base, cpu=cpu, api_key=config.api_key)
        if added:
            log.info("passing vLLM %s, which you did not set%s (set them to override)", ", ".join(added),
                     " and its CPU platform needs" if cpu else "")
        if cpu:  # tests/vllm_loader/test_adapters.py::test_base_requests_beside_adapter_requests (a strict xfail)
            log.warning("vLLM's CPU LoRA ops give base-model requests batched beside adapter requests the last "
                        "adapter slot's weights (a vLLM bug, not on GPUs): ask for %s on a server of its own where "
                        "its outputs matter", served_name)
        base_url = f"http://{'[::1]' if host == '::1' else host}:{port}"

        def follow(client: VllmClient) -> None:
            with AdapterFollower(url, [client], name=name, keep=keep, aliases=aliases,
                                 cache_dir=config.cache_dir, storage_options=dict(config.storage_options or {}),
                                 poll_interval=config.poll_interval, lease_ttl=config.lease_ttl,
                                 replica_id=config.replica_id, observers=config.observers,
                                 metrics_port=config.metrics_port, metrics_host=config.metrics_host,
                                 heartbeat_interval=config.heartbeat_interval) as follower:
                log.info("vLLM serves %s at %s; adapter %s follows the stream", served_name, base_url, name)
                follower.run(stop)  # its first round at once: the newest version

        log.info("starting vLLM on the base model %s for the adapter stream %s", base, redact(url))
        return _run_child(vllm_command(str(base), host, port, args, served_name), env, base_url, config.api_key,
                          ready_timeout, stop, vllm_log, on_exit, follow)


def _serve_node(url: str, vllm_args: Sequence[str], *, version: int | str, pin: bool, stop: threading.Event,
                vllm_log: str | os.PathLike[str] | None, nnodes: int, node_rank: int, config: FollowerConfig,
                on_exit: Callable[[int], object] | None) -> int:
    """Node ``node_rank`` > 0 of a multi-node engine: prepare the start version, start vLLM ``--headless``
    on it, keep this node's cache on the newest version until ``stop``."""
    assert config.replica_id is not None
    with NodeAgent(url, engine=config.replica_id, node_rank=node_rank, nnodes=nnodes, config=config) as agent:
        first = agent.stream.resolve(version)
        if pin:
            agent.pin = agent.record.pin = first
        path = agent.prepare(first)
        cpu = vllm_platform_is_cpu()
        # VLLM_TARGET_DEVICE: vLLM's CLI does not detect the CPU platform of a vllm-cpu install by itself.
        environ = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", **({"VLLM_TARGET_DEVICE": "cpu"} if cpu else {})}
        args, env, added = default_vllm_settings(vllm_args, environ, path, cpu=cpu)
        if added:
            log.info("passing vLLM %s, which you did not set (set them to override)", ", ".join(added))
        log.info("version %d materialized in %s; starting vLLM's workers of node %d", first, path, node_rank)
        child, output, log_file = start_child(vllm_headless_command(str(path), args), env, vllm_log)
        previous, signalled = stop_on_signals(stop, child)
        watch_child(child, stop, on_exit)
        try:
            agent.run(stop)
        finally:
            exited_alone = stop_child(child, output, log_file, EngineSegments())
            for sig, handler in previous.items():  # (after the stop: a second Ctrl-C hurries it)
                signal.signal(sig, handler)
        if exited_alone and not signalled.is_set():
            log.error("vLLM exited with code %s: %s", child.returncode, last_error_line(list(output.lines)))
            return 1
        return 0


def _run_child(command: list[str], env: dict[str, str], base_url: str, api_key: str | None, ready_timeout: float,
               stop: threading.Event, vllm_log: str | os.PathLike[str] | None,
               on_exit: Callable[[int], object] | None, follow: Callable[[VllmClient], None]) -> int:
    """Start vLLM, wait until it generates, ``follow`` it until ``stop``; stop vLLM."""
    child, output, log_file = start_child(command, env, vllm_log)
    previous, signalled = stop_on_signals(stop, child)
    died = watch_child(child, stop, on_exit)
    segments = EngineSegments()
    try:
        client = VllmClient(base_url, api_key=api_key)
        try:
            client.wait_ready(timeout=ready_timeout, abort=stop)
        except VllmUnreachable:
            if signalled.is_set() or (stop.is_set() and not died.is_set()):
                log.info("stopped while vLLM was starting")
                return 0
            if not died.is_set():
                raise
            output.thread.join(timeout=10)  # the rest of what it said
            raise VllmUnreachable(f"vLLM exited with code {child.returncode} while starting: "
                                  f"{last_error_line(list(output.lines)) or 'it printed nothing'}",
                                  hint="Fix the vLLM arguments after `--`"
                                       + (f" (its output is in {vllm_log})" if vllm_log else "")) from None
        segments.note(child.pid)  # (those of a vLLM that exits on its own, too)
        follow(client)
    finally:
        exited_alone = stop_child(child, output, log_file, segments)
        for sig, handler in previous.items():  # (after the stop: a second Ctrl-C hurries it)
            signal.signal(sig, handler)
    if exited_alone:
        log.error("vLLM exited with code %s: %s", child.returncode, last_error_line(list(output.lines)))
        return 1
    return 0


class BackgroundServe:
    """``serve`` on a background thread (for demos and benchmarks): vLLM's output goes to
    ``<workdir>/vllm.log``, decoded versions to ``<workdir>/cache``, and every update's figures to
    ``updates`` (by version). ``close()`` stops vLLM and the follower."""

    def __init__(self, url: str, workdir: str | os.PathLike[str], *, replica_id: str, poll_interval: float = 0.2,
                 vllm_args: Sequence[str] | None = None):
        import torch

        self.port = free_port()
        self.log = os.path.join(workdir, "vllm.log")
        self.updates: dict[int, UpdateRecord] = {}
        self.stop = threading.Event()
        self.client = VllmClient(f"http://127.0.0.1:{self.port}")
        if vllm_args is None:
            vllm_args = [] if torch.cuda.is_available() else CPU_VLLM_ARGS
        self.thread = threading.Thread(
            target=serve, name="ckptstream-serve",
            kwargs=dict(url=url, vllm_args=vllm_args, port=self.port, cache_dir=os.path.join(workdir, "cache"),
                        poll_interval=poll_interval, stop=self.stop, vllm_log=self.log, replica_id=replica_id,
                        observers=[OnUpdate(lambda update: self.updates.__setitem__(update.version, update))]))
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
