"""``Publisher``: the pipeline that writes versions of model weights to a stream.

Each version goes through the same stages, each its own part:

1. snapshot (``snapshot.SnapshotBuffers``): the tensors are copied into reused host buffers; the only
   stage the trainer waits for — ``publish`` returns when it is done, ``stage`` at once with a future of
   its own (``Publication.staged``) apart from the commit's (``Publication.committed``). For CUDA tensors
   (``device_delta``), the snapshot is ``device_encode.DeviceSnapshot``'s instead: the changes against a
   device-resident copy of the last version, found on the device, reach the host in the background;
2. encode (``encode.VersionEncoder``): a delta against the base (``base.BaseLookup``) where one is
   allowed and pays, else a keyframe;
3. write (``files.DataFileWriter``): the data files, under names unique to this writer;
4. commit (``commit.commit_manifest``): the put-if-absent of the manifest; the stream itself is created
   (``commit.LazyStream``) just before its first commit.

Stages 2-4 run on a background thread, at most ``max_in_flight`` versions at a time, in version order;
each version's future resolves when it is committed. How the processes writing a version agree on its
kind and who commits it is a ``Coordinator``: ``LocalCoordinator`` for one process, the two-phase
coordinator of :mod:`ckptstream.writer.distributed` for the ranks of a job.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol

import torch

from .. import __version__, codec
from ..errors import CkptStreamError, PublishError, VersionOrderError
from ..format import DELTA, KEYFRAME, FileEntry, Manifest, TensorEntry, dumps_json, join_pieces, manifest_format_version
from ..parallel import default_workers, one_cpu_thread_each
from ..reader import Stream
from ..reader.adapter import check_adapter_tensors
from .adapter import AdapterSource, adapter_source
from .base import BaseLookup
from .commit import LazyStream, commit_manifest, load_assets, new_writer_id, utc_now, write_latest_hint
from .config import PublisherConfig
from .device_encode import DeviceCapture, DeviceDeltaEncoder, DeviceSnapshot, LandedVersion
from .encode import BaseVersion, DeltaEncoder, EncodedVersion, VersionEncoder
from .files import DataFileWriter
from .heap import HeapFreeze
from .pieces import PieceOf, as_piece_entries, local_pieces, same_layout
from .snapshot import NamedTensors, SnapshotBuffers

log = logging.getLogger("ckptstream.publish")

CommitFn = Callable[[list[FileEntry], list[TensorEntry]], Manifest]
"""Builds the manifest of a version from its files and tensors, creates the stream if it is new, and
commits the manifest; returns it."""


@dataclass
class Part:
    """What one process wrote of a version: its files and tensor entries, or why it could not."""

    files: list[FileEntry]
    tensors: list[TensorEntry]
    failure: BaseException | None = None


class Coordinator(Protocol):
    """How the processes writing a version agree on it and commit it.

    Attributes:
        commits: whether this process commits versions (and creates the stream).
        looks_up_base: whether a fresh publisher may take the stream's latest version as its delta base.
    """

    commits: bool
    looks_up_base: bool

    def agree_kind(self, version: int, kind: str, failure: BaseException | None) -> str | None:
        """The kind of ``version`` (``KEYFRAME`` or ``DELTA``) every process writes, given this process's
        choice (``failure`` if it could not encode); None: the version fails, write nothing."""
        ...

    def commit(self, version: int, part: Part, commit: CommitFn, discard: Callable[[], None]) -> Manifest:
        """The committed manifest of ``version``, of which this process wrote ``part``; raises if it was
        not committed (``discard`` removes this process's files where they are no use)."""
        ...

    def abandon(self, version: int | None, failure: BaseException) -> None:
        """``publish`` failed before this process's part was queued (``version`` as requested)."""
        ...


class LocalCoordinator:
    """One process writes and commits every version."""

    commits = True
    looks_up_base = True

    def agree_kind(self, version: int, kind: str, failure: BaseException | None) -> str | None:
        if failure is not None:
            raise failure
        return kind

    def commit(self, version: int, part: Part, commit: CommitFn, discard: Callable[[], None]) -> Manifest:
        if part.failure is not None:
            raise part.failure
        return commit(part.files, part.tensors)

    def abandon(self, version: int | None, failure: BaseException) -> None:
        pass  # nobody else waits for this version


@dataclass
class _Job:
    version: int
    tensors: list[tuple[str, torch.Tensor]]  # host snapshot, owned by the publisher
    step: int | None
    metadata: dict[str, Any]
    keyframe: bool
    previous_version: int | None  # the publisher's last version before this one was numbered
    future: Future[Manifest] = field(default_factory=Future)
    capture: DeviceCapture | None = None  # the device snapshot (then ``tensors`` are filled when it lands)
    pieces: dict[str, PieceOf] = field(default_factory=dict)  # the tensors written as pieces of a whole


@dataclass(frozen=True)
class Publication:
    """A version on its way (:meth:`Publisher.stage`): its number and the two stages a trainer waits on."""

    version: int
    staged: Future[None]
    """Resolves when the snapshot is taken: from then on the caller may change the tensors."""
    committed: Future[Manifest]
    """Resolves to the committed manifest, or raises why the version was not committed."""


class Publisher:
    """Publishes versions of model weights to the stream at ``url``.

    Args:
        url: stream location: a local/NFS path, ``file://``, ``s3://bucket/prefix`` or any fsspec URL.
        config: every option in one object (:class:`PublisherConfig`); default the defaults.
        coordinator: how the processes writing a version agree on it (default: this process alone).
        adapter_of: publish an adapter stream (FORMAT.md, "Adapter streams") of this ``peft.PeftModel``'s
            LoRA adapter (or of an ``AdapterSource`` of :mod:`ckptstream.writer.adapter`, e.g. to name the
            adapter or the base model's directory): each ``publish()`` snapshots only the adapter's tensors,
            the stream's one asset is its ``adapter_config.json``, and ``stream.json`` names the base model
            (and its ``base_model_hash`` where the base is a local directory). Leave ``assets`` out.
        **options: fields of :class:`PublisherConfig` (``storage_options``, ``assets``,
            ``keyframe_every``, ``delta_max_ratio``, ``shard_bytes``, ``chunk_bytes``, ``zstd_level``,
            ``shuffle``, ``max_in_flight``, ``workers``, ``base_cache_dir``, ``device_delta``, ``freeze_gc``), replacing
            ``config``'s.

    CUDA tensors are encoded on their device (``device_delta``, on by default for them): the publisher
    then holds a copy of the last version on the device (``device_memory_bytes``, with its scratch within
    1x the model's bytes: ``device_encode.HOST_COMPARED_RATIO``)
    and a pinned block of at most 10 % of them (``pinned_memory_bytes``); ``device_delta=False`` keeps the host path.

    The stream is created (its assets, then ``stream.json``) just before the first version is committed,
    or when a publisher that published nothing is closed; an existing stream's assets are checked at once.

    Example::

        with Publisher("s3://bucket/run1", assets="path/to/hf_model") as pub:
            for step in range(steps):
                train_step()
                pub.publish(model.state_dict(), step=step)   # returns once the snapshot is taken

        with Publisher("s3://bucket/lora1", adapter_of=peft_model) as pub:   # a LoRA adapter's stream
            for step in range(steps):
                train_step()
                pub.publish(step=step)                        # the adapter's tensors only
    """

    def __init__(self, url: str, config: PublisherConfig | None = None, *, coordinator: Coordinator | None = None,
                 adapter_of: Any = None, **options: Any):
        self.config = config = PublisherConfig.of(config, options)
        self.adapter: AdapterSource | None = None if adapter_of is None else adapter_source(adapter_of)
        """What an adapter stream's publisher publishes (None: a model's weights)."""
        if self.adapter is not None and config.assets is not None:
            raise ValueError("an adapter stream's one asset is its adapter_config.json: leave assets out")
        self.stream = Stream(url, storage_options=config.storage_options)
        self.storage = self.stream.storage
        self.writer_id = new_writer_id()
        self._coordinator: Coordinator = coordinator if coordinator is not None else LocalCoordinator()
        self._stream_file = LazyStream(self.storage, load_assets(config.assets) if self.adapter is None
                                       else self.adapter.assets, None if self.adapter is None else self.adapter.info)
        self._bases = BaseLookup(self.stream if self._coordinator.looks_up_base else None,
                                 config.base_cache_dir if self._coordinator.looks_up_base else None)
        self._snapshots = SnapshotBuffers()
        self._device = DeviceSnapshot()
        self._heap = HeapFreeze()
        self.phase_seconds: dict[str, float] = {}
        """Where the background time of the last committed version went, in seconds per phase (``land``:
        the device encoder's capture reaching the host and handed to the threads, which apply it to the
        host mirror tensor by tensor while ``encode`` runs; ``encode``: the delta or keyframe encoded;
        ``hash``: waiting for the tensors' hashes after that; ``write``: its files; ``commit``: the rest)."""
        self._pool = ThreadPoolExecutor(config.workers or default_workers(), thread_name_prefix="ckptstream-encode",
                                        initializer=one_cpu_thread_each)
        host_delta = DeltaEncoder(self._pool, chunk_bytes=config.chunk_bytes, zstd_level=config.zstd_level,
                                  shuffle=config.shuffle, max_ratio=config.delta_max_ratio)
        self._encoder = VersionEncoder(host_delta, keyframe_every=config.keyframe_every)
        self._device_delta = DeviceDeltaEncoder(self._device, host_delta)
        self._device_encoder = VersionEncoder(self._device_delta,
                                              keyframe_every=config.keyframe_every)
        self._files = DataFileWriter(self.storage, self.writer_id, config.shard_bytes)
        self._slots = threading.BoundedSemaphore(config.max_in_flight)
        self._stager = ThreadPoolExecutor(1, thread_name_prefix="ckptstream-stage")
        self._committer = ThreadPoolExecutor(1, thread_name_prefix="ckptstream-commit")
        self._lock = threading.Lock()
        self._error: CkptStreamError | None = None
        self._last_version: int | None = None
        self._published = False  # whether publish was ever called
        self._closed = False

    # ------------------------------------------------------------------------------------ public API

    def publish(self, named_tensors: NamedTensors | None = None, version: int | None = None, *,
                step: int | None = None, metadata: Mapping[str, Any] | None = None,
                keyframe: bool = False) -> Future[Manifest]:
        """Snapshot the tensors and publish them as a new version in the background.

        Args:
            named_tensors: a state dict or (name, tensor) pairs under the names the receiver loads
                (Hugging Face names for vLLM); any device, contiguous or not. With ``adapter_of``, default
                the adapter's tensors (``peft.get_peft_model_state_dict``); any given instead must keep the
                stream's rank and target modules. A DTensor (a sharded model's parameter) is written as
                this process's piece of the whole tensor (FORMAT.md, "Tensors in pieces"; see
                ``DistributedPublisher.publish_sharded``), or not at all where another process writes it.
            version: the version number; default the latest version + 1 (0 for a new stream). Must be
                greater than every version already in the stream.
            step: the training step, recorded in the manifest.
            metadata: strict-JSON data recorded in the manifest (no NaN or Infinity, bounded nesting).
            keyframe: force a keyframe.

        Returns:
            A future resolving to the committed ``Manifest`` (or raising the failure). ``publish`` returns
            as soon as the snapshot is taken (CUDA tensors: their changes found on the device, see
            ``device_delta``), so the caller may modify them right away.

        Raises:
            VersionOrderError: ``version`` is not newer than the latest version.
            ValueError / TypeError: an invalid tensor name, tensor, step or metadata, or no tensors;
                nothing is published.
            AdapterMismatchError: (``adapter_of``) tensors of another rank or module than the stream's.
            PublishError (or the original CkptStreamError): an earlier background publish failed.
        """
        self._check_tensors_given(named_tensors)
        job = self._start(version, step, metadata, keyframe)
        self._stager.submit(lambda: None).result()  # versions staged before this one go first
        self._snapshot(job, named_tensors)
        return job.future

    def stage(self, named_tensors: NamedTensors | None = None, version: int | None = None, *,
              step: int | None = None, metadata: Mapping[str, Any] | None = None,
              keyframe: bool = False) -> Publication:
        """Like :meth:`publish`, but the snapshot too runs in the background: returns at once.

        The caller must not change the tensors (nor, for a generator, what it yields) until
        ``Publication.staged`` resolves (beyond ``max_in_flight`` versions, a snapshot waits for an earlier
        version's commit); ``Publication.committed`` resolves when the version is committed.
        Versions are snapshotted and committed in the order they were staged. Arguments and the errors
        raised at once are those of :meth:`publish`; a snapshot failure is raised by both futures.
        """
        self._check_tensors_given(named_tensors)
        job = self._start(version, step, metadata, keyframe)
        staged = self._stager.submit(self._snapshot, job, named_tensors)
        return Publication(job.version, staged, job.future)

    @property
    def device_memory_bytes(self) -> int:
        """Device memory the publisher holds: the device encoder's copy of the last version (0 on the host
        path). While ``publish`` runs, the scratch of one span adds to it (the payload goes to pinned memory)."""
        return self._device.device_memory_bytes

    @property
    def pinned_memory_bytes(self) -> int:
        """Pinned host memory of the device encoder (its block: payload staging and ring); the host path pins
        its snapshot buffers."""
        return self._device.pinned_bytes

    def wait(self) -> None:
        """Block until every version published so far is committed; raise the first failure, if any."""
        self._stager.submit(lambda: None).result()
        self._committer.submit(lambda: None).result()
        self._raise_failure()

    def close(self, *, create_stream: bool = True) -> None:
        """Wait for pending versions, then release threads and buffers.

        Args:
            create_stream: create the stream (its assets) if this publisher never published and it does
                not exist yet, so that ``Publisher(url, assets=...).close()`` prepares a stream.
        """
        if self._closed:
            return
        try:
            self.wait()
            if create_stream and not self._published and self._coordinator.commits:
                self._stream_file.info()
        finally:
            self._closed = True
            self._stager.shutdown(wait=True)
            self._committer.shutdown(wait=True)
            self._pool.shutdown(wait=True)
            self._bases.forget()
            self._snapshots.clear()
            self._device.clear()
            self._heap.release()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.close(create_stream=exc_type is None)

    # ------------------------------------------------------------------------------------ front half

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("publisher is closed")

    def _start(self, version: int | None, step: int | None, metadata: Mapping[str, Any] | None,
               keyframe: bool) -> _Job:
        """Check the arguments and number the version."""
        self._check_open()
        self._raise_failure()
        self._published = True
        try:
            checked = _checked_metadata(metadata, step)
            with self._lock:
                previous = self._last_version
                number = self._next_version(version)
                self._last_version = number
        except Exception as exc:
            # Whoever else writes parts of this version must hear that this part will not come.
            self._committer.submit(self._coordinator.abandon, version, exc)
            raise
        return _Job(number, [], step, checked, keyframe, previous_version=previous)

    def _check_tensors_given(self, named_tensors: NamedTensors | None) -> None:
        if named_tensors is None and self.adapter is None:
            raise TypeError("publish() needs the tensors to publish (a state dict or (name, tensor) pairs)")

    def _snapshot(self, job: _Job, named_tensors: NamedTensors | None) -> None:
        """Take an in-flight slot and the snapshot of ``job``, then queue the rest of it; a failure gives the
        version up."""
        self._slots.acquire()
        try:
            if self.adapter is not None:
                named_tensors = self._adapter_tensors(job.version, named_tensors)
            assert named_tensors is not None
            items = local_pieces(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors,
                                 job.pieces)
            first = next(items, None)
            items = itertools.chain([] if first is None else [first], items)
            on_device = self.config.device_delta
            if on_device is None:
                on_device = first is not None and isinstance(first[1], torch.Tensor) and first[1].is_cuda
            if self.config.freeze_gc or (self.config.freeze_gc is None and on_device):
                self._heap.hold()
                if self._closed:  # closed meanwhile: its release has run
                    self._heap.release()
            if on_device:
                self._snapshots.clear()
                job.capture = self._device.take(items, job.version, job.pieces)  # (filled as items are listed)
            else:
                self._device.reset()
                job.tensors = self._snapshots.take(items)
        except BaseException as exc:
            self._slots.release()
            with self._lock:
                if self._last_version == job.version:  # nothing newer numbered: the number is free again
                    self._last_version = job.previous_version
            self._committer.submit(self._coordinator.abandon, job.version, exc)
            job.future.set_exception(exc)
            raise
        self._committer.submit(self._run, job)

    def _adapter_tensors(self, version: int, named_tensors: NamedTensors | None) -> list[tuple[str, torch.Tensor]]:
        """The adapter's tensors (``named_tensors``, default the source's), checked against the stream's
        adapter block."""
        assert self.adapter is not None
        given = self.adapter.read() if named_tensors is None else named_tensors
        items = list(given.items() if isinstance(given, Mapping) else given)
        check_adapter_tensors(self.adapter.info, ((n, tuple(getattr(t, "shape", ()))) for n, t in items),
                              version=version)
        return items

    def _raise_failure(self) -> None:
        with self._lock:
            error, self._error = self._error, None
            if error is not None:
                # Start over from what the stream holds: the next version is numbered from the stream.
                self._last_version = None
                self._bases.forget()
                self._device.reset()
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

    # ------------------------------------------------------------------------------------- back half

    def _run(self, job: _Job) -> None:
        try:
            with self._lock:
                failed = self._error is not None
            if failed:
                raise PublishError("not published because an earlier version failed", version=job.version)
            manifest = self._write(job)
            replaced = self._bases.promote(manifest, job.tensors)
            if job.capture is None:  # the device encoder's mirror is its own, updated in place
                self._snapshots.retire(replaced)
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
            if job.capture is not None:
                self._device.abandon(job.capture)  # where it never landed
            self._slots.release()

    def _write(self, job: _Job) -> Manifest:
        """Encode, write and commit one version (on the background thread)."""
        encoder = self._encoder
        encoded: EncodedVersion | None = None
        failure: BaseException | None = None
        phases: dict[str, float] = {}
        clock = [time.perf_counter()]

        def phase(name: str) -> None:
            now = time.perf_counter()
            phases[name] = phases.get(name, 0.0) + now - clock[0]
            clock[0] = now

        base = _same_layout_base(self._bases.current(job.version), job.pieces)
        hashes: list[Future[str]] = []  # on the host path
        landed: LandedVersion | None = None
        if job.capture is not None:
            encoder = self._device_encoder
            # the delta's sparse sections are built as each tensor lands, where a delta will be tried
            prepare = self._device_delta.prepare if encoder.allows_delta(base, force_keyframe=job.keyframe) else None
            try:
                landed = self._device.land(job.capture, self._pool, prepare)
                job.tensors = landed.mirror
            except Exception as exc:  # noqa: BLE001 - the coordinator reports it (to every rank)
                failure = exc
            phase("land")
        else:
            hashes = [self._pool.submit(codec.tensor_hash, t) for _, t in job.tensors]
        try:
            if failure is None:
                encoded = encoder.try_delta(job.tensors, base, force_keyframe=job.keyframe, pieces=job.pieces)
        except Exception as exc:  # noqa: BLE001 - the coordinator reports it (to every rank)
            failure = exc
        kind = self._coordinator.agree_kind(job.version, KEYFRAME if encoded is None else DELTA, failure)
        part = Part([], [], failure)
        base_manifest = None
        if kind is not None and failure is None:
            try:
                if kind == KEYFRAME or encoded is None:  # the others may need a keyframe where this part was a delta
                    if landed is not None:
                        landed.wait()
                    encoded = encoder.keyframe(job.tensors)
                base_manifest = encoded.base
                phase("encode")
                digests = landed.hashes() if landed is not None else [h.result() for h in hashes]
                phase("hash")
                part.files, tensors = self._files.write(job.version, encoded, digests)
                part.tensors = as_piece_entries(tensors, job.pieces)
                phase("write")
            except Exception as exc:  # noqa: BLE001 - the coordinator reports it (to every rank)
                part.failure = exc
        manifest = self._coordinator.commit(
            job.version, part, lambda files, tensors: self._commit(job, base_manifest, files, tensors),
            lambda: self._files.remove(job.version, part.files))
        phase("commit")
        self.phase_seconds = phases
        return manifest

    def _commit(self, job: _Job, base: Manifest | None, files: list[FileEntry],
                tensors: list[TensorEntry]) -> Manifest:
        """The manifest of every part's files and tensors — a keyframe, or a delta on ``base`` — committed
        (the stream is created first if it is new)."""
        if not tensors:
            raise PublishError("a version needs at least one tensor; nothing was published", version=job.version,
                               hint="Pass the model's tensors to publish()")
        try:
            tensors = join_pieces(tensors)
        except ValueError as exc:
            raise PublishError(f"the version's tensors do not fit together: {exc}", version=job.version,
                               hint="Every process must publish the same model's shards, each its own") from None
        info = self._stream_file.info()
        manifest = Manifest(
            version=job.version, kind=KEYFRAME if base is None else DELTA,
            base_version=None if base is None else base.version,
            keyframe_version=job.version if base is None else base.keyframe_version,
            chain_length=0 if base is None else base.chain_length + 1, stream_id=info.stream_id,
            created=utc_now(), files=tuple(files), tensors=tuple(tensors), step=job.step, metadata=job.metadata,
            writer={"id": self.writer_id, "host": socket.gethostname(), "pid": os.getpid(),
                    "library": f"ckptstream {__version__}"}, format_version=manifest_format_version(tensors))
        commit_manifest(self.storage, manifest)
        write_latest_hint(self.storage, manifest.version)
        return manifest


def _same_layout_base(base: BaseVersion | None, pieces: dict[str, PieceOf]) -> BaseVersion | None:
    """``base`` without the tensors that a delta cannot apply to now: stored whole where the tensor is a piece
    now or the other way round, or as pieces of other boxes (FORMAT.md, "Tensors in pieces")."""
    if base is None:
        return None
    entries = base.manifest.tensor_map()
    kept = {name: t for name, t in base.tensors.items() if same_layout(entries.get(name), pieces.get(name))}
    return base if len(kept) == len(base.tensors) else BaseVersion(base.manifest, kept)


def _checked_metadata(metadata: Mapping[str, Any] | None, step: int | None) -> dict[str, Any]:
    """A copy of ``metadata`` that the manifest can hold (strict JSON: ValueError for NaN, Infinity or
    nesting too deep; TypeError for what JSON cannot hold), checked now rather than in the background."""
    if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
        raise TypeError(f"step must be an int or None, not {type(step).__name__}")
    metadata = dict(metadata or {})
    # The manifest nests metadata one level down; the format bounds the depth of the whole document.
    dumps_json({"metadata": metadata}, what="metadata", indent=None)
    return metadata
