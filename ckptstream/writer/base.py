"""The delta base of a publisher: the last version it committed, or for a fresh publisher the stream's
latest version (from a local cache of the last version written, else decoded from the stream)."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import torch

from .. import codec
from ..errors import CkptStreamError
from ..format import Manifest
from ..reader import Stream
from ..storage import temp_name
from .encode import BaseVersion

log = logging.getLogger("ckptstream.publish")


class BaseLookup:
    """Keeps the version the next delta is encoded against.

    Args:
        stream: where a fresh publisher (or one that failed) looks for the latest version; None: only
            versions this publisher committed are bases (the ranks of a job cannot cheaply agree on a
            version decoded from the stream, so they start with a keyframe).
        cache_dir: a local directory keeping a copy of the last version committed (one file per
            stream), so that a fresh process need not decode the stream's latest version.
    """

    def __init__(self, stream: Stream | None, cache_dir: str | os.PathLike[str] | None = None):
        self._stream = stream
        self._cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else None
        self._lock = threading.Lock()
        self._base: BaseVersion | None = None
        self._known = stream is None  # whether _base reflects the stream (False: look it up first)

    def current(self, version: int) -> BaseVersion | None:
        """The base for a delta of ``version``: the last version committed through this lookup, or else
        the stream's latest version older than ``version`` (None: a keyframe is needed)."""
        with self._lock:
            if self._known:
                return self._base
        assert self._stream is not None
        latest = self._stream.latest()
        base = None
        if latest is not None and latest < version:
            try:
                manifest = self._stream.manifest(latest)
                tensors = self._load_cache(manifest)
                if tensors is None:
                    tensors = dict(self._stream.iter_tensors(latest))
                base = BaseVersion(manifest, tensors)
            except CkptStreamError as exc:
                log.warning("cannot use version %d as a delta base (%s); writing a keyframe", latest, exc)
        with self._lock:
            self._base, self._known = base, True
        return base

    def promote(self, manifest: Manifest, tensors: list[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Make a committed version the next base; return the tensors of the base it replaces (nobody
        reads them any more)."""
        with self._lock:
            old, self._base, self._known = self._base, BaseVersion(manifest, dict(tensors)), True
        if self._cache_dir is not None:
            self._save_cache(manifest, tensors)
        return [] if old is None else list(old.tensors.values())

    def forget(self) -> None:
        """Drop the base (after a failure): the next version is encoded against what the stream holds, or
        is a keyframe."""
        with self._lock:
            self._base, self._known = None, self._stream is None

    def _cache_file(self, stream_id: str) -> Path:
        assert self._cache_dir is not None
        return self._cache_dir / f"{stream_id}.safetensors"

    def _save_cache(self, manifest: Manifest, tensors: list[tuple[str, torch.Tensor]]) -> None:
        from safetensors.torch import save_file

        path = self._cache_file(manifest.stream_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.with_name(temp_name(path.name))
        try:
            save_file(dict(tensors), str(temp), metadata={"version": str(manifest.version)})
            os.replace(temp, path)
        except OSError as exc:
            log.warning("cannot write the base cache %s: %s", path, exc)
        finally:
            temp.unlink(missing_ok=True)

    def _load_cache(self, manifest: Manifest) -> dict[str, torch.Tensor] | None:
        """The cached copy of ``manifest``'s version, if there is one and every tensor matches its hash."""
        if self._cache_dir is None or not self._cache_file(manifest.stream_id).exists():
            return None
        from safetensors import safe_open

        try:
            with safe_open(str(self._cache_file(manifest.stream_id)), framework="pt") as f:
                if (f.metadata() or {}).get("version") != str(manifest.version):
                    return None
                tensors = {name: f.get_tensor(name) for name in f.keys()}
        except Exception as exc:  # noqa: BLE001 - an unreadable cache is only a missed shortcut
            log.warning("ignoring unreadable base cache: %s", exc)
            return None
        expected = manifest.tensor_map()
        if set(tensors) != set(expected) or any(
                codec.tensor_hash(t) != expected[n].hash for n, t in tensors.items()):
            return None
        return tensors
