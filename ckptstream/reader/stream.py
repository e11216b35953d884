"""``Stream``: discovering, reading, verifying, diffing and materializing the versions of a stream."""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Generator, Iterable, Iterator, Mapping, TypeVar

import torch

from ..codec import INT_OF_SIZE
from ..errors import (IntegrityError, InvalidVersionError, MissingBaseError, ReplicaRefused, StreamNotFoundError,
                      TensorNotFoundError, VersionNotFoundError)
from ..format import (ADAPTER_WEIGHTS_FILE, DEFAULT_SHARD_BYTES, ENCODING_RAW, ENCODING_ZSTD, LATEST, MANIFESTS_DIR,
                      MAX_MANIFEST_BYTES, MAX_STREAM_FILE_BYTES, MAX_VERSION, STREAM_FILE, STREAM_KIND_ADAPTER,
                      FileEntry, Manifest,
                      StreamInfo, TensorEntry, asset_path, content_hash, manifest_path, parse_version_name)
from ..parallel import default_workers, ordered_parallel
from ..storage import MAX_CONCURRENT_READS, Storage, open_storage
from ..storage.kept import KeptReads
from ..storage.readahead import ChunkedReads
from ..storage.timing import TimedReads
from .adapter import check_adapter_tensors, kind_error
from .decode import (BufferPool, Writer, changes_of_sparse, changes_since, decode_order, decode_tensor,
                     decode_tensor_to, load_checked, plan_tensor, sparse_delta)
from .files import DataFiles
from .leases import DEFAULT_LEASE_TTL, check_lease_ttl, hold_lease
from .materialize import MaterializedBase, build_directory, write_directory
from .probe import probe_versions
from .replicas import KIND_FOLLOWER, NOT_SERVING_STATES, ReplicaRecord, read_replicas

DEFAULT_INFLIGHT_BYTES = 1 << 30
CHANGES_BATCH_BYTES = 2 << 20
"""Stored bytes of sparse deltas of consecutive tensors whose changes are read as one batch
(``decode.changes_of_sparse``): enough tensors (a few hundred experts' at 1 % changed) to make the per-tensor
cost vanish, batches enough for every reading thread."""
MANIFEST_CACHE_SIZE = 64
"""Parsed manifests a ``Stream`` keeps (least recently used go first): long-lived followers and
publishers of streams with thousands of versions hold a bounded number."""

Progress = Callable[[int], None]
R = TypeVar("R")


@dataclass(frozen=True)
class VerifyReport:
    """What ``Stream.verify`` checked for one version."""

    version: int
    files: int
    tensors: int
    stored_bytes: int
    decoded_bytes: int


@dataclass(frozen=True)
class TensorDiff:
    """How one tensor differs between two versions."""

    name: str
    status: str  # "same", "changed", "added", "removed", "retyped"
    numel: int
    changed: int
    max_abs_diff: float | None


class Stream:
    """Read access to a ckptstream stream at a URL (local path, ``file://``, ``s3://``, any fsspec URL).

    Example::

        stream = Stream("s3://bucket/run1")
        v = stream.latest()
        for name, tensor in stream.iter_tensors(v):
            ...
        stream.materialize(v, "/dev/shm/model")   # a directory vLLM can serve

    Pulling a version (``materialize``, ``write_into``, ``verify``, or a caller's own pull inside
    ``with stream.lease(v, holder=...)``) holds a lease on it, so that gc keeps it meanwhile; ``lease_ttl``
    is its time to live, renewed every third of it (FORMAT.md, "Leases").
    """

    def __init__(self, url: str, *, storage_options: Mapping[str, Any] | None = None,
                 storage: Storage | None = None, lease_ttl: float = DEFAULT_LEASE_TTL):
        self.lease_ttl = check_lease_ttl(lease_ttl)
        self.url = url
        # Every read is measured right over the backend: what ``bytes_read`` says was read from storage.
        self.storage = self.meter = TimedReads(storage or open_storage(url, storage_options))
        self._info: StreamInfo | None = None
        self._manifests: collections.OrderedDict[int, Manifest] = collections.OrderedDict()
        self._lock = threading.Lock()
        # Object stores serve a tensor's range per request: aligned chunks fetched concurrently instead.
        self._chunked = (ChunkedReads(self.storage)
                         if self.storage.capabilities.ranged_reads and not self.storage.is_posix else None)
        self._kept = KeptReads(self._chunked or self.storage)
        self._files = DataFiles(self._kept)

    def bytes_read(self) -> int:
        """Bytes read from the stream's storage through this ``Stream`` so far (manifests, data files, assets:
        every read, measured where it happens, ``storage.timing.TimedReads``); the difference across a pull
        is what it read."""
        return self.meter.bytes_read()

    def keeping_reads(self, max_bytes: int) -> contextlib.AbstractContextManager[None]:
        """Inside the block, the data-file ranges read (at most ``max_bytes`` together) are kept in memory
        after it, each until it has served as many bytes as it holds (``storage.kept.KeptReads``): a version decoded
        after its change was built from its deltas (``changes_since``) reads those deltas from memory.
        ``drop_kept_reads()`` frees what is left."""
        return self._kept.keeping(max_bytes)

    def drop_kept_reads(self) -> None:
        """Free the ranges kept by ``keeping_reads`` that were not read again."""
        self._kept.clear()

    # ---------------------------------------------------------------------------------------- discovery

    def exists(self) -> bool:
        """True if the stream has been created (its ``stream.json`` exists)."""
        return self.storage.exists(STREAM_FILE)

    def info(self) -> StreamInfo:
        """The stream's metadata (identity, format version, asset files)."""
        if self._info is None:
            try:
                raw = self.storage.read_small(STREAM_FILE, MAX_STREAM_FILE_BYTES)
            except FileNotFoundError:
                raise StreamNotFoundError(f"no stream at {self.url} ({STREAM_FILE} is missing)",
                                          hint="Check the URL, or publish a first version to create it") from None
            self._info = StreamInfo.from_bytes(raw)
        return self._info

    def require_kind(self, kind: str) -> None:
        """Refuse a stream of another kind than ``kind`` (``format.STREAM_KIND_WEIGHTS`` or
        ``STREAM_KIND_ADAPTER``), before anything of it is pulled.

        Raises:
            StreamKindError: naming the stream, the kind it is, the kind expected and the next step.
            StreamNotFoundError: there is no stream at the URL.
        """
        found = self.info().kind
        if found != kind:
            raise kind_error(self.url, kind=found, expected=kind)

    def versions(self) -> list[int]:
        """Committed versions, oldest first: one listing of the manifests directory, or, on storage that
        cannot list (HTTP), probes of manifest names around the latest-version hint (``probe.py``: the
        versions near the newest, not ones far apart from them)."""
        if not self.storage.capabilities.listing:
            return probe_versions(self.storage)
        found = []
        for entry in self.storage.list(MANIFESTS_DIR):
            version = parse_version_name(entry.name)
            if version is not None and not entry.is_dir and entry.name.endswith(".json"):
                found.append(version)
        return sorted(found)

    def latest(self) -> int | None:
        """The newest committed version, or None if there is none."""
        versions = self.versions() if self.storage.capabilities.listing else probe_versions(self.storage,
                                                                                             newest_only=True)
        return versions[-1] if versions else None

    def has_version(self, version: int) -> bool:
        """Whether ``version`` is committed: one cheap probe of its manifest, no listing."""
        return self.storage.exists(manifest_path(_checked_version(version)))

    def resolve(self, version: int | str) -> int:
        """A version number from an int, a string of decimal digits or ``"latest"``.

        Raises:
            InvalidVersionError: (a ValueError) anything else, or a number outside ``[0, MAX_VERSION]``.
            VersionNotFoundError: ``"latest"`` of a stream without versions.
        """
        if version == LATEST:
            latest = self.latest()
            if latest is None:
                self.info()  # a clearer error if the stream itself is missing
                raise VersionNotFoundError(f"stream {self.url} has no versions yet")
            return latest
        if isinstance(version, str) and version.isascii() and version.isdigit():
            version = int(version)
        if not isinstance(version, int) or isinstance(version, bool):
            raise InvalidVersionError(f"not a version: {version!r}",
                                      hint=f"Give a version number or 'latest'; `ckptstream ls {self.url}` "
                                           "lists the committed versions")
        return _checked_version(version)

    def manifest(self, version: int) -> Manifest:
        """The validated manifest of a committed version (VersionNotFoundError if none)."""
        _checked_version(version)
        with self._lock:
            cached = self._manifests.get(version)
            if cached is not None:
                self._manifests.move_to_end(version)
                return cached
        try:
            raw = self.storage.read_small(manifest_path(version), MAX_MANIFEST_BYTES)
        except FileNotFoundError:
            raise VersionNotFoundError("no such version in the stream", version=version,
                                       hint=f"`ckptstream ls {self.url}` lists the committed versions") from None
        manifest = Manifest.from_bytes(raw, version=version, stream_id=self.info().stream_id)
        with self._lock:
            self._manifests[version] = manifest
            while len(self._manifests) > MANIFEST_CACHE_SIZE:
                self._manifests.popitem(last=False)
        return manifest

    def _base_manifest(self, version: int) -> Manifest:
        try:
            return self.manifest(version)
        except VersionNotFoundError:
            raise MissingBaseError("this base of a delta is gone from storage", version=version,
                                   hint="It was garbage-collected or never committed; "
                                        "decode from a newer keyframe instead") from None

    def chain(self, version: int) -> list[Manifest]:
        """Manifests from the nearest keyframe up to ``version``, oldest first.

        Raises:
            MissingBaseError: a base in the chain is gone.
            IntegrityError: a delta's ``keyframe_version`` differs from its base's, or its ``chain_length``
                is not its base's plus one (FORMAT.md, "Reader obligations"), naming the delta.
        """
        chain = [self.manifest(version)]
        while chain[-1].base_version is not None:
            base = self._base_manifest(chain[-1].base_version)
            check_base(chain[-1], base)
            chain.append(base)
        return list(reversed(chain))

    # ------------------------------------------------------------------------------------------ leases

    @contextlib.contextmanager
    def lease(self, version: int, *, holder: str) -> Iterator[list[Manifest]]:
        """Hold a lease on ``version`` while the block pulls it; yields its checked chain (keyframe first).

        The reader's side of FORMAT.md's "Leases": the lease is written first, then the manifest of the
        version and of every base of its chain is checked to exist, asked of the storage after the write;
        a missing one means gc retired it (the lease is released and the error raised). The lease is
        renewed every ``lease_ttl / 3`` while the block runs, and deleted when it exits, also on error. On
        read-only storage (an HTTP stream) no lease is taken: the chain is still checked.

        Raises:
            StreamNotFoundError: there is no stream at the URL (nothing is written).
            VersionNotFoundError: ``version`` is not (or no longer) committed.
            MissingBaseError: a base of its chain is gone.
        """
        self.info()  # no lease (nor a leases/ directory) in a stream that does not exist
        with self._lock:
            cached = set(self._manifests)  # read before the lease exists: to be asked of the storage again
        with hold_lease(self.storage, version, holder=holder, ttl=self.lease_ttl) as held:
            if held is not None:
                self._check_still_committed(version, cached)
            yield self.chain(version)

    def _check_still_committed(self, version: int, cached: set[int]) -> None:
        """Check that the manifest of ``version`` and of each base of its chain exists now, newest first:
        those in ``cached`` (read before the lease was written, maybe before a gc retired them) are probed,
        the others are read now."""
        v: int | None = version
        while v is not None:
            try:
                if v in cached and not self.storage.exists(manifest_path(v)):
                    with self._lock:
                        self._manifests.pop(v, None)
                    raise VersionNotFoundError("the version was garbage-collected", version=v)
                v = self.manifest(v).base_version
            except VersionNotFoundError:
                if v == version:
                    raise VersionNotFoundError("no such version in the stream (or it was garbage-collected)",
                                               version=v, hint=f"`ckptstream ls {self.url}` lists the committed "
                                                               "versions") from None
                raise MissingBaseError("this base of a delta is gone from storage (garbage-collected)", version=v,
                                       hint="Decode a newer version instead") from None

    # ---------------------------------------------------------------------------------------- replicas

    def replicas(self) -> list[ReplicaRecord]:
        """The records followers keep in the stream: version served, state, last error, heartbeat."""
        return read_replicas(self.storage)

    def wait_for_version(self, version: int, *, min_replicas: int = 1, timeout: float | None = None,
                         max_heartbeat_age: float = 60.0, poll_interval: float = 1.0,
                         resident: bool = False) -> list[ReplicaRecord]:
        """Block until at least ``min_replicas`` live replicas serve ``version`` or newer.

        On an adapter stream (LoRA) a replica serves ``version`` or newer when its stable adapter name means
        that version or a newer one; with ``resident``, only when it holds ``version`` itself (``<name>@<version>``
        answers: the record's ``resident``), for a client that asks for that exact version.

        A trainer calls this to bound rollout staleness. Replicas whose heartbeat is older than
        ``max_heartbeat_age`` seconds count as dead, and so do stopped ones and those standing aside
        while another process (a replay) drives their servers. Mirrors' records are not replicas, nor
        are node agents' (kind ``node``): an engine spanning nodes is one replica, its head's record,
        whose version every rank serves (the head reloads only once all its nodes hold the version).

        Returns:
            The live replicas at ``version`` or newer.

        Raises:
            ReplicaRefused: too few replicas can ever serve ``version``: every live one that does not is
                pinned to an older version or refused this one (each named with its reason), and
                there are not enough others.
            TimeoutError: not enough replicas caught up within ``timeout`` seconds.
            StreamKindError: ``resident`` on a weights stream.
        """
        if resident:
            self.require_kind(STREAM_KIND_ADAPTER)  # a weights stream's replicas hold no adapter versions
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            now = time.time()
            live = [r for r in self.replicas() if r.kind == KIND_FOLLOWER and r.age(now) <= max_heartbeat_age
                    and r.state not in NOT_SERVING_STATES]
            ready = [r for r in live if (version in r.resident if resident else
                                          r.version is not None and r.version >= version)]
            if len(ready) >= min_replicas:
                return ready
            declined = {r.replica_id: reason for r in live if r not in ready
                        for reason in [_declines(r, version, resident)] if reason is not None}
            if declined and len(live) - len(declined) < min_replicas:
                raise ReplicaRefused(
                    f"{len(ready)} of the {min_replicas} replicas needed serve it and no more can: "
                    + "; ".join(f"{rid} {why}" for rid, why in declined.items()), version=version,
                    reasons=declined, hint="Unpin those replicas, or publish a version they accept")
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"{len(ready)} of the {min_replicas} replicas needed serve version {version} "
                                   f"or newer after {timeout} s")
            time.sleep(poll_interval)

    # -------------------------------------------------------------------------------------------- data

    def iter_tensors(self, version: int, *, base_dir: str | os.PathLike[str] | None = None,
                     names: Iterable[str] | None = None, workers: int | None = None,
                     max_inflight_bytes: int = DEFAULT_INFLIGHT_BYTES) -> Iterator[tuple[str, torch.Tensor]]:
        """Decode the tensors of ``version`` in manifest order, every hash checked.

        Tensors decode in parallel threads; at most ``max_inflight_bytes`` of decoded tensors are held
        (at least one tensor). With ``base_dir`` (a directory materialized from a version of this
        stream's delta chain), deltas are applied to it instead of decoding from the keyframe.
        """
        target = self.manifest(version)
        entries = target.tensors
        if names is not None:
            wanted = set(names)
            entries = tuple(t for t in entries if t.name in wanted)
            missing = sorted(wanted - {t.name for t in entries})
            if missing:
                raise TensorNotFoundError(f"this version has no tensor(s) {missing[:10]}", version=version,
                                          tensor=missing[0], hint=f"`ckptstream show {self.url} {version}` "
                                                                  "lists its tensors")
        yield from self._decode(target, entries, base_dir, lambda entry, tensor: (entry.name, tensor),
                                workers=workers, max_inflight_bytes=max_inflight_bytes)

    def _decode(self, target: Manifest, entries: Iterable[TensorEntry], base_dir: str | os.PathLike[str] | None,
                sink: Callable[[TensorEntry, torch.Tensor], R] | None, *, write: Writer | None = None,
                workers: int | None = None, max_inflight_bytes: int = DEFAULT_INFLIGHT_BYTES) -> Iterator[R | int]:
        """``sink(entry, tensor)`` for each decoded tensor, run on the decoding threads, results in order; or,
        without a sink, each tensor's bytes handed to ``write`` (``decode_tensor_to``), as planned by
        ``plan_tensor``, their byte counts in no particular order, the decode buffers reused from tensor to
        tensor."""
        # The chain is checked now (naming a missing base) and held for every tensor's walk down it, so
        # that a chain longer than the manifest cache is not read again per tensor.
        chain = {m.version: m for m in self.chain(target.version)}
        base = MaterializedBase(base_dir, self.info().stream_id) if base_dir is not None else None
        if workers is None and not self.storage.is_posix:
            # Each thread mostly waits for its ranged reads: enough of them to keep an object store's link
            # full (memory stays bounded by max_inflight_bytes).
            workers = max(default_workers(), MAX_CONCURRENT_READS)
        try:
            if write is not None:
                pool = BufferPool(max_inflight_bytes)
                plans = sorted((plan_tensor(self._files, chain.__getitem__, target, e, base) for e in entries),
                               key=decode_order)
                yield from ordered_parallel(
                    plans, lambda plan: decode_tensor_to(self._files, chain.__getitem__, target, plan, write, base,
                                                         pool),
                    lambda plan: plan.memory_bytes, max_cost=max_inflight_bytes, workers=workers)
            else:
                assert sink is not None
                yield from ordered_parallel(
                    entries, lambda e: sink(e, decode_tensor(self._files, chain.__getitem__, target, e, base)),
                    lambda e: e.nbytes, max_cost=max_inflight_bytes, workers=workers)
        finally:
            if base is not None:
                base.close()
            if self._chunked is not None:
                self._chunked.clear()

    def changes_since(self, version: int, base: int,
                      sink: Callable[[TensorEntry, torch.Tensor, torch.Tensor], R], *,
                      max_tensor_bytes: int, workers: int | None = None) -> Generator[R, None, None] | None:
        """``sink(entry, positions, xor values)`` per tensor of ``version``: its elements whose bits differ
        from ``base``'s (``decode.changes_since``), read from the deltas between the two without decoding
        either version; run on reading threads, results in manifest order. None (nothing read) unless
        every version after ``base`` up to ``version`` is a delta on its predecessor storing no tensor
        whole (a keyframe, a tensor written whole: only a decode tells what changed).

        The stored bytes are checked against their stored hashes as they are read; the tensors' hashes
        need all their bytes: a decode of ``version`` checks them.

        Raises:
            TooManyChanges: the changes read together — a tensor's, or a batch of consecutive small tensors'
                (``CHANGES_BATCH_BYTES`` of sparse deltas) — outgrow ``max_tensor_bytes`` (8-byte position and
                value per element), read on the way: a budget for the whole version is never exceeded by it.
            IntegrityError, MissingBaseError: a delta cannot be decoded, or the chain is broken.
        """
        chain = {m.version: m for m in self.chain(version)}
        if base not in chain or any(s.encoding in (ENCODING_RAW, ENCODING_ZSTD)
                                    for v, m in chain.items() if v > base for t in m.tensors for s in t.stored_entries):
            return None
        target = chain[version]
        if workers is None and not self.storage.is_posix:
            workers = max(default_workers(), MAX_CONCURRENT_READS)  # (as _decode: waiting on ranged reads)

        def changes(batch: tuple[bool, list[TensorEntry]]) -> list[R]:
            batched, group = batch
            if batched:
                found = changes_of_sparse(self._files, target, group, max_tensor_bytes)
                return [sink(entry, *one) for entry, one in zip(group, found)]
            found_one = changes_since(self._files, chain.__getitem__, target, group[0], base, max_tensor_bytes)
            assert found_one is not None  # (every step is a delta: checked above)
            return [sink(group[0], *found_one)]

        # In flight: each tensor's stored delta and what its sink holds (positions and two values per change).
        groups = ordered_parallel(_sparse_batches(target.tensors, one_step=target.base_version == base), changes,
                                  lambda batch: sum(sum(s.length for s in e.stored_entries)
                                                    + (e.changed or 0) * (8 + 2 * e.itemsize) for e in batch[1]),
                                  max_cost=DEFAULT_INFLIGHT_BYTES, workers=workers)
        return (result for group in groups for result in group)

    def read_tensor(self, version: int, name: str) -> torch.Tensor:
        """One tensor of a version, decoded and checked (TensorNotFoundError, a KeyError, if it lacks it)."""
        target = self.manifest(version)
        entry = target.tensor(name)
        self.chain(version)
        return decode_tensor(self._files, self._base_manifest, target, entry)

    def asset(self, entry: FileEntry) -> bytes:
        """The bytes of a non-weight asset file, checked against its hash."""
        path = asset_path(entry.name)
        try:
            raw = self.storage.read(path)
        except FileNotFoundError:
            raise IntegrityError("asset file is missing", file=path) from None
        if len(raw) != entry.size or content_hash(raw) != entry.hash:
            raise IntegrityError("asset file does not match stream.json (corrupt or replaced)", file=path)
        return raw

    # ----------------------------------------------------------------------------------- materialize

    def materialize(self, version: int | str, out_dir: str | os.PathLike[str], *,
                    base_dir: str | os.PathLike[str] | None = None, overwrite: bool = False,
                    shard_bytes: int = DEFAULT_SHARD_BYTES, progress: Progress | None = None,
                    workers: int | None = None, holder: str = "materialize") -> Path:
        """Write ``version`` as a plain Hugging Face directory that ``vllm serve``/``reload_weights`` load.

        The directory holds safetensors shards (with ``model.safetensors.index.json`` when sharded), the
        stream's asset files (config.json, tokenizer, ...) and a ``ckptstream.json`` marker; that of a version
        of an adapter stream is a PEFT directory (``adapter_config.json``, the tensors in one
        ``adapter_model.safetensors``, the marker) that ``vllm serve --lora-modules`` and
        ``PeftModel.from_pretrained`` load, written once its tensors are checked against the stream's rank
        and target modules (AdapterMismatchError naming the version and tensor). It is built
        under a temporary name beside ``out_dir`` and renamed into place, so it is never seen incomplete;
        temporary directories that killed runs left beside ``out_dir`` are removed first (see
        ``ckptstream.reader.materialize``). With ``base_dir``, deltas are applied to that earlier
        materialized copy; a damaged copy is refused (IntegrityError naming its file), never used. A lease
        (named ``holder``) keeps the version from gc while it is written.

        Returns:
            The path of the directory.

        Raises:
            NotADirectoryOutputError: ``out_dir`` is an existing file.
            FileExistsError: ``out_dir`` is not empty and ``overwrite`` is false.
        """
        v = self.resolve(version)
        with self.lease(v, holder=holder) as chain:
            manifest = chain[-1]
            return build_directory(out_dir, manifest, overwrite=overwrite, shard_bytes=shard_bytes,
                                   progress=progress, **self._directory_parts(manifest, base_dir, workers))

    def write_into(self, version: int, directory: str | os.PathLike[str], *,
                   base_dir: str | os.PathLike[str] | None = None, shard_bytes: int = DEFAULT_SHARD_BYTES,
                   workers: int | None = None, holder: str = "write_into") -> None:
        """Write ``version``'s materialized files into ``directory``, an existing empty directory the caller
        owns and makes appear atomically itself (a cache that keeps its own temporary names); the marker is
        written last, and on an error the caller discards the directory (a tensor applied to ``base_dir`` is
        checked against its hash once written, see ``reader.decode.decode_tensor_to``). ``materialize`` is the
        atomic form of this. A lease (named ``holder``, e.g.
        ``follower <replica id>``) keeps the version from gc while it is written."""
        with self.lease(version, holder=holder) as chain:
            manifest = chain[-1]
            write_directory(Path(directory), manifest, shard_bytes=shard_bytes,
                            **self._directory_parts(manifest, base_dir, workers))

    def _directory_parts(self, manifest: Manifest, base_dir: str | os.PathLike[str] | None,
                         workers: int | None) -> dict[str, Any]:
        """The decoder, assets, marker and weights file of a materialized directory of ``manifest`` (an
        adapter's tensors, once checked, in PEFT's one file)."""
        adapter = self.info().adapter
        if adapter is not None:
            check_adapter_tensors(adapter, ((t.name, t.shape) for t in manifest.tensors), version=manifest.version)
        marker = {"stream": self.url, "stream_id": manifest.stream_id, "version": manifest.version,
                  "kind": manifest.kind, "step": manifest.step, "manifest_hash": manifest.manifest_hash}
        return {"decode": lambda write: self._decode(manifest, manifest.tensors, base_dir, None, write=write,
                                                     workers=workers),
                "assets": ((asset.name, self.asset(asset)) for asset in self.info().assets), "marker": marker,
                "weights_file": None if adapter is None else ADAPTER_WEIGHTS_FILE}

    def check_materialized(self, directory: str | os.PathLike[str], version: int) -> None:
        """Check that a materialized directory holds exactly ``version``: its marker, the set of tensor
        names, and every tensor's dtype, shape and hash (reads the directory, not the stream's data).

        Raises:
            IntegrityError / CkptStreamError: naming the version and tensor that differ.
        """
        manifest = self.manifest(version)
        base = MaterializedBase(directory, self.info().stream_id)
        try:
            if base.version != version:
                raise IntegrityError(f"{directory} holds version {base.version}", version=version)
            extra = set(base.names()) - {t.name for t in manifest.tensors}
            if extra:
                raise IntegrityError(f"{directory} holds tensors the version lacks: {sorted(extra)[:5]}",
                                     version=version)
            for entry in manifest.tensors:
                if load_checked(base, entry) is None:
                    raise IntegrityError(f"{directory} lacks this tensor", version=version, tensor=entry.name)
        finally:
            base.close()

    # ---------------------------------------------------------------------------------------- verify

    def verify(self, version: int | str, *, progress: Progress | None = None,
               holder: str = "verify") -> VerifyReport:
        """Check everything about a version: manifest seal and schema, its delta chain, every tensor
        decoded bit-exactly against its hash, the size and hash of each of its data files, and that each
        keyframe file's safetensors header carries the manifest's names, dtypes, shapes and offsets. A
        lease (named ``holder``) keeps the version from gc meanwhile.

        Raises:
            IntegrityError / MissingBaseError / VersionNotFoundError: naming the version, file, tensor.
        """
        v = self.resolve(version)
        with self.lease(v, holder=holder) as chain:
            return self._verify(chain[-1], progress)

    def _verify(self, manifest: Manifest, progress: Progress | None) -> VerifyReport:
        v = manifest.version
        decoded = 0
        for _, tensor in self.iter_tensors(v):
            decoded += tensor.numel() * tensor.element_size()
            if progress:
                progress(tensor.numel() * tensor.element_size())
        for entry in manifest.files:
            self._files.verify_file(manifest, entry)
        for asset in self.info().assets:
            self.asset(asset)
        return VerifyReport(v, len(manifest.files), len(manifest.tensors), manifest.stored_bytes, decoded)

    # ------------------------------------------------------------------------------------------ diff

    def diff(self, a: int | str, b: int | str) -> list[TensorDiff]:
        """Per-tensor differences between two versions (bit-level change counts, max abs difference)."""
        va, vb = self.resolve(a), self.resolve(b)
        ma, mb = self.manifest(va).tensor_map(), self.manifest(vb).tensor_map()
        out = []
        for name in list(ma) + [n for n in mb if n not in ma]:
            ea, eb = ma.get(name), mb.get(name)
            if ea is None or eb is None:
                entry = eb or ea
                assert entry is not None
                out.append(TensorDiff(name, "added" if ea is None else "removed", entry.numel, entry.numel, None))
            elif (ea.dtype, ea.shape) != (eb.dtype, eb.shape):
                out.append(TensorDiff(name, "retyped", eb.numel, eb.numel, None))
            elif ea.hash == eb.hash:
                out.append(TensorDiff(name, "same", ea.numel, 0, 0.0))
            else:
                ta, tb = self.read_tensor(va, name), self.read_tensor(vb, name)
                changed = _count_bit_changes(ta, tb)
                delta = None if ta.dtype == torch.bool else (tb.double() - ta.double()).abs().max().item()
                out.append(TensorDiff(name, "changed", ea.numel, changed, delta))
        return out


def check_base(delta: Manifest, base: Manifest) -> None:
    """Refuse a delta that contradicts its base (FORMAT.md, "Reader obligations" 5): its ``keyframe_version``
    must be its base's and its ``chain_length`` its base's plus one.

    Raises:
        IntegrityError: naming the delta.
    """
    if base.keyframe_version != delta.keyframe_version or base.chain_length + 1 != delta.chain_length:
        raise IntegrityError(
            f"the delta claims keyframe {delta.keyframe_version} and chain length {delta.chain_length}, "
            f"but its base version {base.version} has keyframe {base.keyframe_version} and chain length "
            f"{base.chain_length}", version=delta.version, file=manifest_path(delta.version),
            hint="The manifests of this chain contradict each other; refusing the version")


def _count_bit_changes(a: torch.Tensor, b: torch.Tensor) -> int:
    ints = INT_OF_SIZE[a.element_size()]
    return int(torch.count_nonzero(a.reshape(-1).view(ints) != b.reshape(-1).view(ints)))


def _checked_version(version: int) -> int:
    if not isinstance(version, int) or isinstance(version, bool) or not 0 <= version <= MAX_VERSION:
        raise InvalidVersionError(f"version {version!r} is out of range (versions are 0 to {MAX_VERSION})",
                                  hint="Give a version number or 'latest'")
    return version


def _declines(record: ReplicaRecord, version: int, resident: bool = False) -> str | None:
    """Why the live replica of ``record`` will not serve ``version`` (None: it may still); with ``resident``,
    will not hold it itself: an adapter follower whose stable name means a newer version holds its newest
    ``keep`` versions, so once it holds ``keep`` newer ones it never loads this one (a record without ``keep``,
    from an older writer: once its stable name means a newer one)."""
    if record.pin is not None and record.pin < version:
        return f"is pinned to version {record.pin}"
    if resident and record.version is not None and record.version > version and version not in record.resident:
        if record.keep is None or len([v for v in record.resident if v > version]) >= record.keep:
            return f"holds versions {record.resident} and loads only newer ones"
    reason = record.refused.get(str(version))
    return None if reason is None else f"refused it: {reason}"


def _sparse_batches(entries: Iterable[TensorEntry], *, one_step: bool) -> Iterator[tuple[bool, list[TensorEntry]]]:
    """``entries`` in order, in lists, each with whether it is a batch for ``decode.changes_of_sparse``:
    consecutive ``sparse_delta`` ones of one item size and byte order together (up to ``CHANGES_BATCH_BYTES``
    stored) where the delta is on the base itself (``one_step``); every other alone, not batched."""
    batch: list[TensorEntry] = []
    stored = 0
    for entry in entries:
        if not (one_step and sparse_delta(entry)):
            if batch:
                yield True, batch
            batch, stored = [], 0
            yield False, [entry]
            continue
        if batch and (stored >= CHANGES_BATCH_BYTES or (entry.itemsize, entry.shuffle) !=
                      (batch[0].itemsize, batch[0].shuffle)):
            yield True, batch
            batch, stored = [], 0
        batch.append(entry)
        stored += entry.length
    if batch:
        yield True, batch
