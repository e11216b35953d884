"""Garbage collection: retire old versions (never a base a kept version needs) and remove writer debris."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from ..errors import CkptStreamError
from ..format import (ASSETS_DIR, MANIFESTS_DIR, TEMP_PREFIX, VERSIONS_DIR, manifest_path, parse_version_name,
                      version_dir)
from ..reader import Stream
from ..storage import Storage

log = logging.getLogger("ckptstream.gc")

DEFAULT_GRACE_SECONDS = 3600.0
"""Debris younger than this may belong to a writer still at work, and is left alone."""


@dataclass
class GcReport:
    """What a garbage collection removed (or, in a dry run, would remove)."""

    kept: list[int] = field(default_factory=list)
    deleted_versions: list[int] = field(default_factory=list)
    debris: list[str] = field(default_factory=list)
    bytes_freed: int = 0
    dry_run: bool = False


def collect_garbage(stream: Stream, *, keep_last: int, keep_every: int | None = None,
                    grace_seconds: float = DEFAULT_GRACE_SECONDS, dry_run: bool = False) -> GcReport:
    """Delete old versions and the debris of crashed or losing writers.

    Keeps the newest ``keep_last`` versions (at least 1), every version whose number is a multiple of
    ``keep_every``, and every version in the delta chain of a kept version. A version is retired by
    deleting its manifest first (it stops existing atomically) and its data after. Debris — uncommitted
    version directories, data files no manifest names, ``.tmp-*`` files — is removed once older than
    ``grace_seconds``.
    """
    if keep_last < 1:
        raise ValueError("keep_last must be at least 1: the newest version is never deleted")
    storage = stream.storage
    report = GcReport(dry_run=dry_run)
    versions = stream.versions()
    keep = set(versions[-keep_last:])
    if keep_every:
        keep.update(v for v in versions if v % keep_every == 0)
    for v in sorted(keep):
        try:
            keep.update(m.version for m in stream.chain(v))
        except CkptStreamError as exc:
            raise CkptStreamError(f"cannot resolve the delta chain of kept version {v} ({exc}); nothing deleted",
                                  version=v, hint="Run `ckptstream verify` and repair or remove the version") from exc
    report.kept = sorted(keep)
    for v in versions:
        if v in keep:
            continue
        report.bytes_freed += stream.manifest(v).stored_bytes
        report.deleted_versions.append(v)
        if not dry_run:
            storage.delete(manifest_path(v))  # the version stops existing here
            storage.delete_tree(version_dir(v))
    cutoff = time.time() - grace_seconds
    committed = set(versions) - set(report.deleted_versions)
    for entry in storage.list(VERSIONS_DIR):
        v = parse_version_name(entry.name)
        directory = f"{VERSIONS_DIR}/{entry.name}"
        if v is not None and v in committed:
            referenced = {f.name for f in stream.manifest(v).files}
            for item in storage.list(directory):
                if item.name not in referenced and _older(item.mtime, cutoff):
                    _remove(storage, f"{directory}/{item.name}", item.size, report, dry_run)
        elif not entry.is_dir:
            if _older(entry.mtime, cutoff):
                _remove(storage, directory, entry.size, report, dry_run)
        elif v not in report.deleted_versions:
            # Uncommitted: a crashed or losing writer's, unless a writer is still at work (grace period)
            # or commits right now (the manifest probe just before deleting narrows that window).
            items = storage.list(directory)
            if all(_older(i.mtime, cutoff) for i in items) and (v is None or not stream.has_version(v)):
                _remove_tree(storage, directory, sum(i.size for i in items), report, dry_run)
    for directory in ("", MANIFESTS_DIR, ASSETS_DIR):
        for item in storage.list(directory):
            if item.name.startswith(TEMP_PREFIX) and not item.is_dir and _older(item.mtime, cutoff):
                _remove(storage, f"{directory}/{item.name}".lstrip("/"), item.size, report, dry_run)
    return report


def _older(mtime: float | None, cutoff: float) -> bool:
    return mtime is not None and mtime < cutoff


def _remove(storage: Storage, path: str, size: int, report: GcReport, dry_run: bool) -> None:
    report.debris.append(path)
    report.bytes_freed += size
    if not dry_run:
        storage.delete(path)


def _remove_tree(storage: Storage, path: str, size: int, report: GcReport, dry_run: bool) -> None:
    report.debris.append(path + "/")
    report.bytes_freed += size
    if not dry_run:
        storage.delete_tree(path)
