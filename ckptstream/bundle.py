"""Air-gapped bundles: committed versions of a stream carried as one tar file (FORMAT.md, "Bundles").

``export_bundle`` writes the versions asked for, every base their chains need, ``stream.json`` and the
assets, in a fixed member order with fixed metadata (the same stream and versions give the same bytes),
after an index listing every member's size and hash. ``import_bundle`` reads a bundle sequentially (a pipe
will do; a plain tar, never a compressed one), checks every member against the index as it passes, writes
data files at the destination only under verified names (invisible without their manifests, and removed
again if the bundle is refused), and commits the manifests, in order and through put-if-absent, only once
the whole archive has verified. Both stream with bounded memory: a file moves in pieces
(``RANGE_CHUNK_BYTES`` read from the source, ``_TAR_READ_BUFFER`` from the archive), never whole, and what an
import holds until its commit (manifests, assets) waits in a local temporary file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import os
import stat
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Union

from .credentials import redact
from .errors import (CommitOutcomeUnknownError, ForeignStreamError, IntegrityError, MissingBaseError,
                     VersionConflictError, VersionNotFoundError)
from .format import (ASSETS_DIR, BUNDLE_INDEX_FILE, MANIFESTS_DIR, MAX_BUNDLE_INDEX_BYTES, MAX_MANIFEST_BYTES,
                     MAX_STREAM_FILE_BYTES, STREAM_FILE, VERSIONS_DIR, BundleIndex, FileEntry, Hasher, Manifest,
                     StreamInfo, asset_path, content_hash, data_path, manifest_path, parse_version_name)
from .reader import Stream, check_base
from .storage import RANGE_CHUNK_BYTES, Storage, temp_name
from .transfer import Destination, versions_to_carry, write_verified
from .writer.commit import adopt_stream, read_stream_info

log = logging.getLogger("ckptstream.bundle")

Progress = Callable[[int], None]
BundleFile = Union[str, "os.PathLike[str]", IO[bytes]]
"""Where a bundle is: a path, ``-`` for stdout (export) or stdin (import), or an open binary file object."""

_TAR_READ_BUFFER = 1 << 20
"""Bytes an import reads from the archive at once (tarfile's default, 10 KiB, is slow), and the piece of a
member it checks and writes at once: the input is sequential, so larger pieces would buy nothing but memory."""

_COMPRESSIONS = ((b"\x1f\x8b", "gzip", "gzip -dc"), (b"BZh", "bzip2", "bzip2 -dc"), (b"\xfd7zXZ\x00", "xz", "xz -dc"),
                 (b"\x28\xb5\x2f\xfd", "zstd", "zstd -dc"), (b"\x04\x22\x4d\x18", "lz4", "lz4 -dc"))
"""The magic number that begins a compressed file, the compression's name and the command that undoes it: a
compressed bundle is refused, naming them."""
_SNIFF_BYTES = max(len(magic) for magic, _, _ in _COMPRESSIONS)


@dataclass(frozen=True)
class ExportReport:
    """What ``export_bundle`` wrote."""

    versions: tuple[int, ...]  # the versions carried, oldest first (bases included)
    since: int | None
    members: int  # members after the index
    member_bytes: int  # their bytes (what the index lists)
    bundle_bytes: int  # bytes of the tar file
    seconds: float


@dataclass(frozen=True)
class ImportReport:
    """What ``import_bundle`` did."""

    versions: tuple[int, ...]  # versions committed by this import, oldest first
    skipped: tuple[int, ...]  # versions the destination held already with the same manifest bytes
    bytes_read: int  # member bytes read and checked
    bytes_written: int  # data bytes written (files the destination lacked)
    seconds: float


# ------------------------------------------------------------------------------------------------ export

def export_bundle(stream: Stream, out: BundleFile, *, versions: list[int] | None = None, since: int | None = None,
                  progress: Progress | None = None) -> ExportReport:
    """Write versions of ``stream`` as a bundle to ``out``.

    Args:
        stream: the source stream.
        out: a path (written under a temporary name beside it and renamed when complete), ``-`` for
            stdout, or a binary file object.
        versions: the versions to carry (default: all); every base their chains need comes too.
        since: make an incremental bundle for a destination that holds ``since``'s chain: only the
            versions newer than ``since`` (of ``versions``) and the bases they need outside that chain.
        progress: called with the number of member bytes as they are written.

    Raises:
        IntegrityError: a source file is missing, truncated or corrupt (naming version and file); no bundle
            appears at a path ``out``.
        VersionNotFoundError: a version asked for (or ``since``) is not committed, or nothing is newer than
            ``since``.
    """
    start = time.perf_counter()
    info = stream.info()
    raw_info = stream.storage.read_small(STREAM_FILE, MAX_STREAM_FILE_BYTES)
    carried, requires = _plan(stream, versions, since)
    # The index comes first, so its hashes come from stream.json and the manifests: no second pass over data.
    members = [FileEntry(STREAM_FILE, len(raw_info), content_hash(raw_info))]
    members += [FileEntry(asset_path(a.name), a.size, a.hash) for a in sorted(info.assets, key=lambda a: a.name)]
    for version in carried:
        raw = stream.storage.read_small(manifest_path(version), MAX_MANIFEST_BYTES)
        manifest = Manifest.from_bytes(raw, version=version, stream_id=info.stream_id)
        members += [FileEntry(data_path(version, f.name), f.size, f.hash)
                    for f in sorted(manifest.files, key=lambda f: f.name)]
        members.append(FileEntry(manifest_path(version), len(raw), content_hash(raw)))
    index = BundleIndex(stream_id=info.stream_id, versions=tuple(carried), members=tuple(members), since=since,
                        requires=requires)
    with contextlib.ExitStack() as leases, _output(out) as sink:
        # A lease on each carried version no other builds on (gc keeps a leased version's chain), checked
        # to be still committed once taken (FORMAT.md, "Leases"): gc cannot retire one mid-export.
        bases = {m.base_version for m in (stream.manifest(v) for v in carried)}
        for version in carried:
            if version not in bases:
                leases.enter_context(stream.lease(version, holder=f"export {os.getpid()}"))
        counted = _CountingWriter(sink)
        with tarfile.open(fileobj=counted, mode="w", format=tarfile.PAX_FORMAT,
                          copybufsize=RANGE_CHUNK_BYTES) as tar:
            _add_bytes(tar, BUNDLE_INDEX_FILE, index.to_bytes())
            for entry in members:
                tar.addfile(_member_info(entry.name, entry.size), _source_file(stream, info, entry, progress))
    report = ExportReport(tuple(carried), since, len(members), sum(m.size for m in members), counted.count,
                          time.perf_counter() - start)
    log.info("exported versions %s of %s (%d members, %d bytes)", list(carried), redact(stream.url), report.members,
             report.bundle_bytes)
    return report


def _plan(stream: Stream, versions: list[int] | None,
          since: int | None) -> tuple[list[int], tuple[tuple[int, str], ...]]:
    """The versions to carry, oldest first, and the chain (version, manifest hash) the destination of an
    incremental bundle must hold."""
    wanted = sorted(set(versions)) if versions is not None else stream.versions()
    if since is None:
        if not wanted:
            raise VersionNotFoundError(f"stream {stream.url} has no versions to export")
        return versions_to_carry(stream, wanted, lambda v: False), ()
    chain = [m.version for m in stream.chain(since)]
    newer = [v for v in wanted if v > since]
    if not newer:
        raise VersionNotFoundError(f"no version to export after version {since}", version=since,
                                   hint=f"`ckptstream ls {stream.url}` lists the committed versions")
    requires = tuple((v, content_hash(stream.storage.read_small(manifest_path(v), MAX_MANIFEST_BYTES))) for v in chain)
    return versions_to_carry(stream, newer, set(chain).__contains__), requires


def _member_info(name: str, size: int) -> tarfile.TarInfo:
    """A member header with the bundle's fixed metadata (FORMAT.md, "Bundles")."""
    info = tarfile.TarInfo(name)
    info.size, info.type, info.mode, info.mtime = size, tarfile.REGTYPE, 0o644, 0
    info.uid, info.gid, info.uname, info.gname = 0, 0, "", ""
    return info


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    tar.addfile(_member_info(name, len(data)), io.BytesIO(data))


def _source_file(stream: Stream, info: StreamInfo, entry: FileEntry, progress: Progress | None) -> IO[bytes]:
    """A file object over one member's bytes at the source, checked against ``entry``."""
    if entry.name == STREAM_FILE:
        raw = stream.storage.read_small(STREAM_FILE, MAX_STREAM_FILE_BYTES)
        return _Checked(io.BytesIO(raw), entry, None, progress)
    directory, _, rest = entry.name.partition("/")
    if directory == MANIFESTS_DIR:
        version = parse_version_name(rest)
        raw = stream.storage.read_small(entry.name, MAX_MANIFEST_BYTES)
        return _Checked(io.BytesIO(raw), entry, version, progress)
    if directory != VERSIONS_DIR:  # an asset: small, read whole and checked by Stream.asset
        asset = next(a for a in info.assets if asset_path(a.name) == entry.name)
        return _Checked(io.BytesIO(stream.asset(asset)), entry, None, progress)
    version = parse_version_name(rest.partition("/")[0])
    try:
        size = stream.storage.size(entry.name)
    except FileNotFoundError:
        raise IntegrityError("data file is missing at the source; the export is aborted", version=version,
                             file=f"{stream.url}/{entry.name}", hint="Repair or re-publish it at the source") from None
    if size != entry.size:
        raise IntegrityError(f"data file has {size} bytes, the manifest says {entry.size}; the export is aborted",
                             version=version, file=f"{stream.url}/{entry.name}",
                             hint="Repair or re-publish it at the source")
    return _Checked(_RangedReader(stream.storage, entry.name), entry, version, progress,
                    where=f"{stream.url}/{entry.name}")


class _RangedReader(io.RawIOBase):
    """Sequential reads of a stored file, each one ranged read (tarfile asks for ``RANGE_CHUNK_BYTES``)."""

    def __init__(self, storage: Storage, path: str):
        super().__init__()
        self._storage, self._path, self._position = storage, path, 0

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        data = self._storage.read(self._path, self._position, None if size < 0 else self._position + size)
        self._position += len(data)
        return data


class _Checked(io.RawIOBase):
    """Passes a member's bytes through, hashing them; the read that completes the member raises an
    IntegrityError if they are not ``entry``'s (so a corrupt source never completes the tar)."""

    def __init__(self, raw: IO[bytes], entry: FileEntry, version: int | None, progress: Progress | None, *,
                 where: str | None = None):
        super().__init__()
        self._source, self._entry, self._version, self._progress = raw, entry, version, progress
        self._where = where or entry.name
        self._hasher, self._count = Hasher(), 0

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        data = self._source.read(size)
        self._count += len(data)
        self._hasher.update(data)
        if self._progress and data:
            self._progress(len(data))
        short = len(data) < size and self._count < self._entry.size
        if short or self._count > self._entry.size:
            raise IntegrityError(f"file ended after {self._count} bytes, the manifest says {self._entry.size} "
                                 f"(truncated at the source); the export is aborted", version=self._version,
                                 file=self._where, hint="Repair or re-publish it at the source")
        if self._count == self._entry.size and self._hasher.digest() != self._entry.hash:
            raise IntegrityError("file does not match its hash (corrupt at the source); the export is aborted",
                                 version=self._version, file=self._where, hint="Repair or re-publish it at the source")
        return data


class _CountingWriter(io.RawIOBase):
    """The bundle's output, counting bytes; ``tell`` is the count, so that tarfile can write to a pipe."""

    def __init__(self, sink: IO[bytes]):
        super().__init__()
        self._sink, self.count = sink, 0

    def writable(self) -> bool:
        return True

    def write(self, data: bytes) -> int:  # type: ignore[override]
        self._sink.write(data)
        self.count += len(data)
        return len(data)

    def tell(self) -> int:
        return self.count


@contextlib.contextmanager
def _output(out: BundleFile) -> Iterator[IO[bytes]]:
    """The file a bundle is written to; a path gets it only once complete (temporary name, then rename)."""
    if out == "-":
        yield sys.stdout.buffer
        sys.stdout.buffer.flush()
        return
    if not isinstance(out, (str, os.PathLike)):
        yield out
        return
    path = Path(out)
    temp = path.with_name(temp_name(path.name))
    try:
        with open(temp, "xb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------------------ import

def import_bundle(bundle: BundleFile, dst_storage: Storage, *, progress: Progress | None = None) -> ImportReport:
    """Verify a bundle and commit its versions at ``dst_storage``.

    Every member is checked against the index as it is read; data files are written under their final
    names only once verified (invisible without their manifests), and removed again if the import refuses
    the bundle; ``stream.json``, the assets and the manifests are held (in a local temporary file) until the
    archive has been read to its end, then the stream is adopted and the manifests committed in order
    through put-if-absent. Run again after an interruption, it keeps the data files the destination holds
    (checked by size and hash) and skips versions it holds with the same manifest bytes.

    Args:
        bundle: a path, ``-`` for stdin, or a binary file object (read sequentially; a pipe will do).
        dst_storage: the destination stream's storage.
        progress: called with the number of member bytes as they are read.

    Raises:
        IntegrityError: a compressed, truncated, reordered or tampered bundle, an asset stream.json does not
            list, naming the member; nothing committed, and the data files this import wrote removed.
        ForeignStreamError: the destination holds another stream.
        MissingBaseError: an incremental bundle whose chain the destination lacks, naming the version.
        VersionConflictError: the destination holds a different version of a number the bundle carries.
    """
    start = time.perf_counter()
    name = "-" if bundle == "-" else str(bundle) if isinstance(bundle, (str, os.PathLike)) else "bundle"
    with _input(bundle) as raw:
        importer = _Importer(dst_storage, name, progress)
        committed, skipped = importer.run(raw)
    return ImportReport(tuple(committed), tuple(skipped), importer.bytes_read, importer.bytes_written,
                        time.perf_counter() - start)


@contextlib.contextmanager
def _input(bundle: BundleFile) -> Iterator[IO[bytes]]:
    if bundle == "-":
        yield sys.stdin.buffer
    elif isinstance(bundle, (str, os.PathLike)):
        with open(bundle, "rb") as f:
            yield f
    else:
        yield bundle


def _bytes_left(raw: IO[bytes]) -> int | None:
    """The bytes of the bundle from where it is read if it is a regular file (a path, or stdin redirected
    from one); None for a pipe or a file object without a descriptor."""
    try:
        status = os.fstat(raw.fileno())
        position = raw.tell()
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return None
    return status.st_size - position if stat.S_ISREG(status.st_mode) else None


class _Arriving(io.RawIOBase):
    """The bundle's input as tarfile reads it: a read returns what has arrived (a block at least, until the
    end), not a full buffer, so that a bundle coming through a slow pipe is checked and written as it comes.
    ``head`` looks at the first bytes before tarfile does (they are read again)."""

    def __init__(self, raw: IO[bytes]):
        super().__init__()
        self._raw = raw
        self._read1 = getattr(raw, "read1", raw.read)
        self._pending = b""

    def readable(self) -> bool:
        return True

    def head(self, size: int) -> bytes:
        """The first ``size`` bytes of the input (fewer if it is shorter), left to be read."""
        while len(self._pending) < size and (part := self._read1(size - len(self._pending))):
            self._pending += part
        return self._pending[:size]

    def read(self, size: int = -1) -> bytes:
        if size < 0:
            data, self._pending = self._pending + self._raw.read(), b""
            return data
        parts, got = [], 0
        if self._pending:
            parts.append(self._pending[:size])
            self._pending = self._pending[size:]
            got = len(parts[0])
        while got < min(size, tarfile.BLOCKSIZE):
            part = self._read1(size - got)
            if not part:
                break
            parts.append(part)
            got += len(part)
        return b"".join(parts)


class _Spool:
    """What an import holds until its commit (manifests, assets), in a local temporary file rather than in
    memory: a bundle of many versions or large assets costs disk, not memory."""

    def __init__(self) -> None:
        self._file = tempfile.TemporaryFile(prefix="ckptstream-import-")
        self._end = 0

    def add(self, chunks: Iterable[bytes]) -> tuple[int, int]:
        """Append ``chunks``; returns where they are (offset, length)."""
        start = self._end
        self._file.seek(start)
        for chunk in chunks:
            self._file.write(chunk)
            self._end += len(chunk)
        return start, self._end - start

    def get(self, span: tuple[int, int]) -> bytes:
        self._file.seek(span[0])
        return self._file.read(span[1])

    def close(self) -> None:
        self._file.close()


class _HeldAssets(Mapping[str, bytes]):
    """The assets an import holds, by name, read back from its spool one at a time (what ``adopt_stream``
    takes)."""

    def __init__(self, spool: _Spool, spans: dict[str, tuple[int, int]]):
        self._spool, self._spans = spool, spans

    def __getitem__(self, name: str) -> bytes:
        return self._spool.get(self._spans[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self._spans)

    def __len__(self) -> int:
        return len(self._spans)


@dataclass(frozen=True)
class _HeldManifest:
    """A verified manifest the import will commit: its bytes in the spool, and the manifest without its
    tensors (what the checks of later members need; the whole manifest is parsed again to commit it)."""

    header: Manifest
    span: tuple[int, int]


class _Importer:
    """One import: the members read so far and what they hold until the commit."""

    def __init__(self, dst: Storage, name: str, progress: Progress | None):
        self.dst = Destination(dst)
        self.name = name
        self.progress = progress
        self.bytes_read = 0
        self.bytes_written = 0
        self._committed: dict[int, Manifest | None] = {}
        self._spool = _Spool()
        self._size: int | None = None  # the bundle's bytes, where it is a regular file
        self._written: dict[int, list[str]] = {}  # per version not committed yet, the data files this import wrote
        # At the destination, from its first member to the end, a lease on each version carried (so a gc there
        # keeps its files while uncommitted) and on each base there a carried delta needs.
        self._holder = f"import {os.getpid()}"
        self._leases = self.dst.leases(self._holder)
        self._bases = contextlib.ExitStack()

    def run(self, raw: IO[bytes]) -> tuple[list[int], list[int]]:
        """Read and check the whole bundle, then commit; returns (committed, skipped) versions. A refusal (or
        any failure) removes the data files this import wrote for versions it has not committed."""
        try:
            return self._run(raw)
        except BaseException:
            self._discard()
            raise
        finally:
            self._spool.close()
            self._bases.close()
            self._leases.close()

    def _run(self, raw: IO[bytes]) -> tuple[list[int], list[int]]:
        self._size = _bytes_left(raw)
        source = _Arriving(raw)
        self.check_plain(source.head(_SNIFF_BYTES))
        try:
            tar = tarfile.open(fileobj=source, mode="r|", bufsize=_TAR_READ_BUFFER)
        except (tarfile.TarError, EOFError, OSError) as exc:
            raise self.refuse(f"not a tar archive ({exc})", BUNDLE_INDEX_FILE) from None
        with tar:
            index = self.read_index(tar)
            self.check_destination(index)
            raw_info = b""
            assets: dict[str, tuple[int, int]] = {}
            manifests: dict[int, _HeldManifest] = {}  # in archive order: ascending
            data_entries: dict[int, list[FileEntry]] = {v: [] for v in index.versions}
            for entry in index.members:
                member = self.next_member(tar, entry.name, entry.size)
                directory, _, rest = entry.name.partition("/")
                if entry.name == STREAM_FILE:
                    raw_info = self.read_small(tar, member, entry, MAX_STREAM_FILE_BYTES)
                    self.check_stream_info(raw_info, index)
                elif directory == MANIFESTS_DIR:
                    version = parse_version_name(rest)
                    self._leases.add(version)
                    manifests[version] = self.read_manifest(tar, member, entry, version, index,
                                                            data_entries[version], manifests)
                elif directory == VERSIONS_DIR:
                    version = parse_version_name(rest.partition("/")[0])
                    self._leases.add(version)  # before any of its data is written
                    self.read_data(tar, member, entry, version, index.stream_id)
                    data_entries[version].append(FileEntry(rest.partition("/")[2], entry.size, entry.hash))
                else:  # an asset: listed in stream.json with this size and hash (check_stream_info)
                    assets[rest] = self.read_asset(tar, member, entry)
            self.check_end(tar)
        # Everything verified: now, and only now, the stream and its versions appear at the destination.
        adopt_stream(self.dst.storage, raw_info, _HeldAssets(self._spool, assets))
        committed, skipped = [], []
        for version, held in manifests.items():
            raw_manifest = self._spool.get(held.span)
            if self.dst.check_same(version, raw_manifest):  # committed meanwhile, maybe with the files written
                self._written.pop(version, None)
                skipped.append(version)
                continue
            manifest = Manifest.from_bytes(raw_manifest, version=version, stream_id=index.stream_id)
            try:
                self.dst.commit(manifest, raw_manifest)
            except CommitOutcomeUnknownError:
                self._written.pop(version, None)  # maybe committed: its data files MUST stay (FORMAT.md)
                raise
            self._written.pop(version, None)
            committed.append(version)
        log.info("imported %s into %s: committed %s, already there %s", self.name, redact(self.dst.storage.url),
                 committed, skipped)
        return committed, skipped

    def _discard(self) -> None:
        """Remove the data files this import wrote for versions it did not commit (the destination is left as
        it was; files it found there stay)."""
        paths = [path for version, written in self._written.items() for path in written
                 if self.dst.committed(version) is None]  # another copy may have committed it with them
        for path in paths:
            try:
                self.dst.storage.delete(path)
            except Exception as exc:  # noqa: BLE001 - the refusal is the error to report; this one is logged
                log.warning("could not remove %s, written by the refused import (%s); gc removes it as debris",
                            path, exc)
        if paths:
            log.info("removed the %d data file(s) the refused import had written to %s", len(paths),
                     redact(self.dst.storage.url))
        self._written.clear()

    def refuse(self, message: str, member: str | None, version: int | None = None, *,
               hint: str = "The bundle is truncated, damaged or tampered with: export it again") -> IntegrityError:
        return IntegrityError(f"bundle {self.name}: {message}; nothing was committed", version=version, file=member,
                              hint=hint)

    # ------------------------------------------------------------------------------------------ members

    def check_plain(self, head: bytes) -> None:
        """Refuse a compressed archive at its first bytes: a bundle is a plain tar (FORMAT.md, "Bundles"),
        whose every declared byte is a byte that came, while a few bytes of gzip can stand for any number."""
        for magic, compression, command in _COMPRESSIONS:
            if head.startswith(magic):
                raise self.refuse(f"the bundle is compressed ({compression}), not a plain tar archive",
                                  BUNDLE_INDEX_FILE, hint=f"Decompress it first and import the tar, e.g. "
                                                          f"`{command} BUNDLE | ckptstream import - DST`")

    def check_stream_info(self, raw_info: bytes, index: BundleIndex) -> None:
        """``stream.json`` is the index's stream, and the bundle carries exactly its assets, each with the size
        and hash it lists (so that no asset is read that the stream does not have)."""
        try:
            info = StreamInfo.from_bytes(raw_info)
        except IntegrityError as exc:
            raise self.refuse(f"stream.json is invalid ({exc})", STREAM_FILE) from None
        if info.stream_id != index.stream_id:
            raise self.refuse("stream.json is of another stream than the index says", STREAM_FILE)
        listed = {asset_path(a.name): a for a in info.assets}
        carried = [e for e in index.members if e.name.partition("/")[0] == ASSETS_DIR]
        for entry in carried:
            asset = listed.get(entry.name)
            if asset is None:
                raise self.refuse("this asset is not listed in stream.json", entry.name)
            if (asset.size, asset.hash) != (entry.size, entry.hash):
                raise self.refuse("the index gives this asset another size or hash than stream.json", entry.name)
        missing = sorted(set(listed) - {e.name for e in carried})
        if missing:
            raise self.refuse("stream.json lists this asset and the bundle does not carry it", missing[0])

    def read_index(self, tar: tarfile.TarFile) -> BundleIndex:
        member = self.next_member(tar, BUNDLE_INDEX_FILE)
        return BundleIndex.from_bytes(self.read_member(tar, member, MAX_BUNDLE_INDEX_BYTES))

    def next_member(self, tar: tarfile.TarFile, name: str, size: int | None = None) -> tarfile.TarInfo:
        """The next member, which must be a regular file called ``name`` (of ``size`` bytes, if given)."""
        try:
            member = tar.next()
        except (tarfile.TarError, EOFError, OSError) as exc:
            raise self.refuse(f"the archive is damaged or truncated before member {name} ({exc})", name) from None
        if member is None:
            raise self.refuse(f"the archive ends before member {name} (truncated)", name)
        if not member.isreg():
            raise self.refuse(f"member {member.name!r} is not a regular file (a link, directory or device)",
                              member.name)
        if member.name != name:
            raise self.refuse(f"member {member.name!r} is not the next member of the index ({name}): out of "
                              f"order or not in the bundle", member.name)
        if size is not None and member.size != size:
            raise self.refuse(f"member has {member.size} bytes, the index says {size}", member.name)
        if self._size is not None and member.offset_data + member.size > self._size:
            # A plain tar holds every byte it declares: refused before any of them is read or written.
            raise self.refuse(f"the archive is truncated inside this member: it declares {member.size} bytes, the "
                              f"bundle ends {max(0, self._size - member.offset_data)} bytes into them", member.name)
        return member

    def chunks(self, tar: tarfile.TarFile, member: tarfile.TarInfo) -> Iterator[bytes]:
        """The member's bytes in pieces of at most ``_TAR_READ_BUFFER`` (a truncated archive: IntegrityError)."""
        source = tar.extractfile(member)
        assert source is not None  # a regular file, checked by next_member
        left = member.size
        while left:
            try:
                chunk = source.read(min(left, _TAR_READ_BUFFER))
            except (tarfile.TarError, EOFError, OSError) as exc:
                raise self.refuse(f"the archive is truncated or damaged inside this member ({exc})",
                                  member.name) from None
            if not chunk:
                raise self.refuse("the archive is truncated inside this member", member.name)
            left -= len(chunk)
            self.bytes_read += len(chunk)
            if self.progress:
                self.progress(len(chunk))
            yield chunk

    def read_member(self, tar: tarfile.TarFile, member: tarfile.TarInfo, limit: int) -> bytes:
        if member.size > limit:
            raise self.refuse(f"member has {member.size} bytes, over the {limit} limit of its kind", member.name)
        return b"".join(self.chunks(tar, member))

    def read_small(self, tar: tarfile.TarFile, member: tarfile.TarInfo, entry: FileEntry, limit: int,
                   version: int | None = None) -> bytes:
        """A small member whole (stream.json, a manifest), checked against the index."""
        data = self.read_member(tar, member, limit)
        if content_hash(data) != entry.hash:
            raise self.refuse("member does not match the index's hash", member.name, version)
        return data

    def read_asset(self, tar: tarfile.TarFile, member: tarfile.TarInfo, entry: FileEntry) -> tuple[int, int]:
        """An asset, checked against the index as it passes into the spool (its size is stream.json's, within
        ``MAX_ASSET_BYTES``); returns where it is held."""
        hasher = Hasher()

        def hashed() -> Iterator[bytes]:
            for chunk in self.chunks(tar, member):
                hasher.update(chunk)
                yield chunk

        span = self._spool.add(hashed())
        if hasher.digest() != entry.hash:
            raise self.refuse("member does not match the index's hash", member.name)
        return span

    def read_data(self, tar: tarfile.TarFile, member: tarfile.TarInfo, entry: FileEntry, version: int,
                  stream_id: str) -> None:
        """A data file: written at the destination (under its name only once verified) unless it is there.
        Never one of a version the destination has committed: the bundle's manifest, which would say whether
        the index is right about it, comes later."""
        name = entry.name.rpartition("/")[2]
        path = data_path(version, name)
        committed = self.committed_manifest(version, stream_id)
        if committed is not None and FileEntry(name, entry.size, entry.hash) not in committed.files:
            raise VersionConflictError("the destination holds a different version of this number (its files "
                                       "differ from the bundle's)", version=version, file=path,
                                       hint="The two stores hold diverged streams; import into an empty location")
        if committed is not None or self.dst.reuses(version, FileEntry(name, entry.size, entry.hash)):
            hasher = Hasher()  # the destination's copy stays; the bundle's must still be the index's
            for chunk in self.chunks(tar, member):
                hasher.update(chunk)
            if hasher.digest() != entry.hash:
                raise self.refuse("member does not match the index's hash", member.name, version)
            return
        source = f"{self.name}:{member.name}"
        try:
            self.bytes_written += write_verified(self.dst.storage, path, self.chunks(tar, member), entry,
                                                 version=version, source=source)
        except IntegrityError as exc:
            if exc.file != source:  # a refusal of the archive itself (truncated), worded for the bundle already
                raise
            raise self.refuse("member does not match the index's size and hash", member.name, version) from None
        self._written.setdefault(version, []).append(path)

    def committed_manifest(self, version: int, stream_id: str) -> Manifest | None:
        """The destination's manifest of ``version``, if it has committed one (read once per version)."""
        if version not in self._committed:
            raw = self.dst.committed(version)
            self._committed[version] = (None if raw is None else
                                        Manifest.from_bytes(raw, version=version, stream_id=stream_id))
        return self._committed[version]

    def read_manifest(self, tar: tarfile.TarFile, member: tarfile.TarInfo, entry: FileEntry, version: int,
                      index: BundleIndex, data: list[FileEntry],
                      held: Mapping[int, _HeldManifest]) -> _HeldManifest:
        """A manifest, checked against the index, its data members, the destination's copy if any and its
        base (``held``: the manifests read before it); held in the spool until the commit."""
        raw = self.read_small(tar, member, entry, MAX_MANIFEST_BYTES, version)
        try:
            manifest = Manifest.from_bytes(raw, version=version, stream_id=index.stream_id)
        except IntegrityError as exc:
            raise self.refuse(f"the manifest is invalid ({exc})", member.name, version) from None
        if sorted(manifest.files, key=lambda f: f.name) != data:
            raise self.refuse("the manifest lists other data files than the bundle carries", member.name, version)
        self.dst.check_same(version, raw)  # a different version of this number there: refuse now, exit 5
        self.check_chain(manifest, index, held)
        return _HeldManifest(dataclasses.replace(manifest, tensors=()), self._spool.add([raw]))

    def check_chain(self, manifest: Manifest, index: BundleIndex, held: Mapping[int, _HeldManifest]) -> None:
        """A delta's base is carried (``held``, read earlier: bases come first) or at the destination, where
        it is leased until the end (its chain checked there), and the delta agrees with it (reader obligation
        5: keyframe and chain length), all before anything is committed."""
        base = manifest.base_version
        if base is None:
            return
        if base in index.versions:
            base_manifest = held[base].header
        elif self.dst.committed(base) is None:
            raise MissingBaseError(f"the bundle carries delta version {manifest.version} without this base, and "
                                   f"the destination lacks it", version=base, file=manifest_path(base),
                                   hint="Export the versions with their bases (ckptstream export brings them)")
        else:
            self._bases.enter_context(self.dst.lease_base(manifest, self._holder))  # kept there until the commit
            base_manifest = self.dst.stream.manifest(base)
        try:
            check_base(manifest, base_manifest)
        except IntegrityError as exc:
            raise self.refuse(f"the delta contradicts its base ({exc})", manifest_path(manifest.version),
                              manifest.version) from None

    def check_end(self, tar: tarfile.TarFile) -> None:
        """After the last member only the end-of-archive marker (two zero blocks) and zero padding may follow.

        ``tarfile`` takes a missing marker, a short read or garbage after the last member for the end of
        the archive, so the bytes are checked here, read from the archive's own stream.
        """
        stream = tar.fileobj
        stream.seek(tar.offset)  # the end of the last member's data, padded
        marker = stream.read(2 * tarfile.BLOCKSIZE)
        if marker != tarfile.NUL * 2 * tarfile.BLOCKSIZE:
            raise self.refuse(self._after_last(marker), None)
        while chunk := stream.read(_TAR_READ_BUFFER):
            if chunk.count(tarfile.NUL) != len(chunk):
                raise self.refuse("data follows the end-of-archive marker", None)

    def _after_last(self, block: bytes) -> str:
        if len(block) < 2 * tarfile.BLOCKSIZE and not block.strip(tarfile.NUL):
            return "the archive ends without its end-of-archive marker (truncated)"
        try:
            name = tarfile.TarInfo.frombuf(block[:tarfile.BLOCKSIZE], "utf-8", "surrogateescape").name
        except tarfile.HeaderError:
            return "unexpected data after the last member of the index"
        return f"member {name!r} follows the last member of the index (an extra member)"

    # ----------------------------------------------------------------------------------- destination

    def check_destination(self, index: BundleIndex) -> None:
        """Before any write: the destination holds no other stream, and an incremental bundle's chain."""
        held = read_stream_info(self.dst.storage)
        if held is not None and held.stream_id != index.stream_id:
            raise ForeignStreamError(f"{self.dst.storage.url} holds stream {held.stream_id}, the bundle carries "
                                     f"{index.stream_id}", file=STREAM_FILE,
                                     hint="Import into an empty location or into a copy of the same stream")
        for version, manifest_hash in index.requires:
            raw = self.dst.committed(version)
            if raw is None:
                raise MissingBaseError(
                    f"the bundle is incremental (since version {index.since}) and the destination lacks this "
                    f"version of its chain", version=version, file=manifest_path(version),
                    hint="Import a full bundle first, or export one --since a version the destination holds")
            if content_hash(raw) != manifest_hash:
                raise VersionConflictError("the destination holds another version of this number than the "
                                           "bundle's chain", version=version, file=manifest_path(version),
                                           hint="The two stores hold diverged streams; import into an empty "
                                                "location")
