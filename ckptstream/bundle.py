"""Air-gapped bundles: committed versions of a stream carried as one tar file (FORMAT.md, "Bundles").

``export_bundle`` writes the versions asked for, every base their chains need, ``stream.json`` and the
assets, in a fixed member order with fixed metadata (the same stream and versions give the same bytes),
after an index listing every member's size and hash. ``import_bundle`` reads a bundle sequentially (a pipe
will do), checks every member against the index as it passes, writes data files at the destination only
under verified names (invisible without their manifests), and commits the manifests, in order and through
put-if-absent, only once the whole archive has verified. Both stream with bounded memory: a file moves in
pieces (``RANGE_CHUNK_BYTES`` read from the source, ``_TAR_READ_BUFFER`` from the archive), never whole.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import tarfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Union

from .errors import ForeignStreamError, IntegrityError, MissingBaseError, VersionConflictError, VersionNotFoundError
from .format import (BUNDLE_INDEX_FILE, MANIFESTS_DIR, MAX_BUNDLE_INDEX_BYTES, MAX_FILE_BYTES, MAX_MANIFEST_BYTES,
                     MAX_STREAM_FILE_BYTES, STREAM_FILE, VERSIONS_DIR, BundleIndex, FileEntry, Hasher, Manifest,
                     StreamInfo, asset_path, content_hash, data_path, manifest_path, parse_version_name)
from .reader import Stream
from .storage import RANGE_CHUNK_BYTES, Storage, temp_name
from .transfer import Destination, holds_file, versions_to_carry, write_verified
from .writer.commit import adopt_stream, read_stream_info

log = logging.getLogger("ckptstream.bundle")

Progress = Callable[[int], None]
BundleFile = Union[str, "os.PathLike[str]", IO[bytes]]
"""Where a bundle is: a path, ``-`` for stdout (export) or stdin (import), or an open binary file object."""

_TAR_READ_BUFFER = 1 << 20
"""Bytes an import reads from the archive at once (tarfile's default, 10 KiB, is slow), and the piece of a
member it checks and writes at once: the input is sequential, so larger pieces would buy nothing but memory."""


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
    log.info("exported versions %s of %s (%d members, %d bytes)", list(carried), stream.url, report.members,
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
    names only once verified (invisible without their manifests); ``stream.json``, the assets and the
    manifests are held until the archive has been read to its end, then the stream is adopted and the
    manifests committed in order through put-if-absent. Run again after an interruption, it keeps the data
    files the destination holds (checked by size and hash) and skips versions it holds with the same
    manifest bytes.

    Args:
        bundle: a path, ``-`` for stdin, or a binary file object (read sequentially; a pipe will do).
        dst_storage: the destination stream's storage.
        progress: called with the number of member bytes as they are read.

    Raises:
        IntegrityError: a truncated, reordered or tampered bundle, naming the member; nothing committed.
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


class _Arriving(io.RawIOBase):
    """The bundle's input as tarfile reads it: a read returns what has arrived (a block at least, until the
    end), not a full buffer, so that a bundle coming through a slow pipe is checked and written as it comes."""

    def __init__(self, raw: IO[bytes]):
        super().__init__()
        self._raw = raw
        self._read1 = getattr(raw, "read1", raw.read)

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        if size < 0:
            return self._raw.read()
        parts, got = [], 0
        while got < min(size, tarfile.BLOCKSIZE):
            part = self._read1(size - got)
            if not part:
                break
            parts.append(part)
            got += len(part)
        return b"".join(parts)


class _Importer:
    """One import: the members read so far and what they hold until the commit."""

    def __init__(self, dst: Storage, name: str, progress: Progress | None):
        self.dst = Destination(dst)
        self.name = name
        self.progress = progress
        self.bytes_read = 0
        self.bytes_written = 0
        self._committed: dict[int, Manifest | None] = {}

    def run(self, raw: IO[bytes]) -> tuple[list[int], list[int]]:
        """Read and check the whole bundle, then commit; returns (committed, skipped) versions."""
        try:
            tar = tarfile.open(fileobj=_Arriving(raw), mode="r|*", bufsize=_TAR_READ_BUFFER)
        except (tarfile.TarError, EOFError, OSError) as exc:
            raise self.refuse(f"not a tar archive ({exc})", BUNDLE_INDEX_FILE) from None
        with tar:
            index = self.read_index(tar)
            self.check_destination(index)
            raw_info = b""
            assets: dict[str, bytes] = {}
            manifests: list[tuple[Manifest, bytes]] = []
            data_entries: dict[int, list[FileEntry]] = {v: [] for v in index.versions}
            for entry in index.members:
                member = self.next_member(tar, entry.name, entry.size)
                directory, _, rest = entry.name.partition("/")
                if entry.name == STREAM_FILE:
                    raw_info = self.read_small(tar, member, entry, MAX_STREAM_FILE_BYTES)
                    if StreamInfo.from_bytes(raw_info).stream_id != index.stream_id:
                        raise self.refuse("stream.json is of another stream than the index says", entry.name)
                elif directory == MANIFESTS_DIR:
                    version = parse_version_name(rest)
                    manifests.append(self.read_manifest(tar, member, entry, version, index,
                                                        data_entries[version]))
                elif directory == VERSIONS_DIR:
                    version = parse_version_name(rest.partition("/")[0])
                    self.read_data(tar, member, entry, version, index.stream_id)
                    data_entries[version].append(FileEntry(rest.partition("/")[2], entry.size, entry.hash))
                else:  # an asset: small by nature (config, tokenizer), no limit of its own in the format
                    assets[rest] = self.read_small(tar, member, entry, MAX_FILE_BYTES)
            self.check_end(tar)
        # Everything verified: now, and only now, the stream and its versions appear at the destination.
        adopt_stream(self.dst.storage, raw_info, assets)
        committed, skipped = [], []
        for manifest, raw_manifest in manifests:
            if self.dst.check_same(manifest.version, raw_manifest):
                skipped.append(manifest.version)
                continue
            self.dst.commit(manifest, raw_manifest)
            committed.append(manifest.version)
        log.info("imported %s into %s: committed %s, already there %s", self.name, self.dst.storage.url,
                 committed, skipped)
        return committed, skipped

    def refuse(self, message: str, member: str | None, version: int | None = None) -> IntegrityError:
        return IntegrityError(f"bundle {self.name}: {message}; nothing was committed", version=version, file=member,
                              hint="The bundle is truncated, damaged or tampered with: export it again")

    # ------------------------------------------------------------------------------------------ members

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
        """A small member whole (stream.json, an asset, a manifest), checked against the index."""
        data = self.read_member(tar, member, limit)
        if content_hash(data) != entry.hash:
            raise self.refuse("member does not match the index's hash", member.name, version)
        return data

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
        if committed is not None or holds_file(self.dst.storage, path, entry):
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

    def committed_manifest(self, version: int, stream_id: str) -> Manifest | None:
        """The destination's manifest of ``version``, if it has committed one (read once per version)."""
        if version not in self._committed:
            raw = self.dst.committed(version)
            self._committed[version] = (None if raw is None else
                                        Manifest.from_bytes(raw, version=version, stream_id=stream_id))
        return self._committed[version]

    def read_manifest(self, tar: tarfile.TarFile, member: tarfile.TarInfo, entry: FileEntry, version: int,
                      index: BundleIndex, data: list[FileEntry]) -> tuple[Manifest, bytes]:
        """A manifest, checked against the index, its data members and the destination's copy if any."""
        raw = self.read_small(tar, member, entry, MAX_MANIFEST_BYTES, version)
        try:
            manifest = Manifest.from_bytes(raw, version=version, stream_id=index.stream_id)
        except IntegrityError as exc:
            raise self.refuse(f"the manifest is invalid ({exc})", member.name, version) from None
        if sorted(manifest.files, key=lambda f: f.name) != data:
            raise self.refuse("the manifest lists other data files than the bundle carries", member.name, version)
        self.dst.check_same(version, raw)  # a different version of this number there: refuse now, exit 5
        base = manifest.base_version
        if base is not None and base not in index.versions and self.dst.committed(base) is None:
            raise MissingBaseError(f"the bundle carries delta version {version} without this base, and the "
                                   f"destination lacks it", version=base, file=manifest_path(base),
                                   hint="Export the versions with their bases (ckptstream export brings them)")
        return manifest, raw

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
