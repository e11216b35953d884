"""Looking at a stream: ``info``, ``ls``, ``show``, ``diff`` and ``replicas``."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from ..credentials import redact
from ..errors import EXIT_OK, CkptStreamError
from .options import VERSION_HELP, add_command, add_url, open_stream, version_ref
from .output import human, print_json, table, version_summary, version_text

if TYPE_CHECKING:
    from ..format import StreamInfo
    from ..reader.replicas import ReplicaRecord


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "info", run_info, "describe a stream: identity, kind (weights, or an adapter of which base "
                                           "model), assets, versions", """
        ckptstream info /mnt/nfs/run1
        ckptstream info s3://bucket/lora1 --json | jq .adapter.base
        """)
    add_url(p)

    p = add_command(sub, "ls", run_ls, "list the versions of a stream", """
        ckptstream ls /mnt/nfs/run1
        ckptstream ls s3://bucket/run1 --json | jq '.[-1]'
        ckptstream ls http://relay-host:8700 -o token=T   # HTTP: versions near the newest, found by probing
        """)
    add_url(p)

    p = add_command(sub, "show", run_show, "describe one version: kind, chain, bytes stored vs full, changes", """
        ckptstream show /mnt/nfs/run1 latest
        ckptstream show /mnt/nfs/run1 12 --tensors
        """)
    add_url(p)
    p.add_argument("ref", metavar="VERSION", type=version_ref, help=VERSION_HELP)
    p.add_argument("--tensors", action="store_true", help="list every tensor")

    p = add_command(sub, "diff", run_diff, "compare two versions tensor by tensor", """
        ckptstream diff /mnt/nfs/run1 11 12
        ckptstream diff /mnt/nfs/run1 0 latest --all --json
        """)
    add_url(p)
    p.add_argument("a", metavar="A", type=version_ref, help=VERSION_HELP)
    p.add_argument("b", metavar="B", type=version_ref, help=VERSION_HELP)
    p.add_argument("--all", action="store_true", help="also list unchanged tensors")

    p = add_command(sub, "replicas", run_replicas,
                    "list the followers and mirrors of a stream: what each serves or has copied", """
        ckptstream replicas /mnt/nfs/run1
        ckptstream replicas s3://bucket/run1 --json
        """)
    add_url(p)


def run_info(args: argparse.Namespace) -> int:
    stream = open_stream(args)
    info = stream.info()
    versions = stream.versions()
    summary = {"url": args.url, "stream_id": info.stream_id, "created": info.created,
               "format_version": info.format_version, "kind": info.kind,
               "adapter": None if info.adapter is None else info.adapter.to_json(),
               "assets": [a.to_json() for a in info.assets], "versions": len(versions),
               "oldest": versions[0] if versions else None, "latest": versions[-1] if versions else None}
    if args.json:
        print_json(summary)
        return EXIT_OK
    print(f"stream       {redact(args.url)}\nstream_id    {info.stream_id}\ncreated      {info.created}\n"
          f"kind         {stream_kind_line(info)}")
    if info.adapter is not None:
        print(f"base model   {info.adapter.base_name} ({info.adapter.base_hash or 'hash unknown'})")
    print(f"assets       {', '.join(f'{a.name} ({human(a.size)})' for a in info.assets) or '-'}\n"
          f"versions     {len(versions)}" + (f" ({versions[0]} to {versions[-1]})" if versions else ""))
    return EXIT_OK


def stream_kind_line(info: StreamInfo) -> str:
    """The kind of a stream for people: ``weights``, or ``adapter (LoRA rank 8 on q_proj, v_proj)``."""
    if info.adapter is None:
        return info.kind
    return f"{info.kind} (LoRA rank {info.adapter.rank} on {', '.join(info.adapter.target_modules) or '-'})"


def run_ls(args: argparse.Namespace) -> int:
    from concurrent.futures import ThreadPoolExecutor

    stream = open_stream(args)
    versions = stream.versions()

    def describe(v: int) -> dict[str, Any]:
        try:
            return version_summary(stream.manifest(v))
        except CkptStreamError as exc:
            return {"version": v, "error": str(exc)}

    with ThreadPoolExecutor(16) as pool:
        rows = list(pool.map(describe, versions))
    if args.json:
        print_json(rows)
        return EXIT_OK
    if not rows:
        print(f"no versions in {redact(args.url)}", file=sys.stderr)
        return EXIT_OK
    adapter = stream.info().adapter
    if adapter is not None:  # (a weights stream's listing stays as it was)
        print(f"adapter stream of base {adapter.base_name}: {stream_kind_line(stream.info())}")
    lines = []
    for r in rows:
        if "error" in r:
            lines.append([str(r["version"]), "CORRUPT", "", "", "", "", "", r["error"]])
            continue
        lines.append([str(r["version"]), r["kind"], "-" if r["base_version"] is None else str(r["base_version"]),
                      str(r["chain_length"]), "-" if r["step"] is None else str(r["step"]),
                      human(r["stored_bytes"]), f"{100 * r['stored_fraction']:.2f}%", r["created"]])
    print(table(lines, ["VERSION", "KIND", "BASE", "CHAIN", "STEP", "STORED", "OF FULL", "CREATED"]))
    return EXIT_OK


def run_show(args: argparse.Namespace) -> int:
    stream = open_stream(args)
    version = stream.resolve(args.ref)
    manifest = stream.manifest(version)
    summary = version_summary(manifest)
    summary["chain"] = [m.version for m in stream.chain(version)]
    info = stream.info()
    summary["stream_kind"] = info.kind
    summary["adapter"] = None if info.adapter is None else info.adapter.to_json()
    summary["metadata"] = manifest.metadata
    summary["writer"] = manifest.writer
    tensors = [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "encoding": t.encoding,
                "stored_bytes": t.length, "bytes": t.nbytes,
                "changed_fraction": None if t.changed is None or not t.numel else t.changed / t.numel}
               for t in manifest.tensors]
    if args.json:
        if args.tensors:
            summary["tensor_list"] = tensors
        print_json(summary)
        return EXIT_OK
    changed = summary["changed_fraction"]
    print(f"version      {version}\nkind         {manifest.kind}\n"
          f"base         {'-' if manifest.base_version is None else manifest.base_version}\n"
          f"chain        {' -> '.join(map(str, summary['chain']))} (length {manifest.chain_length})\n"
          f"step         {'-' if manifest.step is None else manifest.step}\ncreated      {manifest.created}\n"
          f"tensors      {len(manifest.tensors)}\n"
          f"stored       {human(manifest.stored_bytes)} of {human(manifest.full_bytes)} "
          f"({100 * summary['stored_fraction']:.2f}%)\n"
          f"changed      {'-' if changed is None else f'{100 * changed:.3f}% of elements'}")
    if info.adapter is not None:
        print(f"stream       {stream_kind_line(info)}\n"
              f"base model   {info.adapter.base_name} ({info.adapter.base_hash or 'hash unknown'})")
    if manifest.metadata:
        print(f"metadata     {json.dumps(manifest.metadata)}")
    if args.tensors:
        print()
        print(table([[t["name"], t["dtype"], "x".join(map(str, t["shape"])) or "scalar", t["encoding"],
                      human(t["stored_bytes"]),
                      "-" if t["changed_fraction"] is None else f"{100 * t['changed_fraction']:.3f}%"]
                     for t in tensors], ["TENSOR", "DTYPE", "SHAPE", "ENCODING", "STORED", "CHANGED"]))
    return EXIT_OK


def run_diff(args: argparse.Namespace) -> int:
    stream = open_stream(args)
    diffs = stream.diff(args.a, args.b)
    shown = [d for d in diffs if args.all or d.status != "same"]
    if args.json:
        print_json([asdict(d) for d in shown])
        return EXIT_OK
    changed = sum(d.changed for d in diffs)
    total = sum(d.numel for d in diffs)
    print(table([[d.name, d.status, f"{d.changed}/{d.numel}",
                  "-" if d.max_abs_diff is None else f"{d.max_abs_diff:.3g}"] for d in shown],
                ["TENSOR", "STATUS", "CHANGED", "MAX |DIFF|"]))
    print(f"\n{sum(d.status != 'same' for d in diffs)} of {len(diffs)} tensors differ; "
          f"{changed} of {total} elements ({100 * changed / max(total, 1):.3f}%)")
    return EXIT_OK


def _lag(record: ReplicaRecord) -> str:
    """A mirror's versions to copy, or the nodes an engine's head waits for."""
    if record.lagging:
        return "waits for " + ", ".join(record.lagging)
    return "-" if record.lag is None else str(record.lag)


def run_replicas(args: argparse.Namespace) -> int:
    import time

    records = open_stream(args).replicas()
    if args.json:
        print_json([{**asdict(r), "age_s": r.age()} for r in records])
        return EXIT_OK
    now = time.time()
    print(table([[r.replica_id, r.kind, version_text(r.version, r.resident), r.state, f"{r.age(now):.0f}s",
                  ",".join(r.urls) or r.source or "", _lag(r), (r.last_error or "")[:60]]
                 for r in records],
                ["REPLICA", "KIND", "VERSION", "STATE", "HEARTBEAT", "URLS/SOURCE", "LAG", "LAST ERROR"]))
    return EXIT_OK
