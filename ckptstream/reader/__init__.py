"""Reading streams: discovery, verification, decoding and materialization of versions."""

from .replicas import ReplicaRecord, read_replicas, replica_path, write_replica
from .stream import MARKER_FILE, MaterializedBase, Stream, TensorDiff, VerifyReport

__all__ = ["MARKER_FILE", "MaterializedBase", "ReplicaRecord", "Stream", "TensorDiff", "VerifyReport",
           "read_replicas", "replica_path", "write_replica"]
