"""Reading versions whole: ``materialize`` (a servable HF directory) and ``verify`` (bit for bit)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path

from ..credentials import redact
from ..errors import EXIT_OK, CkptStreamError
from .options import VERSION_HELP, UsageError, add_command, add_pull_options, add_url, open_stream, version_ref
from .output import human, print_json, progress


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "materialize", run_materialize, "write a version as a plain HF directory (vLLM loads it)",
                    """
        ckptstream materialize /mnt/nfs/run1 latest /dev/shm/model
        ckptstream materialize s3://bucket/run1 12 ./v12 --base-dir ./v11   # apply deltas to v11
        ckptstream materialize s3://bucket/run1 latest ./model --bwlimit 50M  # at most 50 MiB/s
        ckptstream materialize /mnt/nfs/lora1 latest ./adapter   # an adapter stream: a PEFT adapter directory
        """)
    add_url(p)
    p.add_argument("ref", metavar="VERSION", type=version_ref, help=VERSION_HELP)
    p.add_argument("out_dir", metavar="OUT_DIR", help="directory to write (must be absent or empty)")
    p.add_argument("--base-dir", help="a directory materialized earlier from this stream to decode from")
    p.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists")
    add_pull_options(p)

    p = add_command(sub, "verify", run_verify, "check versions bit for bit: manifests, chains, hashes, files", """
        ckptstream verify /mnt/nfs/run1             # every version
        ckptstream verify s3://bucket/run1 11 12 latest
        """)
    add_url(p)
    add_pull_options(p)
    p.add_argument("refs", nargs="*", metavar="VERSION", type=version_ref, help="versions to check (default: all)")


def run_materialize(args: argparse.Namespace) -> int:
    import time

    out_dir = Path(args.out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        # --force replaces directories only: a file in the way is more likely a typo than a target.
        raise UsageError(f"OUT_DIR {args.out_dir} is a file, not a directory", hint="Pick a directory path")
    stream = open_stream(args, bwlimit=args.bwlimit, lease_ttl=args.lease_ttl)
    version = stream.resolve(args.ref)
    manifest = stream.manifest(version)
    start = time.perf_counter()
    with progress(manifest.full_bytes, f"materialize {version}") as advance:
        out = stream.materialize(version, out_dir, base_dir=args.base_dir, overwrite=args.force, progress=advance)
    seconds = time.perf_counter() - start
    if args.json:
        print_json({"version": version, "path": str(out), "bytes": manifest.full_bytes, "seconds": seconds})
    else:
        print(f"materialized version {version} into {out} ({human(manifest.full_bytes)} in {seconds:.2f} s)")
    return EXIT_OK


def run_verify(args: argparse.Namespace) -> int:
    stream = open_stream(args, bwlimit=args.bwlimit, lease_ttl=args.lease_ttl)
    versions = [stream.resolve(r) for r in args.refs] if args.refs else stream.versions()
    results = []
    worst = EXIT_OK
    for version in versions:
        try:
            manifest = stream.manifest(version)
            with progress(manifest.full_bytes, f"verify {version}") as advance:
                report = stream.verify(version, progress=advance)
            results.append({"version": version, "ok": True, **asdict(report)})
            if not args.json:
                print(f"version {version}: ok ({report.tensors} tensors, {report.files} files, "
                      f"{human(report.stored_bytes)} stored)")
        except CkptStreamError as exc:
            worst = max(worst, exc.exit_code)
            results.append({"version": version, "ok": False, "error": str(exc), "file": exc.file,
                            "tensor": exc.tensor})
            print(f"Error: {exc}", file=sys.stderr)
            if not args.json:
                print(f"version {version}: FAILED")
    if args.json:
        print_json(results)
    elif not versions:
        print(f"no versions in {redact(args.url)}", file=sys.stderr)
    return worst
