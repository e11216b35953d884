"""Reading streams: discovery, verification, decoding and materialization of versions."""

from .stream import MARKER_FILE, MaterializedBase, Stream, TensorDiff, VerifyReport

__all__ = ["MARKER_FILE", "MaterializedBase", "Stream", "TensorDiff", "VerifyReport"]
