"""Choosing committed versions by range: ``A:B[:STEP]`` (mirror, export, replay)."""

from __future__ import annotations

from ..errors import InvalidVersionError, VersionNotFoundError
from .stream import Stream


def select_versions(stream: Stream, spec: str) -> list[int]:
    """The committed versions selected by ``A:B[:STEP]`` (inclusive; ``latest`` allowed; STEP counts
    version numbers from A) or by a single version."""
    parts = spec.split(":")
    if not 1 <= len(parts) <= 3 or not all(parts[:2]) or (len(parts) == 3 and not parts[2].isdigit()):
        raise InvalidVersionError(f"--versions wants A:B[:STEP] (versions, 'latest', a step of 1 or more), "
                                  f"got {spec!r}")
    first = stream.resolve(parts[0])
    last = stream.resolve(parts[1]) if len(parts) > 1 else first
    step = int(parts[2]) if len(parts) == 3 else 1
    if step < 1:
        raise InvalidVersionError(f"--versions {spec!r}: STEP must be at least 1")
    chosen = [v for v in stream.versions() if first <= v <= last and (v - first) % step == 0]
    if not chosen:
        raise VersionNotFoundError(f"no committed version in {spec}",
                                   hint=f"`ckptstream ls {stream.url}` lists the committed versions")
    return chosen
