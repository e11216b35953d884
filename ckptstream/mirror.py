"""``mirror``: keep a byte-for-byte copy of a stream in another store (the site relay for remote rollout).

One copy crosses the WAN; the site's followers read the site copy. Versions are carried by
:mod:`ckptstream.transfer` (data first, each file verified against the source manifest, the manifest last
through put-if-absent), so the copy never shows a partial version and an interrupted mirror, run again,
moves only what is missing. With ``follow`` the mirror keeps the copy current and reports itself in the
destination's ``replicas/`` (kind ``mirror``: source, last version copied, lag, heartbeat).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from .credentials import redact
from .errors import EXIT_CONFLICT, CkptStreamError, IntegrityError, VersionNotFoundError
from .format import LATEST, MANIFESTS_DIR, MAX_MANIFEST_BYTES, manifest_path
from .polling import poll
from .reader import ReplicaRecord, Stream, select_versions, write_replica
from .reader.replicas import KIND_MIRROR, remember_refusal, replica_path
from .storage import Storage
from .transfer import CopiedVersion, Destination, copy_version, versions_to_carry

log = logging.getLogger("ckptstream.mirror")

DEFAULT_POLL_INTERVAL = 5.0
DEFAULT_HEARTBEAT_INTERVAL = 5.0

Progress = Callable[[int], None]
ProgressFactory = Callable[[int, str], Any]
"""``factory(total_bytes, description)`` → a context manager yielding a progress function or None (the
CLI's progress bars)."""


@dataclass(frozen=True)
class MirrorResult:
    """What the mirror did with one source version: ``status`` is ``copied``, ``present`` (the destination
    held it, byte for byte) or ``refused`` (it failed verification at the source; ``error`` says why)."""

    version: int
    status: str
    kind: str | None = None
    copied_bytes: int = 0
    present_bytes: int = 0
    stored_bytes: int = 0
    seconds: float = 0.0
    error: str | None = None

    @property
    def throughput(self) -> float:
        """Bytes moved per second (0 when nothing moved)."""
        return self.copied_bytes / self.seconds if self.copied_bytes and self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "throughput_bytes_per_s": round(self.throughput, 1)}


@dataclass
class MirrorConfig:
    """How a mirror runs.

    Attributes:
        versions: the source versions to copy, ``A:B[:STEP]`` (``latest`` allowed; re-read at every poll
            when following); default all.
        replica_id: the name of the mirror's record in the destination's ``replicas/`` (following only;
            default ``mirror-<host>``).
        poll_interval: seconds between looks at the source when following.
        heartbeat_interval: seconds between record heartbeats, also during long copies.
        on_version: called with each version's :class:`MirrorResult` (the CLI's ``--json`` lines).
        progress: makes a progress bar per copied version (see ``ProgressFactory``).
    """

    versions: str | None = None
    replica_id: str | None = None
    poll_interval: float = DEFAULT_POLL_INTERVAL
    heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL
    on_version: Callable[[MirrorResult], None] | None = None
    progress: ProgressFactory | None = None


class Mirror:
    """Copies the committed versions of ``src`` into ``dst`` (any stores: local/NFS, S3, fsspec; the source
    may be read-only, e.g. an HTTP stream).

    Example::

        mirror = Mirror(Stream("s3://train-bucket/run1"), open_storage("/mnt/site-nfs/run1"))
        mirror.run_once()                 # everything the destination lacks
        mirror.follow(stop_event)         # keep it current until stop_event is set
    """

    def __init__(self, src: Stream, dst: Storage, config: MirrorConfig | None = None):
        self.src = src
        self.dst = Destination(dst, lease_ttl=src.lease_ttl)
        self.config = config or MirrorConfig()
        self.refused: dict[int, str] = {}
        self._checked: set[int] = set()  # versions found at the destination identical to the source's
        replica_id = self.config.replica_id or f"mirror-{socket.gethostname()}"
        replica_path(replica_id)  # a ValueError now rather than at the first heartbeat
        self.record = ReplicaRecord(replica_id=replica_id, kind=KIND_MIRROR, source=redact(src.url),
                                    host=socket.gethostname(), pid=os.getpid())
        self._lock = threading.Lock()
        self._following = False  # records are written only while following

    # ------------------------------------------------------------------------------------------ copying

    def selected(self) -> list[int]:
        """The source versions the configuration selects now."""
        if self.config.versions is None:
            return self.src.versions()
        try:
            return select_versions(self.src, self.config.versions)
        except VersionNotFoundError:
            if LATEST in self.config.versions.split(":"):  # a follow of a stream not yet published to
                return []
            raise

    def run_once(self) -> list[MirrorResult]:
        """Copy every selected source version the destination lacks (and the bases they need), oldest first.

        A source version that fails verification is refused (the destination unchanged) and the next ones
        go on; its result says why.

        Raises:
            ForeignStreamError: the destination holds another stream (exit 5).
            VersionConflictError: the destination holds a different version of a number (exit 5).
        """
        self.src.info()
        self.dst.adopt(self.src)
        wanted = self.selected()
        held = set(self.dst.stream.versions())
        for version in sorted(v for v in wanted if v in held and v not in self._checked):
            # Present at the destination: byte for byte the source's, or the two stores have diverged.
            self.dst.check_same(version, self.src.storage.read_small(manifest_path(version), MAX_MANIFEST_BYTES))
            self._checked.add(version)
        results = []
        try:
            todo = versions_to_carry(self.src, [v for v in wanted if v not in self.refused],
                                     lambda v: v in held)
        except CkptStreamError as exc:  # a chain broken at the source: each wanted version on its own
            log.warning("%s; copying version by version", redact(exc))
            todo = sorted(v for v in wanted if v not in held and v not in self.refused)
        for version in todo:
            result = self._carry(version)
            if result.status == "copied":
                held.add(version)
                self._checked.add(version)
            results.append(result)
            if self.config.on_version is not None:
                self.config.on_version(result)
        self._report(version=max(held & set(wanted), default=self.record.version),
                     lag=len([v for v in wanted if v not in held]))
        return results

    def _carry(self, version: int) -> MirrorResult:
        started = time.monotonic()
        try:
            self._report(state="copying")
            # A lease at the source keeps its gc from retiring the version while it is copied.
            with self.src.lease(version, holder=f"mirror {self.record.replica_id}"):
                copied = self._copy(version, self.src.manifest(version).stored_bytes)
        except (IntegrityError, VersionNotFoundError) as exc:  # damaged, or retired meanwhile, at the source
            self.record.refused = remember_refusal(self.refused, version, str(exc))
            log.error("refused version %d: %s", version, exc)
            self._report(last_error=str(exc))
            return MirrorResult(version, "refused", seconds=time.monotonic() - started, error=str(exc))
        seconds = time.monotonic() - started
        status = "copied" if copied.copied_bytes or not copied.present_bytes else "present"
        return MirrorResult(version, status, copied.kind, copied.copied_bytes, copied.present_bytes,
                            copied.stored_bytes, seconds)

    def _copy(self, version: int, total: int) -> CopiedVersion:
        holder = f"mirror {self.record.replica_id}"  # its leases at the destination (gc there keeps the copy)
        if self.config.progress is None:
            return copy_version(self.src, self.dst, version, holder=holder)
        with self.config.progress(total, f"version {version}") as progress:
            return copy_version(self.src, self.dst, version, holder=holder, progress=progress)

    # ---------------------------------------------------------------------------------------- following

    def follow(self, stop: threading.Event) -> None:
        """Keep the destination current until ``stop`` is set: a look at the source every
        ``poll_interval`` seconds (sooner where the source notifies), a heartbeat in the destination's
        ``replicas/`` meanwhile. Errors of the stores (unreachable, throttled) are reported and retried with
        backoff; a diverged destination (another stream, a different version) ends the mirror."""
        self._following = True
        self._report(state="starting")
        wake = threading.Event()
        watch = self.src.storage.watch(MANIFESTS_DIR, wake.set)
        heartbeat = threading.Thread(target=self._heartbeat, args=(stop,), name="ckptstream-mirror-heartbeat",
                                     daemon=True)
        heartbeat.start()

        def look() -> None:
            self.run_once()
            self._report(state="current" if not self.record.lag else "copying", last_error=None)

        def failed(exc: Exception, wait: float) -> None:  # a store away or throttling: keep the copy, retry
            if getattr(exc, "exit_code", None) == EXIT_CONFLICT:  # diverged stores: copying on would be wrong
                raise exc
            self._report(state="error", last_error=f"{type(exc).__name__}: {redact(exc)}")
            log.warning("%s; retrying in %.0f s", redact(exc), wait)

        try:
            poll(stop, wake, look, interval=self.config.poll_interval, on_error=failed,
                 retry=(CkptStreamError, ValueError, OSError), max_backoff=60.0)
        finally:
            if watch is not None:
                watch.stop()
            self._report(state="stopped")

    def _report(self, **changes: Any) -> None:
        """Update the mirror's record; written to the destination only when following (a one-off copy
        leaves no record)."""
        with self._lock:
            for key, value in changes.items():
                setattr(self.record, key, value)
            self.record.heartbeat = time.time()
            record = ReplicaRecord(**{**self.record.__dict__, "refused": dict(self.record.refused)})
        if not self._following:
            return
        try:
            write_replica(self.dst.storage, record)
        except Exception as exc:  # noqa: BLE001 - a report that cannot be written must not stop the copy
            log.warning("cannot write the mirror's record: %s", redact(exc))

    def _heartbeat(self, stop: threading.Event) -> None:
        while not stop.wait(self.config.heartbeat_interval):
            self._report()
