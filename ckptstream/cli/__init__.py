"""The ``ckptstream`` command line: publish, info, ls, show, diff, replicas, materialize, verify, mirror, export,
import, gc, follow, serve, replay, fleet, relay, make-tiny-model, base-hash, demo.

One module per command group; :mod:`.options` and :mod:`.output` hold what they share. Results go to
stdout (``--json`` for scripts), progress and ``Error:`` lines to stderr. Set ``CKPTSTREAM_TRACEBACK=1``
to see tracebacks. Building the parser imports nothing heavy (no torch): each command imports what it
needs when it runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from typing import Sequence

from .. import __version__
from ..credentials import redact
from ..errors import (EXIT_CONFLICT, EXIT_ERROR, EXIT_INTERRUPTED, EXIT_NOT_FOUND, EXIT_OK, EXIT_USAGE,
                      CkptStreamError)
from . import bundle, fleet, follow, gc, inspect, materialize, mirror, publish, relay, tools
from .options import EXIT_CODES_HELP, Parser

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line on ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after the first `--` belongs to the child command (vLLM's arguments, a replay command).
    passthrough = argv[argv.index("--") + 1:] if "--" in argv else []
    try:
        args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    except SystemExit as exc:  # --help, --version, or a usage error already reported by the parser
        return exc.code if isinstance(exc.code, int) else EXIT_OK
    args.passthrough = passthrough
    if not getattr(args, "command", None):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return args.run(args) or EXIT_OK
    except KeyboardInterrupt:
        print("Error: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `ckptstream ls URL | head`: the reader left; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except Exception as exc:  # noqa: BLE001 - every failure becomes one `Error:` line and an exit code
        if os.environ.get("CKPTSTREAM_TRACEBACK"):
            raise
        return _report(exc)


def _report(exc: Exception) -> int:
    """Print ``exc`` as one ``Error:`` line; return its exit code."""
    if isinstance(exc, CkptStreamError):
        print(f"Error: {exc}", file=sys.stderr)
        return exc.exit_code
    message = redact(exc.args[0] if isinstance(exc, KeyError) and exc.args else exc)  # ours are already
    print(f"Error: {message or type(exc).__name__} (set CKPTSTREAM_TRACEBACK=1 for details)", file=sys.stderr)
    if isinstance(exc, FileNotFoundError):
        return EXIT_NOT_FOUND
    if isinstance(exc, FileExistsError):
        return EXIT_CONFLICT
    return EXIT_ERROR


def build_parser() -> argparse.ArgumentParser:
    """The whole command line's parser (every command's run function in ``args.run``)."""
    parser = Parser(
        prog="ckptstream", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Stream model weights through shared storage: versions are keyframes or lossless "
                    "deltas, committed by an atomic manifest.",
        epilog=textwrap.dedent("""\
            examples:
              ckptstream demo                                    # the whole loop on a tiny model
              ckptstream publish /mnt/nfs/run1 --from-hf ./checkpoint-100
              ckptstream ls s3://bucket/run1
              ckptstream materialize s3://bucket/run1 latest /dev/shm/model
              ckptstream verify /mnt/nfs/run1

            storage: local paths, file://, s3:// (AWS_ENDPOINT_URL, AWS_PROFILE and the usual AWS
            configuration apply) or any fsspec URL; --storage-option key=value passes options to fsspec.
            """) + "\n" + EXIT_CODES_HELP)
    parser.add_argument("--version", action="version", version=f"ckptstream {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for group in (publish, inspect, materialize, mirror, bundle, gc, follow, fleet, relay, tools):
        group.register(sub)
    return parser
