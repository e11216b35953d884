"""Replica records (``replicas/<id>.json``): what each follower serves, read by the trainer side."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ..format import REPLICAS_DIR, is_safe_file_name
from ..storage import Storage


@dataclass
class ReplicaRecord:
    """The state a follower reports for itself (one per follower, overwritten in place).

    ``state`` is one of ``starting``, ``serving``, ``updating``, ``error``, ``stopped``; ``heartbeat``
    is seconds since the epoch, written at least every heartbeat interval, also during long pulls.
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

    def age(self, now: float | None = None) -> float:
        """Seconds since the last heartbeat."""
        return (now if now is not None else time.time()) - self.heartbeat

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), indent=1).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> "ReplicaRecord":
        body: Any = json.loads(raw)
        if not isinstance(body, dict) or not isinstance(body.get("replica_id"), str):
            raise ValueError("not a replica record")
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in body.items() if k in known})


def replica_path(replica_id: str) -> str:
    if not is_safe_file_name(replica_id + ".json"):
        raise ValueError(f"replica id {replica_id!r} must be a plain name (letters, digits, '.', '_', '-')")
    return f"{REPLICAS_DIR}/{replica_id}.json"


def write_replica(storage: Storage, record: ReplicaRecord) -> None:
    """Write (atomically replace) a replica record."""
    storage.put(replica_path(record.replica_id), record.to_bytes())


def read_replicas(storage: Storage) -> list[ReplicaRecord]:
    """Every readable replica record, sorted by id (unreadable ones are skipped: they are reports, not data)."""
    records = []
    for entry in storage.list(REPLICAS_DIR):
        if entry.is_dir or not entry.name.endswith(".json") or entry.name.startswith("."):
            continue
        try:
            records.append(ReplicaRecord.from_bytes(storage.read(f"{REPLICAS_DIR}/{entry.name}")))
        except (OSError, ValueError, TypeError):
            continue
    return sorted(records, key=lambda r: r.replica_id)
