"""Reading streams: discovery, verification, decoding and materialization of versions.

Names are imported on first use: importing this package does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_face

_LAZY_NAMES = {
    **dict.fromkeys(("ReplicaRecord", "read_replicas", "replica_path", "write_replica"), ".replicas"),
    **dict.fromkeys(("Stream", "TensorDiff", "VerifyReport", "check_base"), ".stream"),
    **dict.fromkeys(("DEFAULT_LEASE_TTL", "Lease", "LeaseListing", "LeaseRecord", "LeaseSet", "hold_lease",
                     "read_leases"), ".leases"),
    "MaterializedBase": ".materialize",
    "select_versions": ".selection",
    "MARKER_FILE": "..format",
}

if TYPE_CHECKING:
    from ..format import MARKER_FILE
    from .leases import DEFAULT_LEASE_TTL, Lease, LeaseListing, LeaseRecord, LeaseSet, hold_lease, read_leases
    from .materialize import MaterializedBase
    from .replicas import ReplicaRecord, read_replicas, replica_path, write_replica
    from .selection import select_versions
    from .stream import Stream, TensorDiff, VerifyReport, check_base

__getattr__, __dir__ = lazy_face(__name__, _LAZY_NAMES)

__all__ = ["DEFAULT_LEASE_TTL", "MARKER_FILE", "Lease", "LeaseListing", "LeaseRecord", "LeaseSet", "MaterializedBase",
           "ReplicaRecord", "Stream", "TensorDiff", "VerifyReport", "check_base", "hold_lease", "read_leases",
           "read_replicas", "replica_path", "select_versions", "write_replica"]
