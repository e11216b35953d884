"""Leases (``leases/<version>-<token>.json``): a reader pulling a version holds it, so that gc keeps the
version and its chain until the pull ends (FORMAT.md, "Leases").

``hold_lease`` is the holder's side (write, renew on a daemon thread, delete; ``LeaseSet`` holds several
versions at once); ``read_leases`` is what a collector reads. The order of operations that makes a lease
honoured (write the lease, then check the chain's manifests) is ``Stream.lease``'s; gc's side is in
``writer/gc.py``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator

from ..credentials import redact
from ..format import (LEASE_CLOCK_SKEW_SECONDS, LEASES_DIR, MAX_LEASE_RECORD_BYTES, MAX_LEASE_TTL, MAX_VERSION,
                      dumps_json, lease_path, loads_json)
from ..storage import Storage

log = logging.getLogger("ckptstream.leases")

DEFAULT_LEASE_TTL = 120.0
"""Seconds a lease lives unless renewed; holders renew every third of it, so a holder that dies stops
protecting its version this long (plus the clock-skew margin) after its last renewal. At most
``MAX_LEASE_TTL``."""


def check_lease_ttl(ttl: float) -> float:
    """``ttl`` if it is a lease's time to live that collectors honour (``0 < ttl <= MAX_LEASE_TTL``), else
    ValueError."""
    if not 0 < ttl <= MAX_LEASE_TTL:
        raise ValueError(f"a lease's ttl must be positive and at most {MAX_LEASE_TTL:g} seconds, got {ttl!r}")
    return ttl


@dataclass(frozen=True)
class LeaseRecord:
    """One lease as stored: who holds which version until when.

    Attributes:
        holder: free-form name of who pulls (``follower <replica id>``, ``mirror``, ``materialize``, ...).
        version: the leased version (its delta chain is leased with it).
        heartbeat: seconds since the epoch of the record's last write.
        expires: seconds since the epoch after which the lease lapses unless renewed (by the holder's clock).
        host, pid: where the holder runs (informative).
        path: where the record is stored (not part of the record's bytes).
        stored: when the storage last wrote the record (its modification time, seconds since the epoch, by
            the storage's clock), where it says (not part of the record's bytes).
    """

    holder: str
    version: int
    heartbeat: float
    expires: float
    host: str = ""
    pid: int = 0
    path: str = ""
    stored: float | None = None

    @property
    def ttl(self) -> float:
        """The time to live the holder gave the lease at its last write."""
        return self.expires - self.heartbeat

    def is_live(self, now: float | None = None) -> bool:
        """True until ``LEASE_CLOCK_SKEW_SECONDS`` after ``expires``, or after ``stored`` plus the TTL,
        whichever is later (``now``: the collector's clock): a holder whose clock is behind keeps its lease
        by the storage's."""
        now = time.time() if now is None else now
        by_storage = self.stored + self.ttl if self.stored is not None else self.expires
        return now <= max(self.expires, by_storage) + LEASE_CLOCK_SKEW_SECONDS

    def to_bytes(self) -> bytes:
        body = {k: v for k, v in asdict(self).items() if k not in ("path", "stored")}
        return dumps_json(body, what=f"lease record of version {self.version}", indent=None)

    @classmethod
    def from_bytes(cls, raw: bytes, *, path: str, stored: float | None = None) -> LeaseRecord:
        """Parse an untrusted record stored at ``stored`` (its storage time, where known); ValueError
        (IntegrityError included) for a malformed one: oversized, not strict JSON, not an object, a known
        field missing or of the wrong type (unknown fields are ignored), a time that is not finite, or a
        lease longer than ``MAX_LEASE_TTL`` (its TTL, or ``expires`` past ``stored``)."""
        if len(raw) > MAX_LEASE_RECORD_BYTES:
            raise ValueError(f"lease record of {len(raw)} bytes exceeds {MAX_LEASE_RECORD_BYTES}")
        body: Any = loads_json(raw, version=None, file=path)
        if not isinstance(body, dict):
            raise ValueError("a lease record is a JSON object")
        known = {k: body[k] for k in _FIELD_CHECKS if k in body}
        for key in ("holder", "version", "heartbeat", "expires"):
            if key not in known:
                raise ValueError(f"lease record lacks {key!r}")
        for key, value in known.items():
            if not _FIELD_CHECKS[key](value):
                raise ValueError(f"lease record field {key!r} has the wrong type or range")
        record = cls(**known, path=path, stored=stored)
        if record.ttl > MAX_LEASE_TTL or (stored is not None and record.expires - stored > MAX_LEASE_TTL):
            raise ValueError(f"lease record would live longer than {MAX_LEASE_TTL:g} s past its last write (ttl "
                             f"{record.ttl:g} s, expires {record.expires:g}, stored at {stored})")
        return record


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_time(value: Any) -> bool:
    """A finite number (JSON's ``1e999`` parses to infinity; an integer may be too large for a float)."""
    try:
        return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)
    except OverflowError:
        return False


_FIELD_CHECKS: dict[str, Callable[[Any], bool]] = {
    "holder": lambda v: isinstance(v, str),
    "version": lambda v: _is_int(v) and 0 <= v <= MAX_VERSION,
    "heartbeat": _is_time,
    "expires": _is_time,
    "host": lambda v: isinstance(v, str),
    "pid": _is_int,
}


@dataclass(frozen=True)
class LeaseListing:
    """What a collector read in ``leases/``: the well-formed records, and the paths of malformed ones
    (with their modification times, so that old ones can be removed as debris)."""

    records: list[LeaseRecord]
    malformed: list[tuple[str, float | None]]

    def live_versions(self, now: float | None = None) -> set[int]:
        """The versions that a live lease names."""
        now = time.time() if now is None else now
        return {r.version for r in self.records if r.is_live(now)}


def read_leases(storage: Storage) -> LeaseListing:
    """Every lease record in the stream, expired ones included (``LeaseRecord.is_live`` tells them apart).

    Malformed records are listed apart and protect nothing. A record removed between the listing and its
    read was released. Any other failure (``leases/`` cannot be listed, a record cannot be read) raises:
    a collector must never mistake "cannot tell" for "no leases".
    """
    records: list[LeaseRecord] = []
    malformed: list[tuple[str, float | None]] = []
    for entry in storage.list(LEASES_DIR):
        if entry.is_dir or entry.name.startswith("."):
            continue  # a holder's temporary file (or a directory nobody should have made): not a lease
        path = f"{LEASES_DIR}/{entry.name}"
        if entry.size > MAX_LEASE_RECORD_BYTES or not entry.name.endswith(".json"):
            malformed.append((path, entry.mtime))
            continue
        try:  # bounded and never blocking: a record too long, or not a regular file, is malformed
            raw = storage.read_small(path, MAX_LEASE_RECORD_BYTES)
            records.append(LeaseRecord.from_bytes(raw, path=path, stored=entry.mtime))
        except FileNotFoundError:
            continue  # released meanwhile
        except (ValueError, TypeError) as exc:
            log.warning("ignoring malformed lease record %s: %s", path, exc)
            malformed.append((path, entry.mtime))
    return LeaseListing(sorted(records, key=lambda r: (r.version, r.path)), malformed)


class Lease:
    """A lease this process holds on one version: written when made, renewed by ``renew``.

    Attributes:
        record: the record as last written.
    """

    def __init__(self, storage: Storage, version: int, *, holder: str, ttl: float):
        self.storage = storage
        self.ttl = check_lease_ttl(ttl)
        path = lease_path(version, uuid.uuid4().hex)
        now = time.time()
        self.record = LeaseRecord(holder, version, now, now + ttl, socket.gethostname(), os.getpid(), path)
        self.storage.put(path, self.record.to_bytes())

    def renew(self) -> None:
        """Write the record again with ``expires`` one ttl from now."""
        now = time.time()
        record = LeaseRecord(self.record.holder, self.record.version, now, now + self.ttl, self.record.host,
                             self.record.pid, self.record.path)
        self.storage.put(record.path, record.to_bytes())
        self.record = record

    def release(self) -> None:
        """Delete the record (a missing one is fine: gc may have removed it as expired)."""
        self.storage.delete(self.record.path)


class LeaseSet:
    """Leases this process holds on versions of one stream, renewed together every ``ttl / 3`` by one daemon
    thread (a renewal that fails is retried at the next tick, and logged), all deleted by ``close``. An import
    holds one per version it carries; ``hold_lease`` holds one.

    On storage this process cannot write (``not storage.capabilities.writable``: a stream over HTTP; or
    credentials that may only read, a PermissionError, logged once) no lease is taken: ``add`` returns None.
    """

    def __init__(self, storage: Storage, *, holder: str, ttl: float = DEFAULT_LEASE_TTL):
        self.storage = storage
        self.holder = holder
        self.ttl = ttl
        self._writable = storage.capabilities.writable
        self._leases: dict[int, Lease] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def add(self, version: int) -> Lease | None:
        """Hold a lease on ``version`` from now until ``close`` (the one held already, if any)."""
        with self._lock:
            if version in self._leases or not self._writable:
                return self._leases.get(version)
            try:
                lease = self._leases[version] = Lease(self.storage, version, holder=self.holder, ttl=self.ttl)
            except PermissionError as exc:
                self._writable = False
                log.warning("cannot write a lease on version %d in %s (%s): pulling it without one, so gc may "
                            "retire it meanwhile", version, redact(self.storage.url), exc)
                return None
            if self._renewer is None:
                self._renewer = threading.Thread(target=self._renew, name=f"ckptstream-lease-{version}", daemon=True)
                self._renewer.start()
            return lease

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            with self._lock:
                leases = list(self._leases.values())
            for lease in leases:
                try:
                    lease.renew()
                except Exception as exc:  # noqa: BLE001 - a storage hiccup: the next tick tries again
                    log.warning("could not renew the lease on version %d (%s): %s", lease.record.version,
                                lease.record.path, exc)

    def close(self) -> None:
        """Stop renewing and delete every lease (one that cannot be deleted expires by itself, logged)."""
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
        with self._lock:
            leases, self._leases = list(self._leases.values()), {}
        for lease in leases:
            try:
                lease.release()
            except Exception as exc:  # noqa: BLE001 - the lease expires by itself; do not hide the caller's error
                log.warning("could not release the lease %s (%s); it expires by itself", lease.record.path, exc)

    def __enter__(self) -> LeaseSet:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@contextlib.contextmanager
def hold_lease(storage: Storage, version: int, *, holder: str,
               ttl: float = DEFAULT_LEASE_TTL) -> Iterator[Lease | None]:
    """Hold a lease on ``version`` for the block: written now, renewed every ``ttl / 3`` on a daemon thread,
    deleted when the block exits, also on error (a ``LeaseSet`` of one). On storage this process cannot
    write the block gets None.

    This is only the record's life; ``Stream.lease`` adds the check that makes it honoured.
    """
    with LeaseSet(storage, holder=holder, ttl=ttl) as leases:
        yield leases.add(version)
