"""Reading streams: discovery, verification, decoding and materialization of versions."""

from ..format import MARKER_FILE
from .materialize import MaterializedBase
from .replicas import ReplicaRecord, read_replicas, replica_path, write_replica
from .stream import Stream, TensorDiff, VerifyReport

__all__ = ["MARKER_FILE", "MaterializedBase", "ReplicaRecord", "Stream", "TensorDiff", "VerifyReport",
           "read_replicas", "replica_path", "write_replica"]
