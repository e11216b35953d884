"""ckptstream: weights of an RL trainer streamed through shared storage into running vLLM servers.

The public API: ``Publisher`` writes versions (keyframes and lossless deltas, committed by an atomic
manifest); ``Stream`` lists, reads, verifies and materializes them; ``Mirror``, ``export_bundle`` /
``import_bundle`` and ``Relay`` carry a stream to other stores, air-gapped sites and HTTP readers. See
README.md, docs/ and FORMAT.md.

Names are imported on first use, so ``import ckptstream`` stays cheap (no torch until a name needs it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_face

__version__ = "0.1.0"

_ERRORS = ("AdapterMismatchError", "CkptStreamError", "ForeignStreamError", "IncompatibleStreamError", "IntegrityError",
           "InvalidVersionError",
           "MissingBaseError",
           "PublishError", "StorageCapabilityError", "StreamKindError", "StreamNotFoundError", "TensorNotFoundError",
           "UnsafeManifestError", "VersionConflictError", "VersionNotFoundError", "VersionOrderError")
_LAZY_NAMES = {
    **dict.fromkeys(_ERRORS, ".errors"),
    **dict.fromkeys(("FORMAT_VERSION", "AdapterInfo", "Manifest", "StreamInfo", "TensorEntry"), ".format"),
    **dict.fromkeys(("Stream", "VerifyReport"), ".reader"),
    "Publisher": ".writer",
    **dict.fromkeys(("Mirror", "MirrorConfig"), ".mirror"),
    **dict.fromkeys(("export_bundle", "import_bundle"), ".bundle"),
    "Relay": ".relay",
}

if TYPE_CHECKING:
    from .errors import (
        AdapterMismatchError,
        CkptStreamError,
        ForeignStreamError,
        IncompatibleStreamError,
        IntegrityError,
        InvalidVersionError,
        MissingBaseError,
        PublishError,
        StorageCapabilityError,
        StreamKindError,
        StreamNotFoundError,
        TensorNotFoundError,
        UnsafeManifestError,
        VersionConflictError,
        VersionNotFoundError,
        VersionOrderError,
    )
    from .bundle import export_bundle, import_bundle
    from .format import FORMAT_VERSION, AdapterInfo, Manifest, StreamInfo, TensorEntry
    from .mirror import Mirror, MirrorConfig
    from .reader import Stream, VerifyReport
    from .relay import Relay
    from .writer import Publisher

__getattr__, __dir__ = lazy_face(__name__, _LAZY_NAMES)

__all__ = [
    "FORMAT_VERSION", "AdapterInfo", "AdapterMismatchError", "CkptStreamError", "ForeignStreamError",
    "IncompatibleStreamError", "IntegrityError", "InvalidVersionError", "Manifest", "Mirror", "MirrorConfig",
    "MissingBaseError", "PublishError", "Publisher", "Relay", "StorageCapabilityError", "Stream", "StreamInfo",
    "StreamKindError", "StreamNotFoundError", "TensorEntry",
    "TensorNotFoundError", "UnsafeManifestError", "VerifyReport", "VersionConflictError", "VersionNotFoundError",
    "VersionOrderError", "__version__", "export_bundle", "import_bundle",
]
