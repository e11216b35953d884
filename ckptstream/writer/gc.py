"""Garbage collection: retire old versions (never a base a kept version needs, never one a reader holds a
lease on) and remove writer debris."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from ..errors import CkptStreamError
from ..format import (ASSETS_DIR, LEASES_DIR, MANIFESTS_DIR, MAX_MANIFEST_BYTES, TEMP_PREFIX, VERSIONS_DIR, Manifest,
                      manifest_path, parse_version_name, version_dir)
from ..reader import Stream
from ..reader.leases import LeaseListing, read_leases
from ..storage import Storage
from .commit import commit_manifest

log = logging.getLogger("ckptstream.gc")

DEFAULT_GRACE_SECONDS = 3600.0
"""Debris younger than this may belong to a writer still at work, and is left alone."""


@dataclass
class GcReport:
    """What a garbage collection removed (or, in a dry run, would remove).

    Attributes:
        kept: every version left committed, those kept for leases included.
        kept_for_leases: versions that would have been retired but that a live lease holds (or that the
            chain of a leased version needs).
    """

    kept: list[int] = field(default_factory=list)
    kept_for_leases: list[int] = field(default_factory=list)
    deleted_versions: list[int] = field(default_factory=list)
    debris: list[str] = field(default_factory=list)
    bytes_freed: int = 0
    dry_run: bool = False


def collect_garbage(stream: Stream, *, keep_last: int, keep_every: int | None = None,
                    grace_seconds: float = DEFAULT_GRACE_SECONDS, dry_run: bool = False) -> GcReport:
    """Delete old versions and the debris of crashed or losing writers.

    Keeps the newest ``keep_last`` versions (at least 1), every version whose number is a multiple of
    ``keep_every``, every version a live lease holds, and every version in the delta chain of any of
    these. Versions are retired in the order of FORMAT.md's "Leases" (G1-G4): leases read, the manifests
    of the versions to retire deleted (they stop existing atomically), leases read again and every
    version a lease taken meanwhile needs put back (its exact manifest bytes), and only then the data of
    the rest deleted. Debris — uncommitted version directories, data files no manifest names, ``.tmp-*``
    files, lease records expired or malformed for longer than ``grace_seconds`` — is removed once older
    than ``grace_seconds``.

    Raises:
        CkptStreamError: the chain of a kept version cannot be resolved, or ``leases/`` or a lease record
            cannot be read (unknown leases are not "no leases"): no version is retired (manifests deleted
            already are put back).
    """
    if keep_last < 1:
        raise ValueError("keep_last must be at least 1: the newest version is never deleted")
    storage = stream.storage
    report = GcReport(dry_run=dry_run)
    versions = stream.versions()
    keep = set(versions[-keep_last:])
    if keep_every:
        keep.update(v for v in versions if v % keep_every == 0)
    known: dict[int, Manifest] = {}
    for v in sorted(keep):
        try:
            chain = stream.chain(v)
        except CkptStreamError as exc:
            raise CkptStreamError(f"cannot resolve the delta chain of kept version {v} ({exc}); nothing deleted",
                                  version=v, hint="Run `ckptstream verify` and repair or remove the version") from exc
        known.update((m.version, m) for m in chain)
        keep.update(m.version for m in chain)
    leases = _read_leases(storage)  # G1
    leased = _chains(stream, leases.live_versions(), known) - keep
    candidates = [v for v in versions if v not in keep and v not in leased]
    originals = {v: raw for v in candidates if (raw := _manifest_bytes(stream, v, known)) is not None}
    if not dry_run:
        try:
            for v in originals:
                storage.delete(manifest_path(v))  # G2: the version stops existing here
            leases = _read_leases(storage)  # G3: a lease written before a delete above is listed now
        except BaseException:
            _put_back(storage, known, originals)  # whoever leased them meanwhile finds them again
            raise
        late = _chains(stream, leases.live_versions(), known) & set(originals)
        for v in sorted(late):
            commit_manifest(storage, known[v], originals[v])  # the exact bytes: it never changed
            log.info("version %d: a lease was taken while gc ran; its manifest is back and its data kept", v)
        leased |= late
    retired = [v for v in originals if v not in leased]
    for v in retired:
        report.bytes_freed += known[v].stored_bytes
        if not dry_run:
            storage.delete_tree(version_dir(v))  # G4
    report.deleted_versions = retired
    report.kept_for_leases = sorted(leased)
    report.kept = sorted(keep | leased)
    _collect_debris(stream, versions, grace_seconds, leases, report)
    return report


def _read_leases(storage: Storage) -> LeaseListing:
    try:
        return read_leases(storage)
    except OSError as exc:
        raise CkptStreamError(f"cannot read the stream's leases ({exc!r}); no version retired", file=LEASES_DIR,
                              hint="gc must see every lease to keep what readers are pulling: fix access to "
                                   f"{LEASES_DIR}/ and run it again") from exc


def _put_back(storage: Storage, known: dict[int, Manifest], originals: dict[int, bytes]) -> None:
    """Commit again each manifest of ``originals`` that gc deleted before it failed (their data is untouched;
    a delete whose answer was lost may have happened, so every one is looked at)."""
    for v, raw in originals.items():
        try:
            if not storage.exists(manifest_path(v)):
                commit_manifest(storage, known[v], raw)
        except Exception:  # noqa: BLE001 - the first error is the one to raise; this one is logged
            log.exception("version %d: could not put its manifest back after gc failed; its data is left for "
                          "the next gc to remove as debris", v)


def _manifest_bytes(stream: Stream, version: int, known: dict[int, Manifest]) -> bytes | None:
    """The stored bytes of a version's manifest (validated, into ``known``); None if it is gone already
    (another collector retired it)."""
    try:
        raw = stream.storage.read_small(manifest_path(version), MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        return None
    known[version] = Manifest.from_bytes(raw, version=version, stream_id=stream.info().stream_id)
    return raw


def _chains(stream: Stream, versions: set[int], known: dict[int, Manifest]) -> set[int]:
    """``versions`` and every base of their delta chains, walked through ``known`` (manifests gc has read,
    also those it has just deleted) and the stream. A leased version that is not committed (any more)
    protects nothing; a chain that breaks off protects what it reached."""
    found: set[int] = set()
    for version in versions:
        v: int | None = version
        while v is not None and v not in found:
            manifest = known.get(v)
            if manifest is None:
                try:
                    manifest = known[v] = stream.manifest(v)
                except CkptStreamError:
                    break
            found.add(v)
            v = manifest.base_version
    return found


def _collect_debris(stream: Stream, versions: list[int], grace_seconds: float, leases: LeaseListing,
                    report: GcReport) -> None:
    storage, dry_run = stream.storage, report.dry_run
    now = time.time()
    cutoff = now - grace_seconds
    committed = set(versions) - set(report.deleted_versions)
    live = leases.live_versions(now)
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
        elif v not in report.deleted_versions and v not in live:
            # Uncommitted: a crashed or losing writer's, unless a writer is still at work (grace period)
            # or commits right now (the manifest probe just before deleting narrows that window), or the
            # data of a version whose retirement failed half-way that a reader still holds a lease on.
            items = storage.list(directory)
            if all(_older(i.mtime, cutoff) for i in items) and (v is None or not stream.has_version(v)):
                _remove_tree(storage, directory, sum(i.size for i in items), report, dry_run)
    for directory in ("", MANIFESTS_DIR, ASSETS_DIR, LEASES_DIR):
        for item in storage.list(directory):
            if item.name.startswith(TEMP_PREFIX) and not item.is_dir and _older(item.mtime, cutoff):
                _remove(storage, f"{directory}/{item.name}".lstrip("/"), item.size, report, dry_run)
    # Lease records of holders that died long ago, and records nobody can read: the holder of a live lease
    # renews it in place, so a record expired for longer than the grace period has no holder left.
    for record in leases.records:
        if not record.is_live(cutoff):
            _remove(storage, record.path, 0, report, dry_run)
    for path, mtime in leases.malformed:
        if _older(mtime, cutoff):
            _remove(storage, path, 0, report, dry_run)


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
