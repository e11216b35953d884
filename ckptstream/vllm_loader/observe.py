"""What a follower reports, and to whom: one observer interface that every report goes through.

The follower (``follower.py``) keeps its state and calls its observers; each sink is one small class:
``LogLines`` (the log lines), ``JsonLines`` (``--json`` of ``follow``/``serve``), ``ReplicaRecordWriter``
(the replica record in the stream), ``metrics.FollowerMetrics`` (Prometheus), ``OnUpdate`` (a callback).
Observers are called on the follower's threads (its loop, its heartbeat thread), one after the other; one
that raises is logged and skipped, never stopping the follower.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import IO, Any, Callable, Sequence

from ..credentials import redact
from ..errors import (CkptStreamError, IncompatibleStreamError, IntegrityError, MissingBaseError, ModelMismatchError,
                      VllmError)
from ..reader import ReplicaRecord, write_replica
from ..storage import Storage

log = logging.getLogger("ckptstream.follow")


@dataclass(frozen=True)
class UpdateRecord:
    """What one update cost: the figures of the follower's log line, ``--json`` line and metrics."""

    version: int
    base_version: int | None  # the cached version the delta was applied to (None: from the keyframe)
    bytes_fetched: int
    prepare_s: float  # fetch + decode + hash checks (or the change built from the fetched deltas), while the
    # servers kept generating (fetch_s + decode_s)
    pause_s: float  # servers paused (all of them, one after the other)
    reload_s: float  # inside reload_weights
    lag_s: float  # from the version's commit to serving it
    decoded: bool = True  # decoded by this follower (False: reused from the cache, e.g. another follower's)
    fetch_s: float = 0.0  # of prepare_s: seconds with a storage read in flight (reads overlap decoding)
    decode_s: float = 0.0  # of prepare_s: the rest (decoding, hashing, writing with no read outstanding)
    applied_in_place: int = 0  # servers that took it in place (only the changed elements written)
    fallbacks: dict[str, int] = field(default_factory=dict)  # servers reloaded fully instead, by FALLBACK_REASONS
    cache_s: float = 0.0  # decoding into the cache after serving it (a change applied from the fetched deltas)
    stage_s: float = 0.0  # the change mapped onto the servers' parameters by their workers, while they generated
    found_s: float = 0.0  # from the version's commit to the follower starting on it (its poll, or a watch's wake)
    servers_s: float = 0.0  # the servers updated one by one: each pause (pause_s) and the checks after it that the
    # server generates, labelled, again

    def log_line(self) -> str:
        parts = [f"in place on {self.applied_in_place}"] if self.applied_in_place else []
        if self.fallbacks or not parts:
            parts.append(f"reload ({', '.join(f'{k}: {v}' for k, v in sorted(self.fallbacks.items()))})")
        how = ", ".join(parts)
        return (f"version {self.version} serving: fetched {self.bytes_fetched / 1e6:.1f} MB"
                f"{_base_text(self.version, self.base_version)}, "
                f"fetch {self.fetch_s:.2f} s + decode {self.decode_s:.2f} s"
                + (f" + stage {self.stage_s:.2f} s" if self.stage_s else "") + f", pause {self.pause_s:.2f} s, "
                f"{how} {self.reload_s:.2f} s, lag {self.lag_s:.2f} s after commit"
                + (f", decoded into the cache {self.cache_s:.2f} s after" if self.cache_s else ""))


FALLBACK_REASONS = ("disabled", "first_version", "multi_node", "no_change", "large_change", "no_extension",
                    "unpatchable", "check_failed", "unverifiable", "apply_failed", "verify")
"""Why a server was reloaded fully instead of patched in place (``UpdateRecord.fallbacks``, the metric
``ckptstream_full_reload_fallbacks_total``): in-place apply off, nothing served yet (or a server to bring
back), a node of an engine spanning nodes lacking the change, no change could be built (different
tensors), too many elements changed, a server without ckptstream's worker extension, a tensor whose loader is
not a plain copy, values served that the delta's change check refuses (the server is not on the delta's base,
or the delta is forged), a change check the ranks cannot add up to (they do not hold every changed position
equally often), an apply that failed on some rank (every rank then reloads), and the reload of a
``--verify-apply`` check."""


REFUSAL_REASONS: tuple[tuple[type[CkptStreamError], str], ...] = (
    (ModelMismatchError, "model_mismatch"),
    (IntegrityError, "integrity"),
    (MissingBaseError, "missing_base"),
    (IncompatibleStreamError, "incompatible"),
    (VllmError, "reload_failed"),
    (CkptStreamError, "other"),
)
"""Why a version is refused, by the class of the error that refused it (the first match counts): the
``reason`` of ``on_refused`` and of the ``ckptstream_refused_versions_total`` metric."""


def commit_age(created: str) -> float:
    """Seconds since a manifest's ``created`` time (NaN where it does not parse): an update's ``lag_s``."""
    try:
        when = _dt.datetime.fromisoformat(created.replace("Z", "+00:00"))
    except ValueError:
        return float("nan")
    return time.time() - when.timestamp()


def refusal_reason(error: BaseException) -> str:
    """The reason kind (``REFUSAL_REASONS``) of the error that refused a version."""
    return next((reason for kind, reason in REFUSAL_REASONS if isinstance(error, kind)), "other")


class FollowerObserver:
    """Receives what a follower reports. Every method does nothing here: a sink overrides those it uses."""

    def on_report(self, record: ReplicaRecord) -> None:
        """The follower's state changed (state, version served, error, lagging nodes) or it heartbeats:
        ``record`` is a snapshot of its replica record, ``heartbeat`` set to now."""

    def on_discovered(self, newest: int) -> None:
        """The newest committed version that this follower has not refused, as discovery saw it (not
        called for a pinned follower, which does not look)."""

    def on_update(self, update: UpdateRecord) -> None:
        """``update.version`` is served by every server of the follower (called before the ``on_report``
        saying so)."""

    def on_refused(self, version: int, reason: str, error: BaseException) -> None:
        """``version`` is refused for good (``reason``: see ``REFUSAL_REASONS``); the servers keep the last
        good version."""

    def on_error(self, error: BaseException, retry_in: float) -> None:
        """A round failed for a cause that is not the version's (storage or a server away); retried after
        ``retry_in`` seconds, the servers keep serving."""


def notify(observers: Sequence[FollowerObserver], event: str, *args: Any) -> None:
    """Call method ``event`` of every observer with ``args``; one that raises is logged and skipped (a report
    never stops serving)."""
    for observer in observers:
        try:
            getattr(observer, event)(*args)
        except Exception as exc:  # noqa: BLE001 - see above
            log.warning("observer %s failed on %s: %s", type(observer).__name__, event, exc)


class LogLines(FollowerObserver):
    """The follower's log lines: one per update, refusal and failed round."""

    def __init__(self, logger: logging.Logger = log):
        self.logger = logger

    def on_update(self, update: UpdateRecord) -> None:
        self.logger.info("%s", update.log_line())

    def on_refused(self, version: int, reason: str, error: BaseException) -> None:
        self.logger.error("refused version %d: %s", version, redact(error))

    def on_error(self, error: BaseException, retry_in: float) -> None:
        self.logger.warning("%s; retrying in %.0f s", redact(error), retry_in)


class JsonLines(FollowerObserver):
    """One JSON object per update (the ``UpdateRecord``'s fields) on its own line, flushed: ``--json``."""

    def __init__(self, out: IO[str] | None = None):
        self.out = out

    def on_update(self, update: UpdateRecord) -> None:
        out = self.out or sys.stdout  # looked up late: tests and callers may swap sys.stdout
        out.write(json.dumps(asdict(update)) + "\n")
        out.flush()


class OnUpdate(FollowerObserver):
    """Calls ``callback`` with each ``UpdateRecord`` (dashboards, benchmarks)."""

    def __init__(self, callback: Callable[[UpdateRecord], object]):
        self.callback = callback

    def on_update(self, update: UpdateRecord) -> None:
        self.callback(update)


class ReplicaRecordWriter(FollowerObserver):
    """Writes each reported record to ``replicas/<id>.json`` of the stream. A read-only view of a stream
    (HTTP, a relay) cannot hold it: said once, then nothing is written."""

    def __init__(self, storage: Storage, logger: logging.Logger = log):
        self.storage = storage
        self.logger = logger
        self.writable = storage.capabilities.writable
        if not self.writable:
            logger.info("%s is read-only: this follower writes no replica record (`ckptstream replicas` and "
                        "wait_for_version do not see it)", redact(storage.url))

    def on_report(self, record: ReplicaRecord) -> None:
        if not self.writable:
            return
        try:
            write_replica(self.storage, record)
        except Exception as exc:  # noqa: BLE001 - a report that cannot be written must not stop serving
            self.logger.warning("cannot write replica record: %s", exc)


def _base_text(version: int, base: int | None) -> str:
    if base is None:
        return ""
    # A version found in the cache already (e.g. an engine's head that waited for its nodes) decoded nothing.
    return " (already decoded)" if base == version else f" (delta on cached {base})"
