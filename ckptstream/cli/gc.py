"""``ckptstream gc``: retire old versions (never a needed base) and crashed writers' debris."""

from __future__ import annotations

import argparse
from dataclasses import asdict

from ..errors import EXIT_OK
from .options import add_command, add_url, open_stream, positive_int
from .output import human, print_json


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "gc", run_gc, "delete old versions (never a needed base nor a leased one) and crashed "
                    "writers' debris", """
        ckptstream gc /mnt/nfs/run1 --keep-last 20 --keep-every 100 --dry-run
        ckptstream gc s3://bucket/run1 --keep-last 5
        """)
    add_url(p)
    p.add_argument("--keep-last", type=positive_int, required=True, metavar="K", help="keep the newest K versions")
    p.add_argument("--keep-every", type=int, metavar="M",
                   help="also keep versions whose number is a multiple of M")
    p.add_argument("--grace", type=float, default=3600.0, metavar="SECONDS",
                   help="leave debris younger than this alone (default 3600)")
    p.add_argument("--dry-run", action="store_true", help="only report what would be deleted")


def run_gc(args: argparse.Namespace) -> int:
    from ..writer import collect_garbage

    report = collect_garbage(open_stream(args), keep_last=args.keep_last, keep_every=args.keep_every,
                             grace_seconds=args.grace, dry_run=args.dry_run)
    if args.json:
        print_json(asdict(report))
        return EXIT_OK
    verb = "would delete" if args.dry_run else "deleted"
    print(f"{verb} {len(report.deleted_versions)} version(s)"
          + (f" ({', '.join(map(str, report.deleted_versions))})" if report.deleted_versions else "")
          + f" and {len(report.debris)} debris item(s), {human(report.bytes_freed)}; "
          f"kept {len(report.kept)} version(s)")
    if report.kept_for_leases:
        print(f"  kept for leases (a reader is pulling them or their chain): "
              f"{', '.join(map(str, report.kept_for_leases))}")
    for path in report.debris:
        print(f"  debris: {path}")
    return EXIT_OK
