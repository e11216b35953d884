"""``ckptstream mirror``: copy a stream's versions byte for byte into another store, once or following."""

from __future__ import annotations

import argparse
import json
import sys

from ..errors import EXIT_INTEGRITY, EXIT_OK
from .options import add_command, add_pull_options, pulled_stream, storage_option
from .output import human, progress


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "mirror", run_mirror, "copy committed versions byte for byte into another store "
                    "(the same manifests, stream_id and data files), once or following", """
        ckptstream mirror s3://train-bucket/run1 /mnt/site-nfs/run1               # everything missing
        ckptstream mirror /mnt/nfs/run1 s3://site-bucket/run1 --versions 40:latest
        ckptstream mirror s3://train-bucket/run1 /mnt/site-nfs/run1 --follow --bwlimit 100M   # the site relay
        ckptstream mirror http://relay.train:8080 /mnt/site-nfs/run1 --follow --json
        # -o configures SRC, --dst-option DST: --dst-option endpoint_url=http://127.0.0.1:9000
        """)
    p.add_argument("src", metavar="SRC", help="the stream to copy (any stream URL, also http(s)://)")
    p.add_argument("dst", metavar="DST", help="where to copy it (empty, or a copy of the same stream)")
    p.add_argument("--dst-option", action="append", default=[], type=storage_option, metavar="KEY=VALUE",
                   help="fsspec storage option of DST (repeatable); -o/--storage-option are SRC's")
    p.add_argument("--versions", metavar="A:B[:STEP]", help="versions to copy (inclusive; 'latest' allowed); "
                                                            "the bases they need come along (default: all)")
    p.add_argument("--follow", action="store_true", help="keep DST current as SRC grows, reporting in DST's "
                                                         "replicas/ (Ctrl-C stops)")
    p.add_argument("--poll-interval", type=float, default=5.0, metavar="S",
                   help="with --follow: seconds between looks at SRC (default 5)")
    p.add_argument("--replica-id", help="with --follow: name of the mirror's record in DST (default mirror-HOST)")
    add_pull_options(p)


def run_mirror(args: argparse.Namespace) -> int:
    import logging
    import signal
    import threading

    from ..mirror import Mirror, MirrorConfig, MirrorResult
    from ..storage import open_storage

    logging.basicConfig(level=logging.INFO if args.follow else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")

    def report(result: MirrorResult) -> None:
        if args.json:
            print(json.dumps(result.to_json()), flush=True)
        elif result.status == "refused":
            print(f"Error: {result.error}", file=sys.stderr)
        else:
            print(f"version {result.version}: {result.status}, {human(result.copied_bytes)} moved "
                  f"({human(result.throughput)}/s), {human(result.present_bytes)} already there", flush=True)

    src = pulled_stream(args.src, dict(args.storage_option), bwlimit=args.bwlimit, lease_ttl=args.lease_ttl)
    config = MirrorConfig(versions=args.versions, replica_id=args.replica_id, poll_interval=args.poll_interval,
                          on_version=report, progress=progress)
    mirror = Mirror(src, open_storage(args.dst, dict(args.dst_option)), config)
    if not args.follow:
        results = mirror.run_once()
        if not results and not args.json:
            print(f"{args.dst} holds every selected version already")
        return EXIT_INTEGRITY if any(r.status == "refused" for r in results) else EXIT_OK
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    mirror.follow(stop)
    return EXIT_OK
