"""``Relay``: serve a stream directory over HTTP, so that a site's followers read one local copy (typically
the target of ``ckptstream mirror --follow``) instead of each pulling every version across the WAN.

Built on starlette (its ``FileResponse`` answers ``Range`` requests with 206) and uvicorn. It serves only the
stream's files: GET and HEAD of regular files under the directory, no directory listings, no name that
starts with a dot (so no ``..``, no dotfiles and no ``.tmp-*`` files of writers at work), nothing that
resolves outside the directory. With a token, every request needs ``Authorization: Bearer <token>``
(401 otherwise; compared in constant time). It binds 127.0.0.1 unless told otherwise.

``/metrics`` gives Prometheus text from a registry of the relay's own: ``ckptstream_relay_sent_bytes_total``
(body bytes of the stream's files sent, 200 and 206 answers) and ``ckptstream_relay_requests_total`` by
status, so that operators and tests can measure what reaches the origin.
"""

from __future__ import annotations

import functools
import hmac
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import CkptStreamError, StorageCapabilityError, StreamNotFoundError
from .format import ASSETS_DIR, MANIFESTS_DIR, VERSIONS_DIR

if TYPE_CHECKING:
    from starlette.types import Message, Receive, Scope, Send

log = logging.getLogger("ckptstream.relay")

RELAY_TOKEN_ENV = "CKPTSTREAM_RELAY_TOKEN"
"""Environment variable with the relay's token, when none is given."""
METRICS_PATH = "/metrics"
DEFAULT_HOST = "127.0.0.1"
START_TIMEOUT = 30.0
STOP_TIMEOUT = 5.0
"""Seconds a stopping relay gives the requests in flight (then they are cut)."""
SEND_CHUNK_BYTES = 1 << 20
"""Bytes per write of a file's body (starlette's default is 64 KiB): data files are read whole or in large
ranges, and fewer, larger writes mean fewer event-loop and thread hand-offs per byte."""
# Committed files never change (a manifest is created once, data files and assets are written before it):
# caches in front of the relay may keep them. Everything else (the latest-version hint, replica records)
# changes in place.
_IMMUTABLE_DIRS = frozenset({MANIFESTS_DIR, VERSIONS_DIR, ASSETS_DIR})


class Relay:
    """An HTTP server of one stream directory, in a background thread.

    Args:
        directory: the stream's root directory.
        host: address to bind (default loopback).
        port: TCP port; 0 picks a free one (``url`` names it once started).
        token: required bearer token (default ``$CKPTSTREAM_RELAY_TOKEN``; none: no authentication).

    Example::

        relay = Relay("/srv/mirror/run1", port=0, token="t").start()
        follower = Follower(relay.url, urls, storage_options={"token": "t"})
        ...
        print(relay.sent_bytes)   # what the followers pulled from this copy
        relay.stop()
    """

    def __init__(self, directory: str | os.PathLike[str], *, host: str = DEFAULT_HOST, port: int = 0,
                 token: str | None = None):
        try:
            import starlette  # noqa: F401 - checked now rather than at the first request
            import uvicorn  # noqa: F401
            from prometheus_client import CollectorRegistry, Counter
        except ImportError as exc:
            raise StorageCapabilityError(f"the relay needs {exc.name}, which is not installed",
                                         hint="pip install 'ckptstream[relay]'") from None

        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise StreamNotFoundError(f"{self.directory} is not a directory",
                                      hint="Give the root of a stream on this machine (e.g. the target of "
                                           "`ckptstream mirror --follow`)")
        self.host = host
        self.port = port
        token = token if token is not None else os.environ.get(RELAY_TOKEN_ENV)
        self._expected = f"Bearer {token}".encode() if token else None
        self._root = self.directory.resolve()
        self.registry = CollectorRegistry()
        self._sent = Counter("ckptstream_relay_sent_bytes", "Body bytes of stream files sent (200 and 206 answers)",
                             registry=self.registry)
        self._requests = Counter("ckptstream_relay_requests", "Requests answered, by HTTP status", ["status"],
                                 registry=self.registry)
        self._server: Any = None
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------------------------------- lifecycle

    @property
    def url(self) -> str:
        """``http://host:port`` of the running relay (the bound port when started with port 0)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def sent_bytes(self) -> int:
        """Body bytes of stream files sent so far (what ``/metrics`` reports as sent bytes)."""
        return int(self.registry.get_sample_value("ckptstream_relay_sent_bytes_total") or 0)

    def start(self) -> Relay:
        """Start serving in a background thread; returns once the socket listens."""
        import uvicorn

        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:  # bound here, not by uvicorn: a port in use is this error, not a dead server thread
            listener.bind((self.host, self.port))
        except OSError as exc:
            listener.close()
            raise CkptStreamError(f"the relay cannot listen on {self.host}:{self.port} ({exc.strerror})",
                                  hint="Choose another --port (or --host), or stop what uses it") from None
        self.port = listener.getsockname()[1]
        # a bounded shutdown: uvicorn otherwise waits without limit for the tasks of open connections
        config = uvicorn.Config(self.app, interface="asgi3", lifespan="off", log_level="warning", access_log=False,
                                proxy_headers=False, timeout_graceful_shutdown=STOP_TIMEOUT)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [listener]},
                                        name="ckptstream-relay", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT
        while not self._server.started:
            self._thread.join(0.02)
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise CkptStreamError(f"the relay did not start serving on {self.url}")
        log.info("relaying %s at %s%s", self.directory, self.url, " (token required)" if self._expected else "")
        return self

    def stop(self) -> None:
        """Stop serving (open connections are closed; requests in flight get ``STOP_TIMEOUT`` seconds) and
        wait for the thread."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=2 * STOP_TIMEOUT)
            if self._thread.is_alive() and self._server is not None:
                self._server.force_exit = True  # past the graceful shutdown: drop what is left
                self._thread.join(timeout=STOP_TIMEOUT)

    def __enter__(self) -> Relay:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---------------------------------------------------------------------------------------------- ASGI

    async def app(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI application: authentication, counting, then a stream file or the metrics."""
        if scope["type"] != "http":
            return
        status: list[int] = []

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            elif (message["type"] == "http.response.body" and status and status[0] in (200, 206)
                  and scope["path"] != METRICS_PATH):
                self._sent.inc(len(message.get("body", b"")))
            await send(message)

        try:
            await self._answer(scope)(scope, receive, counting_send)
        finally:
            self._requests.labels(str(status[0]) if status else "none").inc()

    def _answer(self, scope: Scope) -> Any:
        from starlette.responses import PlainTextResponse, Response

        if not self._authorized(scope):
            return PlainTextResponse("a bearer token is required\n", status_code=401,
                                     headers={"WWW-Authenticate": "Bearer"})
        if scope["method"] not in ("GET", "HEAD"):
            return PlainTextResponse("read-only: GET and HEAD only\n", status_code=405,
                                     headers={"Allow": "GET, HEAD"})
        path = scope["path"]
        if path == METRICS_PATH:
            from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

            return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)
        target = self._file(path)
        if target is None:  # not to be cached: the manifest a follower probes for appears later
            return PlainTextResponse("not found\n", status_code=404, headers={"Cache-Control": "no-store"})
        immutable = path.lstrip("/").split("/", 1)[0] in _IMMUTABLE_DIRS
        cache = "public, max-age=31536000, immutable" if immutable else "no-cache"
        return _file_response()(target, media_type="application/octet-stream", headers={"Cache-Control": cache})

    def _authorized(self, scope: Scope) -> bool:
        if self._expected is None:
            return True
        given = next((value for key, value in scope["headers"] if key == b"authorization"), b"")
        return hmac.compare_digest(given, self._expected)

    def _file(self, path: str) -> Path | None:
        """The regular file a request path names inside the directory, or None (hidden, temporary,
        outside, a directory, missing)."""
        parts = path.removeprefix("/").split("/")
        if any(not part or part.startswith(".") or "\\" in part or "\x00" in part for part in parts):
            return None
        try:
            target = self._root.joinpath(*parts).resolve(strict=True)
        except (OSError, RuntimeError):  # missing, or a symlink loop
            return None
        if not target.is_relative_to(self._root) or not target.is_file():
            return None
        return target


@functools.cache
def _file_response() -> type:
    """starlette's ranged ``FileResponse``, writing ``SEND_CHUNK_BYTES`` at a time."""
    from starlette.responses import FileResponse

    class StreamFileResponse(FileResponse):
        chunk_size = SEND_CHUNK_BYTES

    return StreamFileResponse
