"""Read-only storage over plain HTTP(S): a stream served by any static file server (nginx, a CDN,
``python -m http.server``, ``ckptstream relay``).

Files are read by GET (byte ranges by ``Range: bytes=a-b``; a server that ignores ``Range`` and answers
200 with the whole body still yields the right bytes), sizes and existence by HEAD. Nothing can be listed
(static servers list directories as HTML, if at all), so readers find versions by probing manifest names
(``reader/probe.py``). Built on urllib3, imported when the first ``HttpStorage`` is made: pooled
keep-alive connections, and urllib3's ``Retry`` for exponential backoff on connection errors, resets,
429 and 5xx, bounded by the ``retries`` storage option. Redirects are followed only within the stream URL's
origin: the token and the ``headers`` option go to no other server.

Storage options: ``token`` (default ``$CKPTSTREAM_HTTP_TOKEN``: sent as ``Authorization: Bearer``),
``headers`` (a dict sent with every request), ``timeout`` (seconds to connect and between bytes),
``retries`` (attempts after the first).
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable, Mapping
from typing import IO, TYPE_CHECKING, Any, TypeVar
from urllib.parse import quote, urljoin, urlsplit

from ..credentials import redact
from ..errors import StorageAccessError, StorageCapabilityError
from .base import (MAX_CONCURRENT_READS, SMALL_READ_BLOCK, Capabilities, Entry, RefusesWrites, Storage,
                   checked_small)

if TYPE_CHECKING:
    import urllib3

TOKEN_ENV = "CKPTSTREAM_HTTP_TOKEN"
"""Environment variable with the bearer token, when the ``token`` storage option is not given."""
DEFAULT_TIMEOUT = 30.0
DEFAULT_RETRIES = 5
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
BACKOFF_FACTOR = 0.25
BACKOFF_MAX = 4.0
"""Seconds between attempts grow 0.5, 1, 2, 4, 4, ...: the default retries give up after about 12 s of
waiting (plus the timeouts of the attempts themselves)."""
MAX_REDIRECTS = 5
STORAGE_OPTIONS = frozenset({"token", "headers", "timeout", "retries"})
_DISCARD_BLOCK = 1 << 20  # reading through a body to the start of a range a server ignored
_DRAIN_LIMIT = 64 << 10  # unread body up to which a connection is drained for reuse rather than closed

_T = TypeVar("_T")


class HttpStorage(RefusesWrites, Storage):
    """A stream at an ``http://`` or ``https://`` URL, read-only.

    ``read_into`` is the base class's: urllib3 copies out of its own buffer in any case.

    Args:
        url: the stream root (``https://host/path/run1``).
        token: bearer token (default ``$CKPTSTREAM_HTTP_TOKEN``; none if neither is set).
        headers: extra headers for every request.
        timeout: seconds to connect, and to wait for each read.
        retries: retries of a failed request (connection error, reset, 429, 5xx), with exponential
            backoff; then a ``StorageAccessError`` naming the URL.
    """

    def __init__(self, url: str, *, token: str | None = None, headers: Mapping[str, str] | None = None,
                 timeout: float = DEFAULT_TIMEOUT, retries: int = DEFAULT_RETRIES):
        try:
            import urllib3
        except ImportError:
            raise StorageCapabilityError(f"reading {url} needs urllib3, which is not installed",
                                         hint="pip install 'ckptstream[http]'") from None

        self._urllib3 = urllib3
        self.url = url.rstrip("/")
        self.capabilities = Capabilities(writable=False, put_if_absent=False, listing=False, ranged_reads=True)
        # identity: a compressed answer would make byte ranges ranges of the compressed bytes.
        self._headers = {"Accept-Encoding": "identity", **dict(headers or {})}
        token = token if token is not None else os.environ.get(TOKEN_ENV)
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._pool = urllib3.PoolManager(maxsize=MAX_CONCURRENT_READS, block=False,
                                         timeout=urllib3.Timeout(connect=timeout, read=timeout))
        self._retry = urllib3.Retry(total=retries, connect=retries, read=retries, status=retries, other=retries,
                                    redirect=False, allowed_methods=frozenset({"GET", "HEAD"}),
                                    status_forcelist=RETRY_STATUSES, backoff_factor=BACKOFF_FACTOR,
                                    backoff_max=BACKOFF_MAX, retry_after_max=int(BACKOFF_MAX * 4))
        self._transient = (urllib3.exceptions.HTTPError, ConnectionError, TimeoutError)

    def file_url(self, path: str) -> str:
        """The URL of a file of the stream."""
        return f"{self.url}/{quote(path.strip('/'))}"

    # ------------------------------------------------------------------------------------------ reading

    def read(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        start = start or 0
        if end is not None and end <= start:
            self.size(path)  # nothing to read, but a missing file is still a FileNotFoundError
            return b""
        if start == 0 and end is None:
            return self._request("GET", path, {}, lambda response: response.read())
        last = "" if end is None else str(end - 1)
        return self._request("GET", path, {"Range": f"bytes={start}-{last}"},
                             lambda response: _range_body(response, self.file_url(path), start, end))

    def read_small(self, path: str, limit: int) -> bytes:
        # One ranged GET, its body read in blocks up to just past the limit: a server that ignores the range,
        # or whose body never ends, is read no further (and urllib3 would allocate a whole read's size at once).
        body = self._request("GET", path, {"Range": f"bytes=0-{limit}"},
                             lambda response: _small_body(response, self.file_url(path), limit + 1))
        return checked_small(path, body, limit)

    def open_read(self, path: str) -> IO[bytes]:
        return io.BufferedReader(_HttpReader(self, path), buffer_size=_DISCARD_BLOCK)

    # ------------------------------------------------------------------------------------------ metadata

    def list(self, path: str) -> list[Entry]:
        raise StorageCapabilityError(f"storage {self.url} (HTTP) cannot list directories", file=path,
                                     hint="Readers of an HTTP stream probe manifest names instead; list the "
                                          "stream where it is stored")

    def size(self, path: str) -> int:
        length = self._request("HEAD", path, {}, lambda response: response.headers.get("Content-Length"))
        if length is not None and length.isdigit():
            return int(length)
        # No length in the HEAD answer (a chunked server): ask for one byte and read the total.
        return self._request("GET", path, {"Range": "bytes=0-0"}, _total_size)

    def exists(self, path: str) -> bool:
        try:
            self._request("HEAD", path, {}, lambda response: None)
        except FileNotFoundError:
            return False
        return True

    # ------------------------------------------------------------------------------------------ requests

    def _request(self, method: str, path: str, headers: Mapping[str, str],
                 consume: Callable[[urllib3.BaseHTTPResponse], _T]) -> _T:
        """``consume(response)`` of a successful answer (2xx, or 416 for a range past the end), retried
        with backoff on connection errors, resets (also in the middle of the body), 429 and 5xx.

        Raises:
            FileNotFoundError: 404 or 410, or a directory (a redirect to a name ending in ``/``).
            StorageAccessError: 401 or 403; another 4xx; or still failing when the retries are spent.
        """
        url = self.file_url(path)
        retry = self._retry
        while True:
            try:
                response = self._send(method, url, path, {**self._headers, **headers})
            except self._transient as exc:
                retry = self._again(retry, method, url, error=exc)
                continue
            keep = False
            try:
                if response.status in RETRY_STATUSES:
                    retry = self._again(retry, method, url, response=response)
                    continue
                _check_status(response, url, path)
                try:
                    result = consume(response)
                except self._transient as exc:  # the connection broke in the middle of the body
                    retry = self._again(retry, method, url, error=exc)
                    continue
                keep = result is response  # a streamed body: its reader releases it
                return result
            finally:
                if not keep:
                    _release(response)

    def _send(self, method: str, url: str, path: str, headers: Mapping[str, str]) -> urllib3.BaseHTTPResponse:
        """One attempt at a request: its answer once redirects (at most ``MAX_REDIRECTS``) are followed.

        Redirects are followed here, not by urllib3, and only within the stream's origin: one to another
        origin would carry the ``headers`` option there (urllib3 strips only ``Authorization`` and cookies)
        and serve another server's bytes as the stream's. Its failures are the caller's to retry.

        Raises:
            FileNotFoundError: a redirect to a name ending in ``/`` (a directory).
            StorageAccessError: a redirect to another origin (scheme, host and port), or too many.
        """
        for _ in range(MAX_REDIRECTS + 1):
            response = self._pool.request(method, url, headers=headers, preload_content=False, retries=False,
                                          redirect=False)
            location = response.get_redirect_location()
            if not location:
                return response
            _release(response)
            target = urljoin(url, location)
            if _origin(target) != _origin(self.url):
                raise StorageAccessError(f"{method} {url} redirects to {target}, another origin: not followed",
                                         file=path, hint="Give the URL the stream is served from: redirects are "
                                                         "followed only within its scheme, host and port")
            if target.endswith("/") and not path.endswith("/"):
                raise FileNotFoundError(f"{redact(url)} is a directory")
            url = target
        raise StorageAccessError(f"{method} {self.file_url(path)}: more than {MAX_REDIRECTS} redirects", file=path,
                                 hint="Give the URL the stream is served from")

    def _again(self, retry: urllib3.Retry, method: str, url: str, *, error: Exception | None = None,
               response: urllib3.BaseHTTPResponse | None = None) -> urllib3.Retry:
        """The retry state after a failed attempt, once its backoff has been slept; a StorageAccessError
        when the retries are spent."""
        try:
            retry = retry.increment(method, url, response=response, error=error)
        except self._urllib3.exceptions.MaxRetryError:
            what = f"HTTP {response.status}" if response is not None else f"{type(error).__name__}: {error}"
            raise StorageAccessError(f"{method} {url} failed after {len(retry.history) + 1} attempts ({what})",
                                     hint="Check that the server is up and reachable from here; the "
                                          "`retries` and `timeout` storage options allow for a slower "
                                          "one") from error
        retry.sleep(response)
        return retry


class _HttpReader(io.RawIOBase):
    """A file's body, streamed by one GET; a connection that breaks part-way resumes by a ranged GET from
    where it stopped (retried like any request)."""

    def __init__(self, storage: HttpStorage, path: str):
        self._storage = storage
        self._path = path
        self._offset = 0
        self._response = self._open()

    def _open(self) -> urllib3.BaseHTTPResponse:
        headers = {"Range": f"bytes={self._offset}-"} if self._offset else {}

        def start(response: urllib3.BaseHTTPResponse) -> urllib3.BaseHTTPResponse:
            if self._offset:
                _discard(response, _range_start(response, self._storage.file_url(self._path), self._offset))
            return response

        return self._storage._request("GET", self._path, headers, start)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        resumes = self._storage._retry.total or 0
        while True:
            try:
                data = self._response.read(len(view))
                break
            except self._storage._transient:
                _release(self._response)
                if resumes <= 0:
                    raise
                resumes -= 1
                self._response = self._open()
        view[:len(data)] = data
        self._offset += len(data)
        return len(data)

    def close(self) -> None:
        if not self.closed:
            _release(self._response)
        super().close()


def _release(response: urllib3.BaseHTTPResponse) -> None:
    """Give the connection back to the pool: drained if little is left unread, else closed (the rest of a
    body whose range the server ignored may be gigabytes)."""
    remaining = response.length_remaining
    if remaining is None or remaining > _DRAIN_LIMIT:
        response.close()
    else:
        with contextlib.suppress(Exception):  # a broken connection: nothing to give back
            response.drain_conn()
    response.release_conn()


def _check_status(response: urllib3.BaseHTTPResponse, url: str, path: str) -> None:
    status = response.status
    if status in (404, 410):
        raise FileNotFoundError(f"{redact(url)}: not found (HTTP {status})")
    if status in (401, 403):
        raise StorageAccessError(f"{url}: access refused (HTTP {status})", file=path,
                                 hint=f"Set the server's token: the `token` storage option (-o token=...) or "
                                      f"${TOKEN_ENV}")
    if status >= 400 and status != 416:
        raise StorageAccessError(f"{url}: the server answered HTTP {status}", file=path,
                                 hint="Check the URL: it must be the root of a stream")


def _range_start(response: urllib3.BaseHTTPResponse, url: str, start: int) -> int:
    """Bytes to skip in the body of an answer to ``Range: bytes=start-...``: none for a 206 of that range,
    ``start`` for a 200 (the server ignored the range and sends the whole file)."""
    if response.status != 206:
        return start
    content_range = response.headers.get("Content-Range", "")
    first = content_range.removeprefix("bytes ").partition("-")[0]
    if first != str(start):
        raise StorageAccessError(f"{url}: asked for bytes from {start}, the server sent {content_range!r}",
                                 hint="The server's range support is broken; serve the stream with another")
    return 0


def _range_body(response: urllib3.BaseHTTPResponse, url: str, start: int, end: int | None) -> bytes:
    if response.status == 416:  # the range starts at or past the end of the file
        return b""
    _discard(response, _range_start(response, url, start))
    return response.read() if end is None else response.read(end - start)


def _small_body(response: urllib3.BaseHTTPResponse, url: str, wanted: int) -> bytes:
    """At most ``wanted`` bytes from the start of the answer to ``Range: bytes=0-...``, read in blocks."""
    if response.status == 416:  # an empty file
        return b""
    _range_start(response, url, 0)
    chunks = []
    while wanted > 0 and (chunk := response.read(min(wanted, SMALL_READ_BLOCK))):
        chunks.append(chunk)
        wanted -= len(chunk)
    return b"".join(chunks)


def _discard(response: urllib3.BaseHTTPResponse, count: int) -> None:
    while count > 0:
        data = response.read(min(count, _DISCARD_BLOCK))
        if not data:
            return
        count -= len(data)


def _total_size(response: urllib3.BaseHTTPResponse) -> int:
    """The size of a file from the answer to ``Range: bytes=0-0``."""
    if response.status == 200:  # the range was ignored: the whole body
        return len(response.read())
    total = response.headers.get("Content-Range", "").rpartition("/")[2]  # "bytes 0-0/N", or "bytes */N"
    if not total.isdigit():
        raise StorageAccessError(f"{response.url}: the server gives no size (no Content-Length, no Content-Range)",
                                 hint="Serve the stream with a server that sends Content-Length")
    return int(total)


def _origin(url: str) -> tuple[str, str, int | None]:
    """The origin of a URL: scheme, host and port (the scheme's default where none is given)."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    return scheme, (parts.hostname or "").lower(), parts.port or {"http": 80, "https": 443}.get(scheme)


def open_http_storage(url: str, storage_options: Mapping[str, Any]) -> HttpStorage:
    """The registry's factory for ``http://`` and ``https://`` URLs."""
    unknown = sorted(set(storage_options) - STORAGE_OPTIONS)
    if unknown:
        raise StorageCapabilityError(f"unknown storage option(s) for an HTTP stream: {', '.join(unknown)}",
                                     hint=f"HTTP streams take: {', '.join(sorted(STORAGE_OPTIONS))}")
    scheme = urlsplit(url).scheme.lower()
    if scheme not in ("http", "https") or not urlsplit(url).netloc:
        raise StorageCapabilityError(f"not an HTTP URL: {url}", hint="Give http://HOST[:PORT]/PATH")
    return HttpStorage(url, **storage_options)
