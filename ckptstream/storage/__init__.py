"""Byte storage under a stream root: POSIX paths (local disk, NFS, Lustre), fsspec object stores, and any
backend registered for a URL scheme.

``open_storage(url)`` picks the backend; every backend implements :class:`Storage` and declares its
:class:`Capabilities`. The generic behaviour every backend must show is the suite in
``ckptstream.testing.storage``. Importing this package imports neither fsspec nor torch.
"""

from .base import (MAX_CONCURRENT_READS, RANGE_CHUNK_BYTES, Capabilities, Entry, Storage, Watch, chunk_spans,
                   temp_name)
from .fsspec import FsspecStorage
from .posix import PosixStorage, fsync_path
from .registry import BackendFactory, open_storage, register_backend, registered_schemes
from .throttle import ThrottledStorage
from .wrapper import ReadOnlyStorage, WrapperStorage

__all__ = [
    "MAX_CONCURRENT_READS", "RANGE_CHUNK_BYTES", "BackendFactory", "Capabilities", "Entry", "FsspecStorage",
    "PosixStorage", "ReadOnlyStorage", "Storage", "ThrottledStorage", "Watch", "WrapperStorage", "chunk_spans",
    "fsync_path", "open_storage", "register_backend", "registered_schemes", "temp_name",
]
