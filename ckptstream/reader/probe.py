"""Finding the versions of a stream on storage that cannot list (HTTP): by probing manifest names.

FORMAT.md, "Latest-version hint": the advisory ``latest.json`` names a version to start from; it may be
stale (a newer version was committed after it) or gone (retired by gc), so readers probe forward from it
and, for the full set, backward, each time until ``VERSION_PROBE_GAP`` consecutive numbers are missing.
Without a hint, probing starts at version 0. Probes of one window run concurrently (one HEAD each).
"""

from __future__ import annotations

from ..errors import IntegrityError
from ..format import (LATEST_HINT_FILE, MAX_LATEST_HINT_BYTES, MAX_VERSION, VERSION_PROBE_GAP, manifest_path,
                      parse_latest_hint)
from ..storage import Storage
from ..storage.base import concurrently


MAX_BACKWARD_PROBES = 1024
"""Version numbers probed backward at most, so that listing a long stream over HTTP (``ls``, and the
follower's periodic listing) stays a bounded number of requests: older versions are not shown."""


def read_latest_hint(storage: Storage) -> int | None:
    """The version the stream's latest-version hint names, or None (no hint, or not a valid one: also one
    too long to be a hint, or not a regular file, which is read no further)."""
    try:
        return parse_latest_hint(storage.read_small(LATEST_HINT_FILE, MAX_LATEST_HINT_BYTES))
    except (FileNotFoundError, IntegrityError):
        return None


def probe_versions(storage: Storage, *, newest_only: bool = False) -> list[int]:
    """Committed versions found by probing, oldest first (only the newest with ``newest_only``).

    Forward from the hint (or 0) until a gap of ``VERSION_PROBE_GAP`` missing numbers; then, unless
    ``newest_only``, backward from the oldest found likewise, over at most ``MAX_BACKWARD_PROBES``
    numbers. A version separated from the others by a longer gap (old versions kept by gc's
    ``keep_every`` far apart), or further back, is not found: ``ls`` over HTTP shows the versions near
    the newest.
    """
    hint = read_latest_hint(storage)
    start = 0 if hint is None else hint
    found = [v for v, there in zip([start], _probe(storage, [start])) if there]
    newest = found[-1] if found else start - 1
    while True:  # forward
        window = [v for v in range(newest + 1, newest + 1 + VERSION_PROBE_GAP) if v <= MAX_VERSION]
        hits = [v for v, there in zip(window, _probe(storage, window)) if there]
        if not hits:
            break
        found.extend(hits)
        newest = hits[-1]
    if newest_only and found:
        return found[-1:]
    oldest = found[0] if found else start
    floor = max(0, oldest - MAX_BACKWARD_PROBES)
    while oldest > floor:  # backward (also for the newest, when the hint is ahead of every version)
        window = list(range(max(floor, oldest - VERSION_PROBE_GAP), oldest))
        hits = [v for v, there in zip(window, _probe(storage, window)) if there]
        if not hits:
            break
        found[:0] = hits
        if newest_only:
            return found[-1:]
        oldest = hits[0]
    return found


def _probe(storage: Storage, versions: list[int]) -> list[bool]:
    return concurrently(lambda v: storage.exists(manifest_path(v)), versions)
