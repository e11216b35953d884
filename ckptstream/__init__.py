"""ckptstream: weights of an RL trainer streamed through shared storage into running vLLM servers.

The public API: ``Publisher`` writes versions (keyframes and lossless deltas, committed by an atomic
manifest); ``Stream`` lists, reads, verifies and materializes them. See README.md and FORMAT.md.
"""

__version__ = "0.1.0"

from .errors import (CkptStreamError, IncompatibleStreamError, IntegrityError, MissingBaseError,  # noqa: E402
                     PublishError, StorageCapabilityError, StreamNotFoundError, UnsafeManifestError,
                     VersionConflictError, VersionNotFoundError, VersionOrderError)
from .format import FORMAT_VERSION, Manifest, StreamInfo, TensorEntry  # noqa: E402
from .reader import Stream, VerifyReport  # noqa: E402
from .writer import Publisher  # noqa: E402

__all__ = [
    "FORMAT_VERSION", "CkptStreamError", "IncompatibleStreamError", "IntegrityError", "Manifest",
    "MissingBaseError", "PublishError", "Publisher", "StorageCapabilityError", "Stream", "StreamInfo",
    "StreamNotFoundError", "TensorEntry", "UnsafeManifestError", "VerifyReport", "VersionConflictError",
    "VersionNotFoundError", "VersionOrderError", "__version__",
]
