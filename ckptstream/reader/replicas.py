"""Replica records (``replicas/<id>.json``): what each follower serves, read by the trainer side."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from ..format import MAX_REPLICA_RECORD_BYTES, REPLICAS_DIR, dumps_json, is_safe_file_name, loads_json
from ..storage import Storage


STATE_ASIDE = "aside"
"""The follower stands aside: another process (a replay) has taken its servers over."""
NOT_SERVING_STATES = frozenset({"stopped", STATE_ASIDE})
"""States in which a record's ``version`` is not what its servers serve for the stream now."""
KIND_FOLLOWER = "follower"
"""A record of a follower: ``version`` is what its vLLM servers serve."""
KIND_MIRROR = "mirror"
"""A record of a mirror keeping this stream a copy of ``source``: ``version`` is the last version it copied.
Mirrors serve nothing, so they never count as replicas a trainer waits for."""
KIND_NODE = "node"
"""A record of a node agent: one node (not the head) of a multi-node engine, preparing each version into
that node's cache; ``version`` is the newest version complete there. The engine is one replica, counted by
its head's record (kind ``follower``, ``nnodes`` > 1): node records never count on their own."""
REFUSED_KEPT = 100
"""Refused versions a follower or mirror remembers and names in its record: a bounded report, so that one
following a stream of thousands of bad versions holds O(1) of them."""


@dataclass
class ReplicaRecord:
    """The state a follower reports for itself (one per follower, overwritten in place).

    ``kind`` is ``follower``, ``node`` (one node of a multi-node engine, see ``KIND_NODE``) or ``mirror``.
    A follower's ``state`` is one of ``starting``, ``serving``,
    ``updating``, ``error``, ``aside``, ``stopped``; a mirror's one of ``starting``, ``copying``, ``current``,
    ``error``, ``stopped``, with ``source`` the stream it copies and ``lag`` the versions selected there that it
    has not copied yet. A follower of an adapter stream (LoRA) names its stable adapter name in ``adapter``;
    its ``version`` is the version that name means, ``resident`` every version its servers hold as
    ``<adapter>@<version>``, oldest first (a client may ask for any of them), and ``keep`` how many of the
    newest versions not refused, up to ``version``, it keeps resident. ``heartbeat`` is seconds since
    the epoch, written at least every heartbeat interval, also during long pulls.
    """

    replica_id: str
    version: int | None = None
    state: str = "starting"
    last_error: str | None = None
    refused: dict[str, str] = field(default_factory=dict)  # version -> reason, for versions not served
    heartbeat: float = 0.0
    urls: list[str] = field(default_factory=list)
    host: str = ""
    pid: int = 0
    kind: str = KIND_FOLLOWER
    source: str | None = None
    lag: int | None = None
    pin: int | None = None  # the only version this follower serves (it declines every other)
    engine: str | None = None  # the multi-node engine this record belongs to (its head's replica id)
    node_rank: int | None = None
    nnodes: int | None = None  # nodes of the engine (head and node records); None: a one-node server
    lagging: list[str] = field(default_factory=list)  # head: nodes that lack the version it wants to load
    metrics_url: str | None = None  # where the follower serves Prometheus metrics (--metrics-port)
    adapter: str | None = None  # an adapter stream's follower: the stable adapter name its servers answer
    resident: list[int] = field(default_factory=list)  # an adapter stream's follower: versions held, oldest first
    keep: int | None = None  # an adapter stream's follower: how many of the newest versions it keeps resident

    def age(self, now: float | None = None) -> float:
        """Seconds since the last heartbeat."""
        return (now if now is not None else time.time()) - self.heartbeat

    def to_bytes(self) -> bytes:
        return dumps_json(asdict(self), what=f"replica record {self.replica_id}")

    @classmethod
    def from_bytes(cls, raw: bytes, *, file: str = REPLICAS_DIR) -> ReplicaRecord:
        """Parse an untrusted record; ValueError (IntegrityError included) for anything malformed: not
        strict JSON, nested too deep, or a known field of the wrong type (unknown fields are ignored)."""
        body: Any = loads_json(raw, version=None, file=file)
        if not isinstance(body, dict) or not isinstance(body.get("replica_id"), str):
            raise ValueError("not a replica record")
        known = {k: v for k, v in body.items() if k in cls.__dataclass_fields__}
        for key, value in known.items():
            if not _FIELD_CHECKS.get(key, lambda _: True)(value):
                raise ValueError(f"replica record field {key!r} has the wrong type")
        return cls(**known)


def remember_refusal(refused: dict[int, str], version: int, reason: str) -> dict[str, str]:
    """Note in ``refused`` (oldest first) that ``version`` was refused for ``reason``, forgetting all but the
    newest ``REFUSED_KEPT``; returns the record's form of it (``ReplicaRecord.refused``)."""
    refused.pop(version, None)
    refused[version] = reason
    while len(refused) > REFUSED_KEPT:
        del refused[next(iter(refused))]
    return {str(v): why for v, why in refused.items()}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_FIELD_CHECKS: dict[str, Callable[[Any], bool]] = {
    "version": lambda v: v is None or _is_int(v),
    "state": lambda v: isinstance(v, str),
    "last_error": lambda v: v is None or isinstance(v, str),
    "refused": lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in v.values()),
    "heartbeat": lambda v: _is_int(v) or isinstance(v, float),
    "urls": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    "host": lambda v: isinstance(v, str),
    "pid": _is_int,
    "kind": lambda v: isinstance(v, str),
    "source": lambda v: v is None or isinstance(v, str),
    "lag": lambda v: v is None or _is_int(v),
    "pin": lambda v: v is None or _is_int(v),
    "engine": lambda v: v is None or isinstance(v, str),
    "node_rank": lambda v: v is None or _is_int(v),
    "nnodes": lambda v: v is None or _is_int(v),
    "lagging": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    "metrics_url": lambda v: v is None or isinstance(v, str),
    "adapter": lambda v: v is None or isinstance(v, str),
    "resident": lambda v: isinstance(v, list) and all(_is_int(x) for x in v),
    "keep": lambda v: v is None or (_is_int(v) and v >= 1),
}
"""What a readable record's known fields hold: a wrong type would break its readers' comparisons."""


def replica_path(replica_id: str) -> str:
    if not is_safe_file_name(replica_id + ".json"):
        raise ValueError(f"replica id {replica_id!r} must be a plain name (letters, digits, '.', '_', '-')")
    return f"{REPLICAS_DIR}/{replica_id}.json"


def write_replica(storage: Storage, record: ReplicaRecord) -> None:
    """Write (atomically replace) a replica record."""
    storage.put(replica_path(record.replica_id), record.to_bytes())


def read_replicas(storage: Storage) -> list[ReplicaRecord]:
    """Every readable replica record, sorted by id (unreadable, malformed or oversized ones are skipped:
    they are reports, not data)."""
    records = []
    for entry in storage.list(REPLICAS_DIR):
        if (entry.is_dir or not entry.name.endswith(".json") or entry.name.startswith(".")
                or entry.size > MAX_REPLICA_RECORD_BYTES):
            continue
        path = f"{REPLICAS_DIR}/{entry.name}"
        try:
            records.append(ReplicaRecord.from_bytes(storage.read_small(path, MAX_REPLICA_RECORD_BYTES), file=path))
        except (OSError, ValueError, TypeError):
            continue
    return sorted(records, key=lambda r: r.replica_id)
