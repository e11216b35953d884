"""Creating a stream and committing versions: writer-unique names, ``stream.json`` with its assets, and
the put-if-absent commit of a manifest (FORMAT.md, "Commit protocol and writer obligations").

Usable on its own to commit a version that already has its ``stream_id`` and data files (what copying
a stream between stores does): ``open_or_create_stream(storage, assets, stream_id=...)``, then
``commit_manifest(storage, manifest)``.
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
import threading
import uuid
from typing import Mapping

from ..credentials import redact
from ..errors import (CkptStreamError, CommitOutcomeUnknownError, ForeignStreamError, IncompatibleStreamError,
                      IntegrityError, PublishError, VersionConflictError)
from ..format import (DELTA, KEYFRAME, LATEST_HINT_FILE, MAX_ASSET_BYTES, MAX_MANIFEST_BYTES, MAX_STREAM_FILE_BYTES,
                      STREAM_FILE, STREAM_KIND_ADAPTER, STREAM_KIND_WEIGHTS, AdapterInfo, FileEntry, Manifest,
                      StreamInfo, asset_path, content_hash, is_reserved_asset_name, is_safe_file_name,
                      latest_hint_bytes, manifest_path)
from ..reader.adapter import kind_error
from ..reader.probe import read_latest_hint
from ..storage import Storage

log = logging.getLogger("ckptstream.publish")

Assets = Mapping[str, bytes] | str | os.PathLike[str] | None
"""Asset files as a mapping of name to bytes, or a Hugging Face model directory to take them from."""


def new_writer_id() -> str:
    """A token unique to one writer (12 hex digits), part of every data file name it writes."""
    return uuid.uuid4().hex[:12]


def data_file_name(kind: str, writer_id: str, index: int, count: int) -> str:
    """The name of data file ``index`` (from 0) of ``count`` of a version of ``kind``, unique to the writer:
    ``model-<writer>-00001-of-00002.safetensors`` (keyframes), ``delta-<writer>-00001-of-00002.zst``."""
    if kind == KEYFRAME:
        return f"model-{writer_id}-{index + 1:05d}-of-{count:05d}.safetensors"
    if kind == DELTA:
        return f"delta-{writer_id}-{index + 1:05d}-of-{count:05d}.zst"
    raise ValueError(f"unknown kind {kind!r}")


def utc_now() -> str:
    """The current time as the format writes it (ISO-8601 UTC, milliseconds)."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


# ------------------------------------------------------------------------------------------ the stream

def load_assets(assets: Assets) -> dict[str, bytes]:
    """The asset files of ``assets`` (a model directory's non-weight files, or a mapping); whoever
    creates or checks the stream with them checks their names (``check_assets``)."""
    if isinstance(assets, (str, os.PathLike)):
        from ..hf import hf_assets

        assets = hf_assets(assets)
    return dict(assets or {})


def check_assets(assets: Mapping[str, bytes]) -> dict[str, bytes]:
    """Refuse asset names that are not plain file names, names that would replace or shadow the weights
    of a materialized directory (weight files, indexes, the ``ckptstream.json`` marker), and assets over
    ``MAX_ASSET_BYTES``."""
    for name in assets:
        if not is_safe_file_name(name):
            raise IncompatibleStreamError(f"asset name {name!r} is not a plain file name", file=STREAM_FILE,
                                          hint="Assets are top-level files of a model directory")
        if is_reserved_asset_name(name):
            raise IncompatibleStreamError(
                f"asset {name!r} would replace or shadow the published weights in a materialized directory",
                file=asset_path(name), hint="Weights are published as versions: leave weight files, "
                                            "their indexes and ckptstream.json out of the assets")
        if len(assets[name]) > MAX_ASSET_BYTES:
            raise IncompatibleStreamError(f"asset {name!r} has {len(assets[name])} bytes, over the "
                                          f"{MAX_ASSET_BYTES}-byte limit of an asset", file=asset_path(name),
                                          hint="Assets are a model's small non-weight files (config, tokenizer); "
                                               "leave larger files out of the model directory")
    return dict(assets)


def read_stream_info(storage: Storage) -> StreamInfo | None:
    """The stream's ``stream.json``, or None if the stream has not been created."""
    try:
        return StreamInfo.from_bytes(storage.read_small(STREAM_FILE, MAX_STREAM_FILE_BYTES))
    except FileNotFoundError:
        return None


def open_or_create_stream(storage: Storage, assets: Mapping[str, bytes] | None, *,
                          stream_id: str | None = None, adapter: AdapterInfo | None = None) -> StreamInfo:
    """The stream's ``StreamInfo``, creating the stream (assets, then ``stream.json``) if it is new.

    Args:
        storage: the stream's storage.
        assets: the asset files a new stream gets; those of an existing stream must not differ (files
            the stream lacks are ignored: the assets are fixed when the stream is created).
        stream_id: the identity of the stream (default: a new random one); a stream copied from
            another store keeps the original's.
        adapter: for an adapter stream, what it adapts (its ``assets`` then hold ``adapter_config.json``);
            None: a weights stream.

    Raises:
        IncompatibleStreamError: a reserved or unsafe asset name, an asset that differs from the
            stream's, an existing stream with another ``stream_id``, or of another base model or rank.
        StreamKindError: an existing stream of the other kind.
    """
    assets = check_assets(assets or {})
    info = read_stream_info(storage)
    if info is None:
        info = _create_stream(storage, assets, stream_id or uuid.uuid4().hex, adapter)
    check_stream(info, assets, stream_id, adapter=adapter, url=storage.url)
    return info


def check_stream(info: StreamInfo, assets: Mapping[str, bytes], stream_id: str | None = None, *,
                 adapter: AdapterInfo | None = None, url: str = "the stream") -> None:
    """Refuse an existing stream (at ``url``) whose assets differ from ``assets``, whose id is not
    ``stream_id``, whose kind is not the one ``adapter`` implies (StreamKindError), or, for an adapter, whose
    base model, rank or target modules differ (the base's hash only where both know it)."""
    if stream_id is not None and info.stream_id != stream_id:
        raise IncompatibleStreamError(f"the stream has stream_id {info.stream_id}, not {stream_id}",
                                      file=STREAM_FILE, hint="Copy into an empty location or into a copy "
                                                             "of the same stream")
    kind = STREAM_KIND_WEIGHTS if adapter is None else STREAM_KIND_ADAPTER
    if info.kind != kind:
        raise kind_error(url, kind=info.kind, expected=kind, hint=_WRITER_KIND_HINTS.get(info.kind))
    if adapter is not None and info.adapter is not None and _other_adapter(info.adapter, adapter):
        raise IncompatibleStreamError(
            f"the stream holds adapters of base {info.adapter.base_name} ({info.adapter.base_hash or 'hash unknown'}), "
            f"rank {info.adapter.rank} on {', '.join(info.adapter.target_modules)}; this one is of base "
            f"{adapter.base_name} ({adapter.base_hash or 'hash unknown'}), rank {adapter.rank} on "
            f"{', '.join(adapter.target_modules)}", file=STREAM_FILE,
            hint="A stream holds one adapter of one base model; publish to a new stream URL")
    have = {a.name: a.hash for a in info.assets}
    different = sorted(n for n, data in assets.items() if n in have and content_hash(data) != have[n])
    if different:
        raise IncompatibleStreamError(
            f"the stream was created with other non-weight files ({', '.join(different)} differ)",
            file=STREAM_FILE, hint="A stream holds one model; publish to a new stream URL")


_WRITER_KIND_HINTS = {
    STREAM_KIND_ADAPTER: "Publish adapters to it (Publisher(url, adapter_of=peft_model), ckptstream publish "
                         "--from-peft DIR), or these weights to a new stream URL",
    STREAM_KIND_WEIGHTS: "Publish the adapter to a stream of its own (a new stream URL)",
}


def _other_adapter(have: AdapterInfo, new: AdapterInfo) -> bool:
    hashes_differ = have.base_hash is not None and new.base_hash is not None and have.base_hash != new.base_hash
    return hashes_differ or (have.base_name, have.rank, have.target_modules) != (new.base_name, new.rank,
                                                                                 new.target_modules)


def _create_stream(storage: Storage, assets: Mapping[str, bytes], stream_id: str,
                   adapter: AdapterInfo | None = None) -> StreamInfo:
    """Assets first, each put-if-absent, then ``stream.json`` put-if-absent; a writer that loses the race
    for ``stream.json`` takes the winner's."""
    entries = []
    for name, data in sorted(assets.items()):
        entry = FileEntry(name, len(data), content_hash(data))
        try:
            storage.put_if_absent(asset_path(name), data)
        except FileExistsError:
            if content_hash(storage.read(asset_path(name))) != entry.hash:
                raise IncompatibleStreamError("another writer is creating this stream with a different file",
                                              file=asset_path(name)) from None
        entries.append(entry)
    info = StreamInfo(stream_id=stream_id, created=utc_now(), assets=tuple(entries),
                      kind=STREAM_KIND_WEIGHTS if adapter is None else STREAM_KIND_ADAPTER, adapter=adapter)
    try:
        storage.put_if_absent(STREAM_FILE, info.to_bytes())
        log.info("created stream %s (%s)", redact(storage.url), stream_id)
        return info
    except FileExistsError:
        return StreamInfo.from_bytes(storage.read_small(STREAM_FILE, MAX_STREAM_FILE_BYTES))


def adopt_stream(storage: Storage, raw_info: bytes, assets: Mapping[str, bytes]) -> StreamInfo:
    """Make ``storage`` a copy of another store's stream: its assets and the exact bytes of its
    ``stream.json`` (so the copy has the same ``stream_id`` and metadata), each put-if-absent.

    ``assets`` are the source's asset files, each checked against ``raw_info`` before anything is written.
    A destination that already holds this stream is left as it is (its missing assets are added).

    Raises:
        IntegrityError: ``raw_info`` is not a valid ``stream.json``, or an asset is not the one it lists.
        ForeignStreamError: the destination holds another stream.
    """
    info = StreamInfo.from_bytes(raw_info)
    for entry in info.assets:
        data = assets.get(entry.name)
        if data is None or len(data) != entry.size or content_hash(data) != entry.hash:
            raise IntegrityError("the source's asset file does not match its stream.json", file=asset_path(entry.name),
                                 hint="The source stream is damaged; nothing was written")
    existing = read_stream_info(storage)
    if existing is not None and existing.stream_id != info.stream_id:
        raise _foreign(storage, existing, info)
    for entry in info.assets:
        try:
            storage.put_if_absent(asset_path(entry.name), assets[entry.name])
        except FileExistsError:
            if content_hash(storage.read(asset_path(entry.name))) != entry.hash:
                raise ForeignStreamError("the destination holds a different file of this name",
                                         file=asset_path(entry.name),
                                         hint="Copy into an empty location or into a copy of the same stream") from None
    try:
        storage.put_if_absent(STREAM_FILE, raw_info)
    except FileExistsError:
        existing = StreamInfo.from_bytes(storage.read_small(STREAM_FILE, MAX_STREAM_FILE_BYTES))
        if existing.stream_id != info.stream_id:
            raise _foreign(storage, existing, info) from None
        return existing
    log.info("created %s as a copy of stream %s", redact(storage.url), info.stream_id)
    return info


def _foreign(storage: Storage, existing: StreamInfo, info: StreamInfo) -> ForeignStreamError:
    return ForeignStreamError(f"{storage.url} holds stream {existing.stream_id}, not {info.stream_id}",
                              file=STREAM_FILE, hint="Copy into an empty location or into a copy of the same stream")


class LazyStream:
    """A stream that is created when first needed (at the first commit), so that a publish failing
    before that leaves nothing behind.

    The assets are checked at once, and so is an existing stream against them (and against ``adapter``:
    an adapter stream's block, None for a weights stream; see ``check_stream``).
    """

    def __init__(self, storage: Storage, assets: Mapping[str, bytes], adapter: AdapterInfo | None = None):
        self._storage = storage
        self._assets = check_assets(assets)
        self._adapter = adapter
        self._lock = threading.Lock()
        self._info = read_stream_info(storage)
        if self._info is not None:
            check_stream(self._info, self._assets, adapter=adapter, url=storage.url)

    def info(self) -> StreamInfo:
        """The stream's ``StreamInfo``, creating the stream if it does not exist yet."""
        with self._lock:
            if self._info is None:
                self._info = open_or_create_stream(self._storage, self._assets, adapter=self._adapter)
            return self._info


# ------------------------------------------------------------------------------------------ the commit

def commit_manifest(storage: Storage, manifest: Manifest, raw: bytes | None = None) -> None:
    """Commit a version: create ``manifests/<version>.json`` with put-if-absent.

    A commit whose answer was lost (an S3 PUT retried after a 500 or a reset connection, a retransmitted
    NFS link) finds the manifest already there: the bytes are read back, and the writer's own bytes (the
    same writer id, time and seal) are its commit, not a conflict.

    Args:
        storage: the stream's storage.
        manifest: the version's manifest; its data files must be durable already.
        raw: the exact bytes to store (default ``manifest.to_bytes()``), e.g. a copied stream's original.

    Raises:
        VersionConflictError: another writer committed this version first.
        CommitOutcomeUnknownError: the commit failed and reading the manifest back could not tell whether
            it was stored (keep the data files).
    """
    raw = manifest.to_bytes() if raw is None else raw
    path = manifest_path(manifest.version)
    try:  # a writer MUST NOT commit what readers refuse (FORMAT.md): check it the way a reader will
        Manifest.from_bytes(raw, version=manifest.version, stream_id=manifest.stream_id)
    except CkptStreamError as exc:
        raise PublishError(f"the manifest would be refused by readers ({exc}); nothing was committed",
                           version=manifest.version, file=path) from exc
    try:
        storage.put_if_absent(path, raw)
    except Exception as exc:
        # The request may have reached the storage even though it failed here (a lost answer, retried into
        # a 412 or an EEXIST): look before reporting.
        try:
            stored = _stored_manifest(storage, path)
        except Exception:  # noqa: BLE001 - the storage is unreachable: the outcome is unknown
            raise CommitOutcomeUnknownError(
                f"the commit failed ({exc!r}) and the manifest cannot be read back, so whether the version was "
                "committed is unknown", version=manifest.version, file=path,
                hint="Check with `ckptstream ls` before publishing this version again") from exc
        if stored is not None and stored != raw:
            raise VersionConflictError("another writer committed this version first", version=manifest.version,
                                       hint="This writer's data files are left for `ckptstream gc`; "
                                            "publish a newer version") from None
        if stored is None and isinstance(exc, FileExistsError):
            # The put found a manifest that the read-back does not: removed since, or a store whose reads
            # lag its writes. It may have been this writer's, stored by a retry of a lost request.
            raise CommitOutcomeUnknownError(
                "the commit was refused because the manifest exists, yet none can be read back, so whether "
                "this writer's was the one stored is unknown", version=manifest.version, file=path,
                hint="Check with `ckptstream ls` before publishing this version again") from exc
        if stored is None:
            raise  # nothing was stored: the commit failed
        log.info("version %d: the commit reported %r but the manifest holds this writer's bytes (the answer "
                 "to its commit was lost): committed", manifest.version, exc)
    log.info("committed version %d (%s, %d bytes stored)", manifest.version, manifest.kind, manifest.stored_bytes)


def write_latest_hint(storage: Storage, version: int) -> None:
    """Point the stream's latest-version hint (FORMAT.md, "Latest-version hint") at ``version``, a version
    just committed, unless it already names a newer one. Call it after each successful commit.

    The hint is advisory (readers that cannot list start probing there), so a hint that cannot be written
    is logged, never raised: the version is committed either way.
    """
    try:
        current = read_latest_hint(storage)
        if current is None or current < version:
            storage.put(LATEST_HINT_FILE, latest_hint_bytes(version))
    except Exception as exc:  # noqa: BLE001 - advisory: readers probe from an older hint or from 0
        log.warning("version %d is committed, but the latest-version hint was not updated: %s", version, exc)


def _stored_manifest(storage: Storage, path: str) -> bytes | None:
    """The manifest bytes at ``path``, or None if there is no such file."""
    try:
        return storage.read_small(path, MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        return None
