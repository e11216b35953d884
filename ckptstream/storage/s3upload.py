"""Writing one S3 object with its parts uploaded concurrently: the file object of ``FsspecStorage.open_write``
on S3, through which the publisher, ``mirror`` and ``import`` write data files.

s3fs's own file object uploads each part on the writing thread, one after another, so the writer waits for
every part; ``put_file`` of the same bytes uploads its parts concurrently. Here ``write`` copies into the
current part and hands each full part to upload threads, at most ``max_concurrency`` at a time (s3fs's option,
default 10), so the caller goes on filling the next part and memory stays bounded.
"""

from __future__ import annotations

import contextlib
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

PART_BYTES = 16 << 20
"""Size of every part but the last. All equal (Cloudflare R2 requires it) and at least S3's 5 MiB minimum;
two ``RANGE_CHUNK_BYTES``, so that the chunks a copy reads fill parts whole."""
MAX_PARTS = 10_000
"""S3's limit on the parts of one upload: objects up to ``PART_BYTES * MAX_PARTS`` (156 GiB)."""
_PART_CHECKSUMS = ("ChecksumSHA256",)
"""Fields of an UploadPart answer that the completion repeats: those s3fs's own file object repeats (an upload
begun with ``ChecksumAlgorithm=SHA256`` needs them; botocore's default CRC32 of each request is no part of it)."""


class MultipartWriter:
    """A write-only file object for the S3 object at ``path`` of the s3fs file system ``fs``.

    The object appears only when :meth:`close` completes the upload (an object no larger than one part is
    one PUT); :meth:`discard` aborts it, and nothing appears. Not an ``io.IOBase``, whose finalizer would
    close, and so complete, an upload abandoned half-written. Not thread-safe: one writer per object.
    """

    def __init__(self, fs: Any, path: str, *, part_bytes: int = PART_BYTES, max_concurrency: int | None = None):
        self._fs = fs
        self._path = path
        self._bucket, self._key, _ = fs.split_path(path)
        self._part_bytes = part_bytes
        self._concurrency = max(1, max_concurrency or getattr(fs, "max_concurrency", 1))
        self._part = bytearray(part_bytes)
        self._filled = 0
        self._sent = 0  # bytes handed to parts
        self._upload_id: str | None = None
        self._pool = ThreadPoolExecutor(self._concurrency, thread_name_prefix="ckptstream-upload")  # threads lazily
        self._parts: list[Future[dict[str, Any]]] = []
        self._in_flight: deque[Future[dict[str, Any]]] = deque()
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> int:
        """Copy ``data`` into the object's parts (any buffer; it may be reused once this returns)."""
        if self.closed:
            raise ValueError("write to a closed file")
        view = memoryview(data).cast("B")
        size = len(view)
        while view:
            if self._filled == self._part_bytes:  # sent only once more bytes come: the last part waits for close
                self._send_part()
            take = min(len(view), self._part_bytes - self._filled)
            self._part[self._filled:self._filled + take] = view[:take]
            self._filled += take
            view = view[take:]
        return size

    def flush(self) -> None:
        """Nothing to do: full parts are sent as they fill, the rest only by :meth:`close`."""

    def tell(self) -> int:
        """Bytes written so far."""
        return self._sent + self._filled

    def close(self) -> None:
        """Upload what remains and complete the upload: the object appears. On failure nothing does."""
        if self.closed:
            return
        try:
            if self._upload_id is None:
                self._call("put_object", Body=bytes(memoryview(self._part)[:self._filled]))
            else:
                if self._filled:
                    self._send_part()
                parts = [part.result() for part in self._parts]
                self._call("complete_multipart_upload", UploadId=self._upload_id, MultipartUpload={"Parts": parts})
        except BaseException:
            self.discard()
            raise
        self._finish()
        self._fs.invalidate_cache(self._path)

    def discard(self) -> None:
        """Abort the upload: nothing appears, and the parts sent are dropped by the store."""
        if self.closed:
            return
        for part in self._parts:
            part.cancel()
        self._finish()  # waits for the parts being uploaded, so that none lands after the abort
        if self._upload_id is not None:
            with contextlib.suppress(Exception):  # the store drops an unfinished upload's parts on its own too
                self._call("abort_multipart_upload", UploadId=self._upload_id)

    def __enter__(self) -> MultipartWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.discard()

    # ------------------------------------------------------------------------------------------ parts

    def _send_part(self) -> None:
        """Hand the current part to an upload thread (starting the upload at the first), after waiting for
        the oldest part in flight where ``max_concurrency`` are."""
        if self._upload_id is None:
            self._upload_id = self._call("create_multipart_upload")["UploadId"]
        if len(self._parts) == MAX_PARTS:
            raise OSError(f"{self._path}: over {MAX_PARTS} parts of {self._part_bytes} bytes, the most one S3 upload "
                          "takes; write smaller files (shard_bytes)")
        while len(self._in_flight) >= self._concurrency:
            self._in_flight.popleft().result()  # raises the failure of a part
        body = self._part if self._filled == self._part_bytes else bytes(memoryview(self._part)[:self._filled])
        part = self._pool.submit(self._upload_part, len(self._parts) + 1, body)
        self._parts.append(part)
        self._in_flight.append(part)
        self._sent += self._filled
        self._part = bytearray(self._part_bytes)
        self._filled = 0

    def _upload_part(self, number: int, body: bytes | bytearray) -> dict[str, Any]:
        answer = self._call("upload_part", UploadId=self._upload_id, PartNumber=number, Body=body)
        return {"PartNumber": number, "ETag": answer["ETag"], **{k: answer[k] for k in _PART_CHECKSUMS if k in answer}}

    def _call(self, method: str, **kwargs: Any) -> dict[str, Any]:
        return self._fs.call_s3(method, Bucket=self._bucket, Key=self._key, **kwargs)

    def _finish(self) -> None:
        self.closed = True
        self._part = bytearray()
        self._pool.shutdown(wait=True)
