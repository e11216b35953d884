"""From a stream URL to its storage backend: a registry of URL schemes, with fsspec as the fallback.

Local paths, ``file://`` and ``local://`` are POSIX directories; a scheme registered with
:func:`register_backend` gets its own backend (such as a read-only HTTP backend); any other scheme
fsspec knows (``s3://``, ``memory://``, ...) is an :class:`FsspecStorage`. fsspec is imported only then.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import StorageCapabilityError
from .base import Storage
from .fsspec import FS_OPTIONS, FsspecStorage
from .posix import PosixStorage

BackendFactory = Callable[[str, Mapping[str, Any]], Storage]
"""Makes the storage of a URL: ``factory(url, storage_options)``."""

_lock = threading.Lock()
_backends: dict[str, BackendFactory] = {}


def register_backend(scheme: str, factory: BackendFactory, *, replace: bool = False) -> None:
    """Open URLs ``<scheme>://...`` with ``factory(url, storage_options)``.

    A scheme registered twice is a ValueError, unless ``replace`` (the same factory again is fine), so
    that two plugins cannot silently take each other's URLs.
    """
    scheme = scheme.lower()
    if not scheme or "://" in scheme or "::" in scheme:
        raise ValueError(f"invalid URL scheme {scheme!r}")
    with _lock:
        known = _backends.get(scheme)
        if known is not None and known is not factory and not replace:
            raise ValueError(f"URL scheme {scheme!r} already has a storage backend ({known!r})")
        _backends[scheme] = factory


def registered_schemes() -> list[str]:
    """The schemes with a backend of their own (fsspec's protocols come on top)."""
    with _lock:
        return sorted(_backends)


def open_storage(url: str, storage_options: Mapping[str, Any] | None = None) -> Storage:
    """Storage for a stream URL: a local path or ``file://`` URL, a registered scheme, or any fsspec URL
    (``s3://bucket/p``).

    ``storage_options`` go to the backend (for s3fs: ``profile``, ``endpoint_url``, ``key``, ...). S3 also
    follows the standard AWS configuration: ``AWS_ENDPOINT_URL``, credentials, profiles. A scheme nobody
    knows, or one whose fsspec package is not installed, is a StorageCapabilityError.
    """
    scheme, _, rest = url.partition("://")
    if not rest:
        return PosixStorage(url)
    if not scheme:  # "://path": a path
        return PosixStorage(rest)
    with _lock:
        factory = _backends.get(scheme.lower())
    if factory is not None:
        return factory(url, dict(storage_options or {}))
    return _open_fsspec(url, scheme, storage_options or {})


def _open_posix(url: str, storage_options: Mapping[str, Any]) -> Storage:
    return PosixStorage(url.partition("://")[2])


def _open_fsspec(url: str, scheme: str, storage_options: Mapping[str, Any]) -> Storage:
    import fsspec
    import fsspec.core

    try:
        for protocol in scheme.split("::"):  # a chained URL (simplecache::s3://...) needs every link
            try:
                fsspec.get_filesystem_class(protocol)
            except ValueError:
                raise StorageCapabilityError(
                    f"unknown storage URL scheme {protocol!r} in {url}",
                    hint=f"Use a local path or one of: {', '.join(_supported_schemes())}") from None
        fs, root = fsspec.core.url_to_fs(url, **{**storage_options, **FS_OPTIONS})
    except ImportError as exc:  # fsspec knows the protocol, its package is missing (at lookup or creation)
        hint = "pip install 'ckptstream[s3]'" if scheme in ("s3", "s3a") else "Install the package the message names"
        raise StorageCapabilityError(f"storage URL scheme {scheme!r} needs a package that is not installed "
                                     f"({exc})", hint=hint) from None
    return FsspecStorage(fs, root, url.rstrip("/"))


def _supported_schemes() -> list[str]:
    from fsspec.registry import known_implementations, registry

    return sorted({*registered_schemes(), *known_implementations, *registry})


def _open_http(url: str, storage_options: Mapping[str, Any]) -> Storage:
    from .http import open_http_storage  # urllib3 only when an HTTP stream is opened

    return open_http_storage(url, storage_options)


register_backend("file", _open_posix)
register_backend("local", _open_posix)
# Before fsspec's own http file system, which lists by scraping HTML and reads without retries.
register_backend("http", _open_http)
register_backend("https", _open_http)
