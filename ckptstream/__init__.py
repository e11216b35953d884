"""ckptstream: weights of an RL trainer streamed through shared storage into running vLLM servers.

The public API: ``Publisher`` writes versions (keyframes and lossless deltas, committed by an atomic
manifest); ``Stream`` lists, reads, verifies and materializes them. See README.md and FORMAT.md.

Names are imported on first use, so ``import ckptstream`` stays cheap (no torch until a name needs it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_face

__version__ = "0.1.0"

_ERRORS = ("CkptStreamError", "IncompatibleStreamError", "IntegrityError", "InvalidVersionError", "MissingBaseError",
           "PublishError", "StorageCapabilityError", "StreamNotFoundError", "TensorNotFoundError",
           "UnsafeManifestError", "VersionConflictError", "VersionNotFoundError", "VersionOrderError")
_LAZY_NAMES = {
    **dict.fromkeys(_ERRORS, ".errors"),
    **dict.fromkeys(("FORMAT_VERSION", "Manifest", "StreamInfo", "TensorEntry"), ".format"),
    **dict.fromkeys(("Stream", "VerifyReport"), ".reader"),
    "Publisher": ".writer",
}

if TYPE_CHECKING:
    from .errors import (
        CkptStreamError,
        IncompatibleStreamError,
        IntegrityError,
        InvalidVersionError,
        MissingBaseError,
        PublishError,
        StorageCapabilityError,
        StreamNotFoundError,
        TensorNotFoundError,
        UnsafeManifestError,
        VersionConflictError,
        VersionNotFoundError,
        VersionOrderError,
    )
    from .format import FORMAT_VERSION, Manifest, StreamInfo, TensorEntry
    from .reader import Stream, VerifyReport
    from .writer import Publisher

__getattr__, __dir__ = lazy_face(__name__, _LAZY_NAMES)

__all__ = [
    "FORMAT_VERSION", "CkptStreamError", "IncompatibleStreamError", "IntegrityError", "InvalidVersionError",
    "Manifest", "MissingBaseError", "PublishError", "Publisher", "StorageCapabilityError", "Stream", "StreamInfo",
    "StreamNotFoundError", "TensorEntry", "TensorNotFoundError", "UnsafeManifestError", "VerifyReport",
    "VersionConflictError",
    "VersionNotFoundError", "VersionOrderError", "__version__",
]
