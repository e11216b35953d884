"""What every command shares on the way out: JSON, tables, byte sizes, progress bars (stderr), and the
summary of a version that ``publish``, ``ls`` and ``show`` print."""

from __future__ import annotations

import contextlib
import json
import sys
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

if TYPE_CHECKING:
    from ..format import Manifest


def print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, default=str))


def human(n: float | None) -> str:
    """A byte count for people: ``512 B``, ``1.5 MB`` (powers of 1000)."""
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def table(rows: list[list[str]], header: list[str]) -> str:
    """Left-aligned columns under ``header``."""
    widths = [max(len(str(x)) for x in column) for column in zip(header, *rows)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    return "\n".join(lines)


@contextlib.contextmanager
def progress(total: int, description: str) -> Iterator[Callable[[int], None] | None]:
    """A byte progress bar on stderr when it is a terminal (and tqdm is installed); yields its update
    function, or None without a bar."""
    bar = None
    if sys.stderr.isatty():
        with contextlib.suppress(ImportError):
            from tqdm import tqdm
            bar = tqdm(total=total, desc=description, unit="B", unit_scale=True, file=sys.stderr, leave=False)
    try:
        yield bar.update if bar is not None else None
    finally:
        if bar is not None:
            bar.close()


def version_summary(manifest: Manifest) -> dict[str, Any]:
    """The JSON summary of a version."""
    changed = manifest.changed_elements
    numel = sum(t.numel for t in manifest.tensors)
    return {"version": manifest.version, "kind": manifest.kind, "base_version": manifest.base_version,
            "keyframe_version": manifest.keyframe_version, "chain_length": manifest.chain_length,
            "step": manifest.step, "created": manifest.created, "tensors": len(manifest.tensors),
            "stored_bytes": manifest.stored_bytes, "full_bytes": manifest.full_bytes,
            "stored_fraction": manifest.stored_bytes / manifest.full_bytes if manifest.full_bytes else 0.0,
            "changed_elements": changed, "changed_fraction": None if changed is None or not numel else changed / numel}


def version_text(version: int | None, resident: Sequence[int] = ()) -> str:
    """A served version for a table: ``-`` for none; an adapter stream's with the versions held beside it,
    ``7 (6,7)``."""
    if version is None:
        return "-"
    return f"{version} ({','.join(map(str, resident))})" if resident else str(version)
