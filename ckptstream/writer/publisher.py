"""``Publisher``: writes versions of model weights to a stream — keyframes and lossless deltas.

The trainer waits only for the snapshot (a copy of the tensors into host buffers that are reused from
version to version); encoding, writing and the commit run on background threads, at most
``max_in_flight`` versions at a time, in version order.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import socket
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Union

import torch

from .. import __version__, codec
from ..errors import (CkptStreamError, IncompatibleStreamError, PublishError, VersionConflictError,
                      VersionOrderError)
from ..format import (DEFAULT_SHARD_BYTES, DELTA, ENCODING_RAW, ENCODING_UNCHANGED, ENCODING_XOR_ZSTD, ENCODING_ZSTD, KEYFRAME,
                      STREAM_FILE, FileEntry, Hasher, Manifest, StreamInfo, TensorEntry, asset_path,
                      content_hash, data_path, is_safe_file_name, manifest_path, safetensors_header,
                      shard_groups)
from ..parallel import default_workers, ordered_parallel
from ..reader import Stream
from ..storage import Storage, temp_name

log = logging.getLogger("ckptstream.publish")

NamedTensors = Union[Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]]


@dataclass
class _Job:
    version: int
    tensors: list[tuple[str, torch.Tensor]]  # host snapshot, owned by the publisher
    step: int | None
    metadata: dict[str, Any]
    keyframe: bool
    future: Future[Manifest] = field(default_factory=Future)


@dataclass
class _Base:
    """The last version this publisher committed (or found), with its tensors in host memory."""

    manifest: Manifest
    tensors: dict[str, torch.Tensor]


@dataclass
class _Encoded:
    encoding: str
    frames: list[bytes]
    chunks: list[tuple[int, int, str]]
    changed: int


class Publisher:
    """Publishes versions of model weights to the stream at ``url``.

    Args:
        url: stream location: a local/NFS path, ``file://``, ``s3://bucket/prefix`` or any fsspec URL.
        storage_options: passed to the fsspec file system (e.g. ``{"profile": "train"}``).
        assets: the non-weight files that make a materialized directory servable (config.json,
            tokenizer files, generation_config.json), as a mapping of file name to bytes or a Hugging Face
            model directory to take them from. Stored once, when the stream is created.
        keyframe_every: at most this many versions per keyframe chain (1 writes only keyframes).
        delta_max_ratio: a delta larger than this fraction of the full bytes is written as a keyframe.
        shard_bytes: maximum size of one data file.
        chunk_bytes: size of independently compressed chunks (the unit of parallel encode/decode).
        zstd_level: zstd compression level for deltas.
        shuffle: byte-shuffle chunks before compression (groups the bytes of equal significance).
        max_in_flight: versions snapshotted but not yet committed; ``publish`` blocks beyond this.
        workers: encoder threads (default: one per core, at most 8).
        base_cache_dir: a local directory keeping a copy of the last version this publisher wrote, so a
            fresh process (e.g. the CLI) can write a delta without decoding the stream's latest version.

    Example::

        with Publisher("s3://bucket/run1", assets="path/to/hf_model") as pub:
            for step in range(steps):
                train_step()
                pub.publish(model.state_dict(), step=step)   # returns once the snapshot is taken
    """

    def __init__(self, url: str, *, storage_options: Mapping[str, Any] | None = None,
                 assets: Mapping[str, bytes] | str | os.PathLike[str] | None = None,
                 keyframe_every: int = 10, delta_max_ratio: float = 0.5,
                 shard_bytes: int = DEFAULT_SHARD_BYTES, chunk_bytes: int = codec.DEFAULT_CHUNK_BYTES,
                 zstd_level: int = 3, shuffle: bool = True, max_in_flight: int = 1, workers: int | None = None,
                 base_cache_dir: str | os.PathLike[str] | None = None):
        if keyframe_every < 1 or max_in_flight < 1 or shard_bytes < 1 or chunk_bytes < 8:
            raise ValueError("keyframe_every, max_in_flight, shard_bytes and chunk_bytes must be positive")
        self.stream = Stream(url, storage_options=storage_options)
        self.storage: Storage = self.stream.storage
        self.keyframe_every = keyframe_every
        self.delta_max_ratio = delta_max_ratio
        self.shard_bytes = shard_bytes
        self.chunk_bytes = chunk_bytes
        self.zstd_level = zstd_level
        self.shuffle = shuffle
        self.base_cache_dir = Path(base_cache_dir).expanduser() if base_cache_dir is not None else None
        self.writer_id = uuid.uuid4().hex[:12]
        if isinstance(assets, (str, os.PathLike)):
            from ..hf import hf_assets
            assets = hf_assets(assets)
        self.info = open_or_create_stream(self.storage, assets)
        self.stream._info = self.info
        self._slots = threading.BoundedSemaphore(max_in_flight)
        self._committer = ThreadPoolExecutor(1, thread_name_prefix="ckptstream-commit")
        self._encoder = ThreadPoolExecutor(workers or default_workers(), thread_name_prefix="ckptstream-encode")
        self._lock = threading.Lock()
        self._error: CkptStreamError | None = None
        self._last_version: int | None = None
        self._base: _Base | None = None
        self._base_known = False  # whether _base reflects the stream (False: look it up before a delta)
        self._free: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}
        self._closed = False

    # ------------------------------------------------------------------------------------ public API

    def publish(self, named_tensors: NamedTensors, version: int | None = None, *, step: int | None = None,
                metadata: Mapping[str, Any] | None = None, keyframe: bool = False) -> Future[Manifest]:
        """Snapshot the tensors and publish them as a new version in the background.

        Args:
            named_tensors: a state dict or (name, tensor) pairs under the names the receiver loads
                (Hugging Face names for vLLM); any device, contiguous or not.
            version: the version number; default the latest version + 1 (0 for a new stream). Must be
                greater than every version already in the stream.
            step: the training step, recorded in the manifest.
            metadata: JSON-serializable data recorded in the manifest.
            keyframe: force a keyframe.

        Returns:
            A future resolving to the committed ``Manifest`` (or raising the failure). ``publish`` returns
            as soon as the tensors are copied, so the caller may modify them right away.

        Raises:
            VersionOrderError: ``version`` is not newer than the latest version.
            PublishError (or the original CkptStreamError): an earlier background publish failed.
        """
        self._check_open()
        self._raise_failure()
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        metadata = dict(metadata or {})
        json.dumps(metadata)  # TypeError now rather than in the background
        with self._lock:
            version = self._next_version(version)
        self._slots.acquire()
        try:
            snapshot = self._snapshot(items)
        except BaseException:
            self._slots.release()
            raise
        with self._lock:
            self._last_version = version
        job = _Job(version, snapshot, step, metadata, keyframe)
        self._committer.submit(self._run, job)
        return job.future

    def wait(self) -> None:
        """Block until every version published so far is committed; raise the first failure, if any."""
        self._committer.submit(lambda: None).result()
        self._raise_failure()

    def close(self) -> None:
        """Wait for pending versions, then release threads and buffers."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._committer.shutdown(wait=True)
            self._encoder.shutdown(wait=True)
            self._base = None
            self._free.clear()

    def __enter__(self) -> "Publisher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------ front half

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("publisher is closed")

    def _raise_failure(self) -> None:
        with self._lock:
            error, self._error = self._error, None
            if error is not None:
                # Start over from what the stream holds: the next version is numbered from the stream.
                self._last_version = None
                self._base, self._base_known = None, False
        if error is not None:
            raise error

    def _next_version(self, requested: int | None) -> int:
        if self._last_version is None:
            self._last_version = self.stream.latest()
        last = self._last_version
        if requested is None:
            return 0 if last is None else last + 1
        if last is not None and requested <= last:
            raise VersionOrderError(f"version {requested} is not newer than the latest version {last}",
                                    version=requested, hint=f"Publish version {last + 1} or later")
        if requested < 0:
            raise ValueError("versions are non-negative")
        return requested

    def _snapshot(self, items: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """Copy tensors into host buffers (pinned for device tensors), reusing retired buffers. ``items`` is
        consumed once, so it may produce each tensor just in time (e.g. gathered from other ranks)."""
        snapshot = []
        devices = set()
        seen: set[str] = set()
        with self._lock:
            free = self._free
            self._free = {}
        for name, tensor in items:
            _check_tensor(name, tensor, seen)
            tensor = tensor.detach()
            key = (tuple(tensor.shape), tensor.dtype)
            on_device = tensor.device.type != "cpu"
            buffers = free.get(key)
            if buffers:
                buffer = buffers.pop()
            else:
                buffer = torch.empty(key[0], dtype=tensor.dtype, pin_memory=on_device and torch.cuda.is_available())
            buffer.copy_(tensor, non_blocking=on_device)
            if on_device:
                devices.add(tensor.device)
            snapshot.append((name, buffer))
        for device in devices:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        return snapshot

    # ------------------------------------------------------------------------------------- back half

    def _run(self, job: _Job) -> None:
        try:
            with self._lock:
                failed = self._error is not None
            if failed:
                raise PublishError("not published because an earlier version failed", version=job.version)
            manifest = self._write(job)
            self._promote(job, manifest)
            job.future.set_result(manifest)
        except BaseException as exc:  # noqa: BLE001 - surfaced to the caller through the future
            error = exc if isinstance(exc, CkptStreamError) else PublishError(
                f"publishing failed: {exc!r}", version=job.version)
            if error is not exc:
                error.__cause__ = exc
            log.error("%s", error)
            with self._lock:
                if self._error is None:
                    self._error = error
            job.future.set_exception(error)
        finally:
            self._slots.release()

    def _write(self, job: _Job) -> Manifest:
        base = self._current_base(job.version)
        hashes = self._hash_async(job)
        delta = self._try_delta(job, base)
        files, tensors = self._write_data(job, delta, hashes)
        manifest = self._version_manifest(job, base if delta is not None else None, files, tensors)
        self._commit(manifest)
        return manifest

    def _hash_async(self, job: _Job) -> list[Future[str]]:
        return [self._encoder.submit(codec.tensor_hash, t) for _, t in job.tensors]

    def _try_delta(self, job: _Job, base: _Base | None) -> list[_Encoded] | None:
        """The delta against ``base``, or None where this version is to be a keyframe."""
        if job.keyframe or base is None or base.manifest.chain_length + 1 >= self.keyframe_every:
            return None
        return self._encode_delta(job, base)

    def _write_data(self, job: _Job, delta: list[_Encoded] | None, hashes: list[Future[str]]
                    ) -> tuple[list[FileEntry], list[TensorEntry]]:
        """Write the version's data files (a keyframe where ``delta`` is None); return their entries."""
        if delta is None:
            return self._write_keyframe(job, [h.result() for h in hashes])
        return self._write_delta(job, delta, [h.result() for h in hashes])

    def _version_manifest(self, job: _Job, base: _Base | None, files: list[FileEntry],
                          tensors: list[TensorEntry]) -> Manifest:
        """The manifest of a keyframe (``base`` None) or of a delta against ``base``."""
        if base is None:
            return self._manifest(job, KEYFRAME, None, job.version, 0, files, tensors)
        return self._manifest(job, DELTA, base.manifest.version, base.manifest.keyframe_version,
                              base.manifest.chain_length + 1, files, tensors)

    def _commit(self, manifest: Manifest) -> None:
        """Make the version visible: put-if-absent of its manifest."""
        try:
            self.storage.put_if_absent(manifest_path(manifest.version), manifest.to_bytes())
        except FileExistsError:
            raise VersionConflictError("another writer committed this version first", version=manifest.version,
                                       hint="This writer's data files are left for `ckptstream gc`; "
                                            "publish a newer version") from None
        log.info("committed version %d (%s, %d bytes stored)", manifest.version, manifest.kind,
                 manifest.stored_bytes)

    def _manifest(self, job: _Job, kind: str, base: int | None, keyframe_version: int, chain_length: int,
                  files: list[FileEntry], tensors: list[TensorEntry]) -> Manifest:
        return Manifest(version=job.version, kind=kind, base_version=base, keyframe_version=keyframe_version,
                        chain_length=chain_length, stream_id=self.info.stream_id, created=_now(),
                        files=tuple(files), tensors=tuple(tensors), step=job.step, metadata=job.metadata,
                        writer={"id": self.writer_id, "host": socket.gethostname(), "pid": os.getpid(),
                                "library": f"ckptstream {__version__}"})

    def _write_keyframe(self, job: _Job, hashes: list[str]) -> tuple[list[FileEntry], list[TensorEntry]]:
        groups = shard_groups([t.numel() * t.element_size() for _, t in job.tensors], self.shard_bytes)
        files, entries = [], []
        for index, group in enumerate(groups):
            name = f"model-{self.writer_id}-{index + 1:05d}-of-{len(groups):05d}.safetensors"
            members = [(job.tensors[i], hashes[i]) for i in group]
            header, offsets = safetensors_header(
                ((n, codec.dtype_name(t.dtype), tuple(t.shape), t.numel() * t.element_size()) for (n, t), _ in members),
                {"format": "pt", "ckptstream_version": str(job.version)})
            file_hasher = Hasher()
            size = len(header)
            with self.storage.open_write(data_path(job.version, name)) as f:
                f.write(header)
                file_hasher.update(header)
                for ((tensor_name, tensor), digest), offset in zip(members, offsets):
                    data = codec.buffer_of(codec.as_bytes(tensor))
                    f.write(data)
                    file_hasher.update(data)
                    size += len(data)
                    entries.append(TensorEntry(name=tensor_name, dtype=codec.dtype_name(tensor.dtype),
                                               shape=tuple(tensor.shape), hash=digest, encoding=ENCODING_RAW,
                                               file=name, offset=offset, length=len(data), stored_hash=digest))
            files.append(FileEntry(name, size, file_hasher.digest()))
        return files, entries

    def _encode_delta(self, job: _Job, base: _Base) -> list[_Encoded] | None:
        """Encode every tensor against the base; None as soon as the delta outgrows ``delta_max_ratio``."""
        limit = self.delta_max_ratio * sum(t.numel() * t.element_size() for _, t in job.tensors)
        tasks = []  # (tensor index, new bytes, base bytes or None, itemsize)
        plans = []
        for index, (name, tensor) in enumerate(job.tensors):
            previous = base.tensors.get(name)
            if previous is not None and (previous.dtype, previous.shape) != (tensor.dtype, tensor.shape):
                previous = None
            new_bytes = codec.as_bytes(tensor)
            base_bytes = codec.as_bytes(previous) if previous is not None else None
            plans.append(_Encoded(ENCODING_XOR_ZSTD if previous is not None else ENCODING_ZSTD, [], [], 0))
            for start, end in codec.chunk_ranges(new_bytes.numel(), tensor.element_size(), self.chunk_bytes):
                tasks.append((index, new_bytes[start:end], None if base_bytes is None else base_bytes[start:end],
                              tensor.element_size()))

        def encode(task: tuple[int, torch.Tensor, torch.Tensor | None, int]) -> tuple[int, int, bytes, int, str]:
            index, new, old, itemsize = task
            frame, changed, layout = codec.encode_chunk(new, old, itemsize, shuffle=self.shuffle,
                                                        level=self.zstd_level)
            return index, new.numel(), frame, changed, layout

        stored = 0
        results = ordered_parallel(tasks, encode, lambda task: task[1].numel(), executor=self._encoder,
                                   max_cost=max(self.chunk_bytes, 64 << 20) * 4)
        try:
            for index, raw_len, frame, changed, layout in results:
                plan = plans[index]
                plan.frames.append(frame)
                plan.chunks.append((raw_len, len(frame), layout))
                plan.changed += changed
                stored += len(frame)
                if stored > limit:
                    log.info("version %d: delta exceeds %.0f%% of the full size; writing a keyframe",
                             job.version, 100 * self.delta_max_ratio)
                    return None
        finally:
            results.close()
        for plan in plans:
            if plan.encoding == ENCODING_XOR_ZSTD and plan.changed == 0:
                plan.encoding, plan.frames, plan.chunks = ENCODING_UNCHANGED, [], []
        return plans

    def _write_delta(self, job: _Job, encoded: list[_Encoded], hashes: list[str]
                     ) -> tuple[list[FileEntry], list[TensorEntry]]:
        entries: list[TensorEntry | None] = [None] * len(job.tensors)
        for i, ((name, tensor), plan) in enumerate(zip(job.tensors, encoded)):
            if plan.encoding == ENCODING_UNCHANGED:
                entries[i] = TensorEntry(name=name, dtype=codec.dtype_name(tensor.dtype), shape=tuple(tensor.shape),
                                         hash=hashes[i], encoding=ENCODING_UNCHANGED, changed=0)
        stored_indices = [i for i, plan in enumerate(encoded) if plan.encoding != ENCODING_UNCHANGED]
        groups = shard_groups([sum(len(f) for f in encoded[i].frames) for i in stored_indices], self.shard_bytes)
        files = []
        for number, group in enumerate(groups):
            name = f"delta-{self.writer_id}-{number + 1:05d}-of-{len(groups):05d}.zst"
            file_hasher = Hasher()
            position = 0
            with self.storage.open_write(data_path(job.version, name)) as f:
                for i in (stored_indices[g] for g in group):
                    tensor_name, tensor = job.tensors[i]
                    plan = encoded[i]
                    stored_hasher = Hasher()
                    for frame in plan.frames:
                        f.write(frame)
                        file_hasher.update(frame)
                        stored_hasher.update(frame)
                    length = sum(len(frame) for frame in plan.frames)
                    entries[i] = TensorEntry(
                        name=tensor_name, dtype=codec.dtype_name(tensor.dtype), shape=tuple(tensor.shape),
                        hash=hashes[i], encoding=plan.encoding, file=name, offset=position, length=length,
                        stored_hash=stored_hasher.digest(), shuffle=self.shuffle, chunks=tuple(plan.chunks),
                        changed=plan.changed)
                    position += length
            files.append(FileEntry(name, position, file_hasher.digest()))
        assert all(e is not None for e in entries)
        return files, [e for e in entries if e is not None]

    def _promote(self, job: _Job, manifest: Manifest) -> None:
        """Make the committed version the base of the next delta; retire the old base's buffers."""
        with self._lock:
            old, self._base, self._base_known = self._base, _Base(manifest, dict(job.tensors)), True
            free: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}
            if old is not None:
                for tensor in old.tensors.values():
                    free.setdefault((tuple(tensor.shape), tensor.dtype), []).append(tensor)
            self._free = free
        if self.base_cache_dir is not None:
            self._save_base_cache(manifest, job.tensors)

    # ------------------------------------------------------------------------------------- base lookup

    def _current_base(self, version: int) -> _Base | None:
        """The version to encode a delta against: the last one this publisher committed or, for a fresh
        publisher, the stream's latest (from the local base cache or decoded from the stream)."""
        with self._lock:
            if self._base_known:
                return self._base
        latest = self.stream.latest()
        base = None
        if latest is not None and latest < version:
            try:
                manifest = self.stream.manifest(latest)
                tensors = self._load_base_cache(manifest)
                if tensors is None:
                    tensors = dict(self.stream.iter_tensors(latest))
                base = _Base(manifest, tensors)
            except CkptStreamError as exc:
                log.warning("cannot use version %d as a delta base (%s); writing a keyframe", latest, exc)
        with self._lock:
            self._base, self._base_known = base, True
        return base

    def _base_cache_file(self) -> Path:
        assert self.base_cache_dir is not None
        return self.base_cache_dir / f"{self.info.stream_id}.safetensors"

    def _save_base_cache(self, manifest: Manifest, tensors: list[tuple[str, torch.Tensor]]) -> None:
        from safetensors.torch import save_file

        path = self._base_cache_file()
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.with_name(temp_name(path.name))
        try:
            save_file(dict(tensors), str(temp), metadata={"version": str(manifest.version)})
            os.replace(temp, path)
        except OSError as exc:
            log.warning("cannot write the base cache %s: %s", path, exc)
        finally:
            temp.unlink(missing_ok=True)

    def _load_base_cache(self, manifest: Manifest) -> dict[str, torch.Tensor] | None:
        """The cached copy of ``manifest``'s version, if there is one and every tensor matches its hash."""
        if self.base_cache_dir is None or not self._base_cache_file().exists():
            return None
        from safetensors import safe_open

        try:
            with safe_open(str(self._base_cache_file()), framework="pt") as f:
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


def open_or_create_stream(storage: Storage, assets: Mapping[str, bytes] | None) -> StreamInfo:
    """The stream's ``StreamInfo``, creating the stream (assets, then ``stream.json``) if it is new.

    Raises IncompatibleStreamError if a file of ``assets`` differs from the stream's file of that name
    (files the stream lacks are ignored: the assets are fixed when the stream is created).
    """
    assets = dict(assets or {})
    for name in assets:
        if not is_safe_file_name(name):
            raise ValueError(f"asset name {name!r} must be a plain file name")
    try:
        info = StreamInfo.from_bytes(storage.read(STREAM_FILE))
    except FileNotFoundError:
        entries = []
        for name, data in sorted(assets.items()):
            entry = FileEntry(name, len(data), content_hash(data))
            try:
                storage.put_if_absent(asset_path(name), data)
            except FileExistsError:
                if content_hash(storage.read(asset_path(name))) != entry.hash:
                    raise IncompatibleStreamError("another writer is creating this stream with a different "
                                                  "file", file=asset_path(name)) from None
            entries.append(entry)
        info = StreamInfo(stream_id=uuid.uuid4().hex, created=_now(), assets=tuple(entries))
        try:
            storage.put_if_absent(STREAM_FILE, info.to_bytes())
            return info
        except FileExistsError:
            info = StreamInfo.from_bytes(storage.read(STREAM_FILE))
    have = {a.name: a.hash for a in info.assets}
    different = sorted(n for n, data in assets.items() if n in have and content_hash(data) != have[n])
    if different:
        raise IncompatibleStreamError(
            f"the stream was created with other non-weight files ({', '.join(different)} differ)",
            file=STREAM_FILE, hint="A stream holds one model; publish to a new stream URL")
    return info


def _check_tensor(name: str, tensor: torch.Tensor, seen: set[str]) -> None:
    if not isinstance(name, str) or not name or not name.isprintable() or len(name) > 1024:
        raise ValueError(f"invalid tensor name {name!r}")
    if name in seen:
        raise ValueError(f"tensor {name!r} is given twice")
    seen.add(name)
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
    if tensor.layout != torch.strided:
        raise TypeError(f"tensor {name!r} has layout {tensor.layout}; only dense tensors can be published")
    codec.dtype_name(tensor.dtype)


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")
