"""vLLM's command line read as its parser reads it (``serve`` adds only what the user left unset): whether an option
is given, an option's integer value. vLLM's parser takes ``--x_y`` for ``--x-y`` and ``--x=v`` for ``--x v``."""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import VllmArgumentError


def has_option(args: Sequence[str], option: str) -> bool:
    """Whether ``args`` give ``option`` (``--x``, ``--x=...``; vLLM's parser also takes ``--x_y`` for ``--x-y``)."""
    return any(a == option or a.startswith(option + "=") for a in (_dashed(a) for a in args))


def _dashed(arg: str) -> str:
    """An option's name with vLLM's ``_`` read as ``-`` (its value, after ``=``, left alone)."""
    if not arg.startswith("--"):
        return arg
    name, equals, value = arg.partition("=")
    return name.replace("_", "-") + equals + value


def int_option(args: Sequence[str], option: str) -> int | None:
    """The integer value of ``option`` in ``args`` (``--x N`` or ``--x=N``; the last one wins, as in argparse)."""
    value = None
    args = [_dashed(a) for a in args]
    for i, arg in enumerate(args):
        if arg == option and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(option + "="):
            value = arg[len(option) + 1:]
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise VllmArgumentError(f"{option} {value!r} is not an integer") from None
