"""A stream on an fsspec file system: S3 through s3fs, or any other fsspec protocol.

This module never imports fsspec itself (it is handed a file system), so importing the package stays cheap.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
from collections.abc import Iterator, Sequence
from http import HTTPStatus
from typing import IO, Any

from ..errors import StorageCapabilityError
from .base import MAX_CONCURRENT_READS, Capabilities, Entry, Storage, check_ranges, short_read, temp_name
from .s3upload import MultipartWriter

# Object stores whose fsspec backend turns open(path, "xb") into an atomic put-if-absent (s3fs sends a PUT
# with If-None-Match: *), and whose objects appear only when their (multipart) upload completes, so a
# file can be written under its final name directly.
_CONDITIONAL_PUT_PROTOCOLS = ("s3", "s3a")
_MAX_COPY_OBJECT_BYTES = 5 << 30
"""The largest object S3 copies in one CopyObject request; larger ones are copied part by part."""
FS_OPTIONS = {"use_listings_cache": False}
"""Options the file system of a stream is opened with (over the caller's): no cache of directory listings,
because other writers change the store. With one, a whole-file read whose size s3fs takes from a listing
made earlier (a publisher lists ``manifests/`` to number a version) finds a manifest committed since then
missing: a commit's read-back would miss the winner's manifest, or its own."""


class FsspecStorage(Storage):
    """An fsspec file system (S3 through s3fs). Commits with ``open(path, "xb")``: a conditional PUT.

    On other file systems (``memory://``, ...) files are written under a temporary name and moved into
    place, and ``put_if_absent`` is refused: their exclusive create is a check-then-write.
    """

    def __init__(self, fs: Any, root: str, url: str):
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url
        protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
        self._object_store = any(p in _CONDITIONAL_PUT_PROTOCOLS for p in protocols)
        self.capabilities = Capabilities(put_if_absent=self._object_store)

    def _abs(self, path: str) -> str:
        return f"{self.root}/{path}" if path else self.root

    # ------------------------------------------------------------------------------------------ reading

    def read(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        full = self._abs(path)
        if start is not None and end is not None and end <= start:
            self.fs.info(full)  # FileNotFoundError as for any read; an empty range is not a request (s3fs
            return b""  # sends one without a Range header and returns the whole object)
        try:
            return self.fs.cat_file(full, start=start, end=end)
        except OSError as exc:
            # A range that starts at or past the end of the file (an empty one's too, from 0): S3 answers 416
            # where a file gives b"".
            if exc.errno == errno.EINVAL and (start or 0) >= self.size(path):
                return b""
            raise

    def read_ranges(self, path: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        if not self.fs.async_impl:
            return super().read_ranges(path, ranges)  # threads over read()
        check_ranges(ranges)
        wanted = [i for i, (start, end) in enumerate(ranges) if end > start]
        out = [b""] * len(ranges)
        try:
            got = self.fs.cat_ranges([self._abs(path)] * len(wanted), [ranges[i][0] for i in wanted],
                                     [ranges[i][1] for i in wanted], batch_size=MAX_CONCURRENT_READS,
                                     on_error="raise")
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            size = self.size(path)  # S3's 416: a range starts at or past the end of the file
            past = [ranges[i] for i in wanted if ranges[i][0] >= size]
            if not past:
                raise
            raise short_read(path, past[0][0], past[0][1] - past[0][0], 0) from None
        for i, data in zip(wanted, got):
            start, end = ranges[i]
            if len(data) != end - start:
                raise short_read(path, start, end - start, len(data))
            out[i] = data
        return out

    def read_ranges_into(self, path: str, targets: Sequence[tuple[int, memoryview]]) -> None:
        datas = self.read_ranges(path, [(offset, offset + len(buffer)) for offset, buffer in targets])
        for (_, buffer), data in zip(targets, datas):
            buffer[:] = data

    def open_read(self, path: str) -> IO[bytes]:
        return self.fs.open(self._abs(path), "rb", block_size=8 << 20, cache_type="readahead")

    # ------------------------------------------------------------------------------------------ writing

    @contextlib.contextmanager
    def open_write(self, path: str) -> Iterator[IO[bytes]]:
        final = self._abs(path)
        if self._object_store:
            # An object appears only when its (multipart) upload completes, so the final name is safe to use.
            with MultipartWriter(self.fs, final) as f:
                yield f  # type: ignore[misc]  # a write-only file object
            return
        # Elsewhere (memory://: a file is visible as soon as it is opened) write aside and move into place.
        directory, _, name = final.rpartition("/")
        target = f"{directory}/{temp_name(name)}"
        f = self.fs.open(target, "wb")
        try:
            yield f
        except BaseException:
            with contextlib.suppress(Exception):
                f.discard()  # drop what is buffered
                f.closed = True
            with contextlib.suppress(Exception):
                f.close()
                self.fs.rm_file(target)
            raise
        f.close()
        self.fs.mv(target, final)

    def put_if_absent(self, path: str, data: bytes) -> None:
        if not self.capabilities.put_if_absent:
            raise StorageCapabilityError(
                f"storage {self.url} has no atomic put-if-absent, so concurrent commits could be lost",
                file=path, hint="Use a POSIX path or an S3-compatible object store")
        try:
            with self.fs.open(self._abs(path), "xb") as f:  # s3fs: PUT with If-None-Match: *
                f.write(data)
        except OSError as exc:
            if isinstance(exc, FileExistsError) or not _precondition_failed(exc):
                raise
            # s3fs makes a 412 a FileExistsError only when the server names the failed condition; the
            # If-None-Match: * of this PUT is the only condition it carries.
            raise FileExistsError(errno.EEXIST, f"{path} exists ({exc})", self._abs(path)) from exc

    def touch(self, path: str) -> None:
        if not self._object_store:
            super().touch(path)  # written again, aside and moved into place
            return
        # An object's LastModified is its last write, and S3 has no utime: the object is copied onto itself
        # on the server (its bytes never travel), in one CopyObject with its metadata replaced (S3 refuses
        # a copy onto itself that changes nothing), or, above 5 GiB, part by part (s3fs's managed copy).
        full = self._abs(path)
        if self.size(path) <= _MAX_COPY_OBJECT_BYTES:
            self.fs.setxattr(full)
        else:
            self.fs.copy(full, full)
        self.fs.invalidate_cache(full)

    # ------------------------------------------------------------------------------------------ metadata

    def list(self, path: str) -> list[Entry]:
        full = self._abs(path)
        self.fs.invalidate_cache(full)
        try:
            items = self.fs.ls(full, detail=True)
        except FileNotFoundError:
            return []
        entries = []
        for item in items:
            name = item["name"].rstrip("/").rsplit("/", 1)[-1]
            if item["name"].rstrip("/") == full:
                continue
            # S3 says LastModified, local-like file systems mtime, memory:// only created.
            modified = item.get("LastModified") or item.get("mtime") or item.get("created")
            if isinstance(modified, _dt.datetime):
                modified = modified.timestamp()
            entries.append(Entry(name, item["type"] == "directory", int(item.get("size") or 0), modified))
        return entries

    def size(self, path: str) -> int:
        self.fs.invalidate_cache(self._abs(path))
        return int(self.fs.info(self._abs(path))["size"])

    def exists(self, path: str) -> bool:
        full = self._abs(path)
        self.fs.invalidate_cache(full)
        return bool(self.fs.isfile(full))

    def delete(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._abs(path))

    def delete_tree(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self._abs(path), recursive=True)


def _precondition_failed(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or what it was translated from: s3fs keeps botocore's ClientError as the cause) is
    an HTTP 412, the answer to a conditional request whose condition did not hold."""
    while exc is not None:
        response = getattr(exc, "response", None)
        if isinstance(response, dict):
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            code = response.get("Error", {}).get("Code")
            if status == HTTPStatus.PRECONDITION_FAILED or code == "PreconditionFailed":
                return True
        exc = exc.__cause__
    return False
