"""Carrying committed versions between stores byte for byte, shared by ``mirror`` and bundles.

A copied version is the source's, unchanged: the same manifest bytes, the same ``stream_id``, the same data
files (no re-encoding, so a delta moves only its stored bytes). Per version the data files come first, each
checked against the source manifest's size and hash while it is written, and appear under their final names
only once checked; the manifest comes last, through the destination's put-if-absent
(:func:`ckptstream.writer.commit.commit_manifest`, shared with the publisher). So a copy interrupted at any
moment leaves no visible partial version, and a copy run again moves only what is missing.

A gc may run at the destination meanwhile: the copy holds a lease there on the version before any of its
data is written (and on a delta's base), a file it reuses from an earlier run is touched (it counts as
written now for gc's grace period), and just before the commit every data file is checked to be there.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .errors import CkptStreamError, IntegrityError, MissingBaseError, VersionConflictError, VersionNotFoundError
from .format import (MAX_MANIFEST_BYTES, MAX_STREAM_FILE_BYTES, STREAM_FILE, FileEntry, Hasher, Manifest, data_path,
                     manifest_path)
from .reader import Stream, check_base
from .reader.files import file_hash
from .reader.leases import DEFAULT_LEASE_TTL, LeaseSet
from .storage import MAX_CONCURRENT_READS, Storage, chunk_spans
from .writer.commit import adopt_stream, commit_manifest, write_latest_hint

log = logging.getLogger("ckptstream.transfer")

Progress = Callable[[int], None]


def versions_to_carry(src: Stream, wanted: Iterable[int], present: Callable[[int], bool]) -> list[int]:
    """``wanted`` and every base their delta chains need, less the versions ``present`` at the destination,
    oldest first (bases before the deltas on them, the order of committing).

    Raises:
        MissingBaseError / IntegrityError: a chain at the source is broken, naming the version.
    """
    needed: set[int] = set()
    for version in sorted(set(wanted), reverse=True):
        if version in needed or present(version):
            continue
        for manifest in reversed(src.chain(version)):  # from the version down to its keyframe
            if manifest.version in needed or present(manifest.version):
                break
            needed.add(manifest.version)
    return sorted(needed)


def verified_chunks(src: Storage, path: str, size: int) -> Iterator[bytes]:
    """The bytes of a file of ``size`` bytes, in order, fetched by concurrent ranged reads (at most
    ``MAX_CONCURRENT_READS`` chunks of ``RANGE_CHUNK_BYTES`` in flight: bounded memory)."""
    spans = chunk_spans(0, size)
    if len(spans) <= 1:
        yield src.read(path, 0, size) if size else b""
        return
    with ThreadPoolExecutor(min(MAX_CONCURRENT_READS, len(spans)), thread_name_prefix="ckptstream-copy") as pool:
        pending = []
        for span in spans:
            pending.append(pool.submit(src.read, path, *span))
            if len(pending) >= MAX_CONCURRENT_READS:
                yield pending.pop(0).result()
        for future in pending:
            yield future.result()


def write_verified(dst: Storage, path: str, chunks: Iterable[bytes], entry: FileEntry, *, version: int | None,
                   source: str, progress: Progress | None = None) -> int:
    """Write ``chunks`` to ``path`` at ``dst``; the file appears only if its bytes have ``entry``'s size and
    hash (checked as they pass, before the write completes). Returns the bytes written.

    Raises:
        IntegrityError: the bytes differ from ``entry`` (naming ``source``, where they came from); nothing
            appears at ``path``.
    """
    hasher, written = Hasher(), 0
    with dst.open_write(path) as out:
        for chunk in chunks:
            written += len(chunk)
            if written > entry.size:
                break
            hasher.update(chunk)
            out.write(chunk)
            if progress:
                progress(len(chunk))
        if written != entry.size or hasher.digest() != entry.hash:
            what = (f"has {'more than ' if written > entry.size else ''}{written} bytes, the manifest says "
                    f"{entry.size}" if written != entry.size else "does not match the manifest's hash")
            raise IntegrityError(f"{what} (corrupt or truncated at the source); not copied", version=version,
                                 file=source, hint="Repair or re-publish it at the source")
    return written


def holds_file(dst: Storage, path: str, entry: FileEntry) -> bool:
    """Whether ``dst`` already holds ``entry`` at ``path``, checked by size and content hash (never by an
    object store's ETag, which is no content hash for multipart uploads)."""
    try:
        if dst.size(path) != entry.size:
            return False
        return file_hash(dst, path) == (entry.size, entry.hash)
    except FileNotFoundError:
        return False


@dataclass(frozen=True)
class CopiedVersion:
    """What carrying one version did."""

    version: int
    kind: str
    files: int
    copied_bytes: int  # bytes moved for this version (files the destination lacked)
    present_bytes: int  # bytes of files the destination already held, checked by size and hash
    stored_bytes: int  # the version's stored bytes (its data files' total)


class Destination:
    """The store a stream is copied into: the copy of ``stream.json`` and its assets, and per-version
    commits of the source's exact manifest bytes, under leases there (``lease_ttl``: their time to live).

    Attributes:
        stream: the destination read as a stream (its committed versions and chains).
    """

    def __init__(self, storage: Storage, *, lease_ttl: float = DEFAULT_LEASE_TTL):
        self.storage = storage
        self.stream = Stream(storage.url, storage=storage, lease_ttl=lease_ttl)
        self._adopted = False

    def adopt(self, src: Stream) -> None:
        """Create the destination as a copy of ``src``'s stream, or check that it is one (once).

        Raises:
            ForeignStreamError: the destination holds another stream.
        """
        if self._adopted:
            return
        assets = {entry.name: src.asset(entry) for entry in src.info().assets}
        adopt_stream(self.storage, src.storage.read_small(STREAM_FILE, MAX_STREAM_FILE_BYTES), assets)
        self._adopted = True

    def committed(self, version: int) -> bytes | None:
        """The manifest bytes the destination holds for ``version``, or None."""
        try:
            return self.storage.read_small(manifest_path(version), MAX_MANIFEST_BYTES)
        except FileNotFoundError:
            return None

    def check_same(self, version: int, raw: bytes) -> bool:
        """Whether the destination holds ``version`` with exactly these manifest bytes (False if it holds
        none).

        Raises:
            VersionConflictError: it holds another version of that number.
        """
        held = self.committed(version)
        if held is None:
            return False
        if held != raw:
            raise VersionConflictError("the destination holds a different version of this number",
                                       version=version, file=manifest_path(version),
                                       hint="The two stores hold diverged streams; copy into an empty location")
        return True

    def leases(self, holder: str) -> LeaseSet:
        """Leases at the destination on the versions being carried into it, each to be added before any of
        its data is written (FORMAT.md, "Leases"): a gc there keeps the files of an uncommitted version that
        a live lease names."""
        return LeaseSet(self.storage, holder=holder, ttl=self.stream.lease_ttl)

    @contextlib.contextmanager
    def lease_base(self, manifest: Manifest, holder: str) -> Iterator[None]:
        """For a delta, a lease at the destination on its base, taken and then checked to be still committed
        with its chain (``Stream.lease``), held for the block: a gc there keeps what the version needs until
        it is committed.

        Raises:
            MissingBaseError: the base (or a version of its chain) is gone from the destination.
        """
        if manifest.base_version is None:
            yield
            return
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(self.stream.lease(manifest.base_version, holder=holder))
            except VersionNotFoundError:  # MissingBaseError included: retired by a gc there
                raise MissingBaseError(f"its base version {manifest.base_version} (or a base of its chain) is "
                                       "gone from the destination", version=manifest.version,
                                       hint="Copy the base again, or copy from a newer keyframe") from None
            yield

    def reuses(self, version: int, entry: FileEntry) -> bool:
        """Whether the destination holds data file ``entry`` of ``version`` already (by size and hash); a file
        it holds is touched, so that a gc there counts it as written now, not when an earlier run wrote it."""
        path = data_path(version, entry.name)
        if not holds_file(self.storage, path, entry):
            return False
        self.storage.touch(path)
        return True

    def copy_file(self, manifest: Manifest, entry: FileEntry, chunks: Callable[[], Iterable[bytes]], *,
                  source: str, progress: Progress | None = None) -> int:
        """Put data file ``entry`` of ``manifest`` at the destination unless it holds it already (``reuses``);
        ``chunks()`` gives its bytes. Returns the bytes moved (0 if it was there)."""
        if self.reuses(manifest.version, entry):
            if progress:
                progress(entry.size)
            return 0
        return write_verified(self.storage, data_path(manifest.version, entry.name), chunks(), entry,
                              version=manifest.version, source=source, progress=progress)

    def require_base(self, manifest: Manifest) -> None:
        """Refuse a delta whose base version the destination lacks, or that contradicts that base (reader
        obligation 5: its keyframe and chain length): committed, it would be a version no reader there can
        decode.

        Raises:
            MissingBaseError: naming the delta and its base.
            IntegrityError: the delta contradicts its base, naming the delta.
        """
        if manifest.base_version is None:
            return
        raw = self.committed(manifest.base_version)
        if raw is None:
            raise MissingBaseError(f"its base version {manifest.base_version} is not at the destination "
                                   "(refused or gone at the source)", version=manifest.version,
                                   hint="Copy the base first, or copy from a newer keyframe")
        check_base(manifest, Manifest.from_bytes(raw, version=manifest.base_version,
                                                 stream_id=manifest.stream_id))

    def check_files(self, manifest: Manifest) -> None:
        """Check, asking the storage now, that every data file of ``manifest`` is at the destination with its
        size: what was written or found earlier may have been removed since (a gc there).

        Raises:
            CkptStreamError: a file is missing or of another size, naming it (nothing is committed).
        """
        for entry in manifest.files:
            path = data_path(manifest.version, entry.name)
            try:
                size: int | None = self.storage.size(path)
            except FileNotFoundError:
                size = None
            if size != entry.size:
                raise CkptStreamError(f"this data file is {'gone' if size is None else f'of {size} bytes'} at the "
                                      "destination just before the commit; the version is not committed",
                                      version=manifest.version, file=path,
                                      hint="Copy it again (a gc at the destination may have removed it)")

    def commit(self, manifest: Manifest, raw: bytes) -> None:
        """Commit the source's manifest bytes (put-if-absent) once its data files are checked to be in place
        (``check_files``) and its base to be committed (MissingBaseError otherwise)."""
        self.require_base(manifest)
        self.check_files(manifest)
        commit_manifest(self.storage, manifest, raw)
        write_latest_hint(self.storage, manifest.version)  # readers that cannot list start there


def copy_version(src: Stream, dst: Destination, version: int, *, holder: str = "copy",
                 progress: Progress | None = None) -> CopiedVersion:
    """Carry one version from ``src`` to ``dst``: data files first, each verified, then the manifest, all
    under leases at the destination (``holder``: who holds them) on the version and its base. Its delta base
    must be at the destination already (``versions_to_carry`` orders them so).

    Raises:
        IntegrityError: a source file is missing, truncated or corrupt (the destination is unchanged: no
            file of it appears, nothing is committed).
        MissingBaseError: the destination lacks the delta's base version.
        VersionConflictError: the destination holds a different version of this number.
        CkptStreamError: a data file is gone from the destination before the commit (nothing committed).
    """
    raw = src.storage.read_small(manifest_path(version), MAX_MANIFEST_BYTES)
    manifest = Manifest.from_bytes(raw, version=version, stream_id=src.info().stream_id)
    if dst.check_same(version, raw):
        return CopiedVersion(version, manifest.kind, len(manifest.files), 0, manifest.stored_bytes,
                             manifest.stored_bytes)
    dst.require_base(manifest)
    moved = 0
    with dst.leases(holder) as leases, dst.lease_base(manifest, holder):
        leases.add(version)
        for entry in manifest.files:
            path = data_path(version, entry.name)
            try:
                moved += dst.copy_file(manifest, entry,
                                       lambda p=path, e=entry: verified_chunks(src.storage, p, e.size),
                                       source=f"{src.url}/{path}", progress=progress)
            except FileNotFoundError:
                raise IntegrityError("data file is missing at the source; not copied", version=version,
                                     file=f"{src.url}/{path}", hint="Repair or re-publish it at the source") from None
            except EOFError:
                raise IntegrityError("data file is truncated at the source; not copied", version=version,
                                     file=f"{src.url}/{path}", hint="Repair or re-publish it at the source") from None
        dst.commit(manifest, raw)
    log.info("copied version %d (%s): %d bytes moved of %d stored", version, manifest.kind, moved,
             manifest.stored_bytes)
    return CopiedVersion(version, manifest.kind, len(manifest.files), moved, manifest.stored_bytes - moved,
                         manifest.stored_bytes)
