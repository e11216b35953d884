"""What every command shares on the way in: the parser class, option types, storage options, the
exit-code table, and the helper that adds a command with its examples. Imports nothing heavy: building
the parser (and ``--help``) must stay fast."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import textwrap
from typing import TYPE_CHECKING, Any, Callable, NoReturn, Sequence

from ..format import LATEST
from ..reader.leases import DEFAULT_LEASE_TTL, check_lease_ttl
from ..errors import (
    EXIT_CONFLICT,
    EXIT_ERROR,
    EXIT_INCOMPATIBLE,
    EXIT_INTEGRITY,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_USAGE,
    CkptStreamError,
)

if TYPE_CHECKING:
    from ..reader import Stream

EXIT_CODES_HELP = "exit codes:\n" + "".join(f"  {code}  {meaning}\n" for code, meaning in (
    (EXIT_OK, "success"),
    (EXIT_ERROR, "unexpected error"),
    (EXIT_USAGE, "usage error"),
    (EXIT_INTEGRITY, "integrity error: corrupt, truncated or unsafe data (verify failed)"),
    (EXIT_NOT_FOUND, "not found: no such stream or version, or a delta's base is gone"),
    (EXIT_CONFLICT, "conflict: the version exists or is not newer than the latest"),
    (EXIT_INCOMPATIBLE, "incompatible: unsupported format version, other model, storage lacks a primitive"),
))

VERSION_HELP = f"version number or '{LATEST}'"

Run = Callable[[argparse.Namespace], "int | None"]


class UsageError(CkptStreamError, ValueError):
    """Arguments that parse but do not go together (exit code 2, like argparse's own errors)."""

    exit_code = EXIT_USAGE


class Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors end in the command line's ``Error:`` line (exit code 2)."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"Error: {message}\n")


# ------------------------------------------------------------------------------------------- option types

class SecretOption(argparse.Action):
    """An option holding a secret (a token, an API key), by default from the environment variable ``env``.
    Given on the command line it still works, with a warning: every user of the host reads command lines
    (``ps``, ``/proc/PID/cmdline``), not another user's environment."""

    def __init__(self, option_strings: Sequence[str], dest: str, *, env: str, help: str, **kwargs: Any):
        super().__init__(option_strings, dest, default=os.environ.get(env), help=f"{help} (default ${env})",
                         **kwargs)
        self.env = env

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        logging.getLogger("ckptstream.cli").warning(
            "%s on the command line is visible to every user of this host (ps, /proc/PID/cmdline): set $%s "
            "instead", option_string, self.env)
        setattr(namespace, self.dest, values)


def version_ref(text: str) -> int | str:
    """A version argument: a version number (0, 1, ...) or ``latest``."""
    if text == LATEST:
        return text
    return version_number(text)


def version_number(text: str) -> int:
    """A version number: a non-negative integer."""
    if not (text.isascii() and text.isdigit()):  # also refuses "-1", "+1" and " 1", which int() takes
        raise argparse.ArgumentTypeError(f"{text!r} is not a version: give a number (0, 1, ...) or '{LATEST}'")
    return int(text)


def positive_int(text: str) -> int:
    """A count of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive count (give 1 or more)")
    return value


_BYTE_UNITS = {"": 1, "B": 1, "KB": 1000, "MB": 1000**2, "GB": 1000**3, "KIB": 1024, "MIB": 1024**2,
               "GIB": 1024**3}


def parse_bytes(text: str) -> int:
    """A byte count with an optional unit: ``64MB``, ``1GB``, ``512KiB``, ``1000``."""
    number = text.strip().upper()
    unit = next((u for u in sorted(_BYTE_UNITS, key=len, reverse=True) if u and number.endswith(u)), "")
    value = float(number[:len(number) - len(unit)])
    if not 0 <= value < float("inf"):
        raise ValueError(f"{text!r} is not a byte count of zero or more")
    return int(value * _BYTE_UNITS[unit])


def byte_size(text: str) -> int:
    """:func:`parse_bytes` as an option type."""
    try:
        return parse_bytes(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 64MB, 1GB, 512KiB)") from None


_RATE_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}

BWLIMIT_HELP = ("limit the bytes read from the stream to RATE per second, all threads together: a number of "
                "bytes, or with a binary suffix K, M, G, T (rclone's units: 512K = 512 KiB/s, 10M = 10 MiB/s)")


def parse_rate(text: str) -> float:
    """A rate in bytes per second in rclone's manner: ``10M`` is 10 MiB/s, ``512K`` 512 KiB/s, ``1.5G``,
    a plain number is bytes per second (suffixes B, K, M, G, T, case-insensitive, powers of 1024)."""
    number = text.strip().upper()
    if number.endswith("/S"):
        number = number[:-2]
    unit = number[-1:] if number[-1:] in _RATE_UNITS else ""
    try:
        value = float(number[:len(number) - len(unit)])
    except ValueError:
        raise ValueError(f"{text!r} is not a rate (e.g. 10M, 512K, 1000000)") from None
    if not 0 < value < float("inf"):
        raise ValueError(f"{text!r} is not a positive rate")
    return value * _RATE_UNITS[unit]


def rate(text: str) -> float:
    """:func:`parse_rate` as an option type (``--bwlimit``)."""
    try:
        return parse_rate(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive_seconds(text: str) -> float:
    """A duration in seconds greater than zero (``--lease-ttl``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a positive number of seconds")
    return value


def lease_seconds(text: str) -> float:
    """A lease's time to live in seconds (``--lease-ttl``): positive, at most ``MAX_LEASE_TTL``."""
    try:
        return check_lease_ttl(positive_seconds(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def storage_option(text: str) -> tuple[str, Any]:
    """One ``--storage-option KEY=VALUE``; the value is parsed as JSON when it is JSON."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"wants KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def storage_options(args: argparse.Namespace) -> dict[str, Any]:
    """The fsspec storage options of a command (``-o`` given twice: the last one wins)."""
    return dict(args.storage_option)


# ------------------------------------------------------------------------------------------------ commands

def common_options() -> argparse.ArgumentParser:
    """The options of every command that opens a stream: ``--storage-option`` and ``--json``."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--storage-option", "-o", action="append", default=[], type=storage_option,
                        metavar="KEY=VALUE",
                        help="fsspec storage option (repeatable), e.g. -o profile=train -o "
                             "endpoint_url=http://127.0.0.1:9000; values are parsed as JSON when possible")
    common.add_argument("--json", action="store_true",
                        help="print results as JSON (follow, serve: one JSON line per update)")
    return common


def add_command(sub: argparse._SubParsersAction, name: str, run: Run, help: str, examples: str, *,
                with_common: bool = True, parents: Sequence[argparse.ArgumentParser] = ()) -> argparse.ArgumentParser:
    """Add command ``name``: its help, its examples and the exit-code table in ``--help``; ``run(args)``
    executes it and returns the exit code."""
    parser = sub.add_parser(name, help=help, description=help,
                            parents=([common_options()] if with_common else []) + list(parents),
                            formatter_class=argparse.RawDescriptionHelpFormatter,
                            epilog="examples:\n" + textwrap.indent(textwrap.dedent(examples).strip(), "  ")
                            + "\n\n" + EXIT_CODES_HELP)
    parser.set_defaults(run=run)
    return parser


def add_url(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", help="stream URL")


def add_pull_options(parser: argparse.ArgumentParser) -> None:
    """``--bwlimit`` and ``--lease-ttl``: the options of a command that pulls versions' data."""
    parser.add_argument("--bwlimit", type=rate, metavar="RATE", help=BWLIMIT_HELP)
    parser.add_argument("--lease-ttl", type=lease_seconds, default=DEFAULT_LEASE_TTL, metavar="SECONDS",
                        help="time to live of the lease held on each version pulled, renewed every third of it "
                             f"(default {DEFAULT_LEASE_TTL:g}; gc keeps a leased version)")


def open_stream(args: argparse.Namespace, *, bwlimit: float | None = None,
                lease_ttl: float = DEFAULT_LEASE_TTL) -> Stream:
    """The command's stream, its reads limited to ``bwlimit`` bytes/s if given (``--bwlimit``), its pulls'
    leases living ``lease_ttl`` seconds (``--lease-ttl``); a clear error now if there is none."""
    stream = pulled_stream(args.url, storage_options(args), bwlimit=bwlimit, lease_ttl=lease_ttl)
    stream.info()
    return stream


def pulled_stream(url: str, options: dict[str, Any], *, bwlimit: float | None = None,
                  lease_ttl: float = DEFAULT_LEASE_TTL) -> Stream:
    """A stream whose reads are limited to ``bwlimit`` bytes/s if given (``--bwlimit``) and whose pulls
    hold leases of ``lease_ttl`` seconds (``--lease-ttl``)."""
    from ..reader import Stream
    from ..storage import ThrottledStorage, open_storage

    storage = open_storage(url, options)
    if bwlimit is not None:
        storage = ThrottledStorage(storage, bwlimit)
    return Stream(url, storage=storage, lease_ttl=lease_ttl)


def add_cache_versions_option(options: argparse.ArgumentParser) -> None:
    """``--cache-versions`` (follow, serve, node-agent, fleet up): ``FollowerConfig.cache_versions``."""
    options.add_argument("--cache-versions", type=int, choices=[0, 1], default=1, metavar="{0,1}",
                         help="whole versions kept in the cache once the servers loaded them: 1 (default) the "
                              "served one; 0 none: an update applied in place needs only its change, and a full "
                              "reload (a fallback, a restart) decodes the version from storage on demand")


def add_adapter_options(parser: argparse.ArgumentParser, title: str, base_help: str) -> Any:
    """The adapter-stream options of follow, serve and ``fleet up``, as a group of ``parser`` (returned)."""
    from ..reader.adapter import DEFAULT_KEEP

    adapters = parser.add_argument_group(title)
    adapters.add_argument("--keep", type=positive_int, metavar="K",
                          help=f"versions kept resident as NAME@VERSION (default {DEFAULT_KEEP}; vLLM's --max-loras "
                               "at least K+1)")
    adapters.add_argument("--adapter-name", metavar="NAME",
                          help="the stable adapter name, meaning the newest version (default the URL's last part; "
                               "'adapter' at a relay's root)")
    adapters.add_argument("--base-dir", metavar="DIR", help=base_help)
    return adapters


def refuse_adapter_options(args: argparse.Namespace) -> None:
    """Refuse (exit 2) the adapter-stream options on a weights stream."""
    given = [option for option, value in (("--keep", args.keep), ("--adapter-name", args.adapter_name),
                                          ("--base-dir", args.base_dir),
                                          ("--lora-aliases", getattr(args, "lora_aliases", None)))
             if value is not None]
    if given:
        raise UsageError(f"{', '.join(given)}: for adapter streams (LoRA); {args.url} is a weights stream")


def is_adapter_stream(args: argparse.Namespace) -> bool:
    """Whether ``args.url`` is an adapter stream (its ``stream.json`` read with the command's storage options)."""
    from ..format import STREAM_KIND_ADAPTER
    from ..reader import Stream

    return Stream(args.url, storage_options=storage_options(args)).info().kind == STREAM_KIND_ADAPTER
