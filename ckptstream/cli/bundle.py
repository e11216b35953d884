"""Air-gapped sites: ``export`` (versions of a stream into one tar file) and ``import`` (a bundle into a
store, verified before anything is committed)."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from dataclasses import asdict

from ..errors import EXIT_OK
from .options import add_command, add_url, open_stream, storage_options, version_number
from .output import human, print_json, progress


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "export", run_export,
                    "write versions of a stream into one tar file (a bundle) for a site without a network path", """
        ckptstream export /mnt/nfs/run1 run1-full.tar                  # every version
        ckptstream export s3://bucket/run1 week12.tar --since 340      # only what came after 340 (deltas)
        ckptstream export /mnt/nfs/run1 v.tar --versions 300:latest:10
        ckptstream export /mnt/nfs/run1 - | ssh gateway 'cat > run1.tar'   # to stdout
        """)
    add_url(p)
    p.add_argument("bundle", metavar="BUNDLE.tar", help="the bundle to write ('-': stdout); written under a "
                                                        "temporary name and renamed once complete")
    p.add_argument("--versions", metavar="A:B[:STEP]",
                   help="versions to carry (inclusive; 'latest' allowed); default all. The bases they need "
                        "come too")
    p.add_argument("--since", type=version_number, metavar="V",
                   help="an incremental bundle: versions after V, for a destination that holds V's chain")

    p = add_command(sub, "import", run_import,
                    "verify a bundle and commit its versions at a destination (nothing partial is committed)", """
        ckptstream import run1-full.tar /srv/streams/run1
        ckptstream import week12.tar s3://site-bucket/run1 --json
        ssh gateway 'cat run1.tar' | ckptstream import - /srv/streams/run1
        """)
    p.add_argument("bundle", metavar="BUNDLE.tar", help="the bundle to read ('-': stdin)")
    p.add_argument("dst", metavar="DST", help="destination stream URL (empty, or a copy of the same stream)")


def run_export(args: argparse.Namespace) -> int:
    from ..bundle import export_bundle
    from ..reader import select_versions

    stream = open_stream(args)
    versions = select_versions(stream, args.versions) if args.versions else None
    with progress(0, "export") as advance:
        report = export_bundle(stream, args.bundle, versions=versions, since=args.since, progress=advance)
    # With the bundle on stdout, the result goes to stderr.
    with contextlib.redirect_stdout(sys.stderr) if args.bundle == "-" else contextlib.nullcontext():
        if args.json:
            print_json({**asdict(report), "versions": list(report.versions), "bytes": report.bundle_bytes})
        else:
            print(f"exported {len(report.versions)} version(s) ({_span(report.versions)}"
                  f"{f', since {report.since}' if report.since is not None else ''}) into {args.bundle}: "
                  f"{human(report.bundle_bytes)} in {report.seconds:.2f} s")
    return EXIT_OK


def run_import(args: argparse.Namespace) -> int:
    from ..bundle import import_bundle
    from ..storage import open_storage

    dst = open_storage(args.dst, storage_options(args))
    total = os.path.getsize(args.bundle) if args.bundle != "-" and os.path.isfile(args.bundle) else 0
    with progress(total, "import") as advance:
        report = import_bundle(args.bundle, dst, progress=advance)
    if args.json:
        print_json({**asdict(report), "versions": list(report.versions), "skipped": list(report.skipped),
                    "bytes": report.bytes_read})
    else:
        print(f"imported {len(report.versions)} version(s) into {args.dst} ({_span(report.versions)}"
              f"{f'; {len(report.skipped)} already there' if report.skipped else ''}): "
              f"{human(report.bytes_read)} read, {human(report.bytes_written)} written in {report.seconds:.2f} s")
    return EXIT_OK


def _span(versions: tuple[int, ...]) -> str:
    if not versions:
        return "none new"
    return str(versions[0]) if len(versions) == 1 else f"{versions[0]}..{versions[-1]}"

