"""``Relay``: serve a stream directory over HTTP, so that a site's followers read one local copy (typically
the target of ``ckptstream mirror --follow``) instead of each pulling every version across the WAN.

Built on starlette (its ``FileResponse`` answers ``Range`` requests with 206) and uvicorn. It serves only the
files readers read (FORMAT.md, "Layout"): GET and HEAD of ``stream.json``, ``latest.json``, ``assets/<name>``,
``manifests/<version>.json`` and ``versions/<version>/<name>``, regular files that resolve inside the
directory; no listings, no replica records or leases (host names, URLs), no ``.tmp-*`` files of writers at
work, nothing else an operator keeps there. With a token, every request needs ``Authorization: Bearer
<token>`` (401 otherwise; compared in constant time); an empty token is refused. It binds 127.0.0.1 unless
told otherwise, and warns when it serves other hosts without a token.

Connections are accepted here, one at a time, not by uvicorn, so that a client cannot hold them for ever:
a connection must deliver each request's whole header within ``HEADER_TIMEOUT`` seconds of its opening (or of
the previous answer's end), and at most ``connection_limit()`` are open at once (the descriptor limit allows
two per connection: the socket and the file it sends). At the limit a new connection closes the oldest one
waiting for a header, or is itself closed at once when every connection is in a request.

``/metrics`` gives Prometheus text from a registry of the relay's own: ``ckptstream_relay_sent_bytes_total``
(body bytes of the stream's files sent, 200 and 206 answers) and ``ckptstream_relay_requests_total`` by
status, so that operators and tests can measure what reaches the origin.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import ipaddress
import logging
import os
import resource
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import CkptStreamError, StorageCapabilityError, StreamNotFoundError
from .format import (ASSETS_DIR, LATEST_HINT_FILE, MANIFESTS_DIR, STREAM_FILE, VERSIONS_DIR, is_safe_file_name,
                     manifest_path, parse_version_name, version_dir)

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
HEADER_TIMEOUT = 10.0
"""Seconds a connection has to deliver a request's whole header, from its opening or from the end of the
previous answer; then it is closed (a silent or trickling client would hold it, and a descriptor, for ever)."""
IDLE_TIMEOUT = 5
"""Seconds a keep-alive connection stays open after an answer without the next request starting (uvicorn's
keep-alive timeout)."""
MAX_CONNECTIONS = 1024
"""Connections open at once, at most (fewer where the descriptor limit is lower: ``connection_limit``)."""
_FDS_PER_CONNECTION = 2  # its socket, and the file it sends
_RESERVED_FDS = 64  # the interpreter's, the listener, logs, the event loop's own
ACCEPT_BACKLOG = 2048
ACCEPT_RETRY_DELAY = 1.0
"""Seconds before accepting again after the kernel refused an accept (out of descriptors or memory)."""
SEND_CHUNK_BYTES = 1 << 20
"""Bytes per write of a file's body (starlette's default is 64 KiB): data files are read whole or in large
ranges, and fewer, larger writes mean fewer event-loop and thread hand-offs per byte."""
# Committed files never change (a manifest is created once, data files and assets are written before it):
# caches in front of the relay may keep them. The rest (the latest-version hint changes in place) is no-cache.
_IMMUTABLE_DIRS = frozenset({MANIFESTS_DIR, VERSIONS_DIR, ASSETS_DIR})


class Relay:
    """An HTTP server of one stream directory, in a background thread.

    Args:
        directory: the stream's root directory.
        host: address to bind (default loopback).
        port: TCP port; 0 picks a free one (``url`` names it once started).
        token: required bearer token (default ``$CKPTSTREAM_RELAY_TOKEN``; none: no authentication; an empty
            one is a ValueError).
        header_timeout: seconds a connection has to send a request's header (``HEADER_TIMEOUT``).
        max_connections: connections open at once, at most (default ``connection_limit()``).

    Example::

        relay = Relay("/srv/mirror/run1", port=0, token="t").start()
        follower = Follower(relay.url, urls, storage_options={"token": "t"})
        ...
        print(relay.sent_bytes)   # what the followers pulled from this copy
        relay.stop()
    """

    def __init__(self, directory: str | os.PathLike[str], *, host: str = DEFAULT_HOST, port: int = 0,
                 token: str | None = None, header_timeout: float = HEADER_TIMEOUT,
                 max_connections: int | None = None):
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
        if token == "":  # it used to mean no authentication, silently
            raise ValueError(f"the relay's token is empty (a token argument or ${RELAY_TOKEN_ENV}): give a token, "
                             "or none to serve without authentication")
        self._expected = f"Bearer {token}".encode() if token is not None else None
        self._root = self.directory.resolve()
        self.registry = CollectorRegistry()
        self._sent = Counter("ckptstream_relay_sent_bytes", "Body bytes of stream files sent (200 and 206 answers)",
                             registry=self.registry)
        self._requests = Counter("ckptstream_relay_requests", "Requests answered, by HTTP status", ["status"],
                                 registry=self.registry)
        self._dropped = Counter("ckptstream_relay_dropped_connections",
                                "Connections closed by the relay, by reason (header_timeout, limit)", ["reason"],
                                registry=self.registry)
        self._connections = _Connections(max_connections or connection_limit(), header_timeout,
                                         lambda reason: self._dropped.labels(reason).inc())
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._listener: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._accepting: asyncio.Task[None] | None = None

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
        listener.listen(ACCEPT_BACKLOG)
        listener.setblocking(False)
        self._listener = listener
        # uvicorn gets no socket: the lifespan startup starts this relay's own accept loop in uvicorn's event
        # loop. The shutdown is bounded: uvicorn otherwise waits without limit for the tasks of open connections.
        config = uvicorn.Config(self.app, interface="asgi3", lifespan="on", ws="none", log_level="warning",
                                access_log=False, proxy_headers=False, timeout_keep_alive=IDLE_TIMEOUT,
                                timeout_graceful_shutdown=STOP_TIMEOUT)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": []},
                                        name="ckptstream-relay", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT
        while not self._server.started:
            self._thread.join(0.02)
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise CkptStreamError(f"the relay did not start serving on {self.url}")
        log.info("relaying %s at %s%s", self.directory, self.url, " (token required)" if self._expected else "")
        if self._expected is None and not _is_loopback(self.host):
            log.warning("the relay serves %s without a token: anyone who reaches %s reads the stream (set "
                        "$%s)", self.host, self.url, RELAY_TOKEN_ENV)
        return self

    def stop(self) -> None:
        """Stop serving (open connections are closed; requests in flight get ``STOP_TIMEOUT`` seconds) and
        wait for the thread."""
        if self._loop is not None and self._accepting is not None:
            try:  # no new connections while uvicorn closes the open ones
                self._loop.call_soon_threadsafe(self._accepting.cancel)
            except RuntimeError:  # the loop is closed already
                pass
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
        """The ASGI application: authentication, counting, then a stream file or the metrics (and, at the
        lifespan's start, the accept loop)."""
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
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

        connection = _peer(scope.get("client"))
        self._connections.request_started(connection)
        try:
            await self._answer(scope)(scope, receive, counting_send)
        finally:
            self._requests.labels(str(status[0]) if status else "none").inc()
            self._connections.request_finished(connection)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                assert self._listener is not None
                self._loop = asyncio.get_running_loop()
                self._accepting = self._loop.create_task(self._accept(self._listener))
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._accepting is not None:
                    self._accepting.cancel()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _accept(self, listener: socket.socket) -> None:
        """Accept connections one at a time, each only when there is room for it, and hand them to uvicorn's
        HTTP protocol (uvicorn would accept all that wait at once, and run out of descriptors)."""
        loop = asyncio.get_running_loop()
        config, state = self._server.config, self._server.server_state
        try:
            while True:
                try:
                    sock, _ = await loop.sock_accept(listener)
                except (ConnectionAbortedError, InterruptedError):  # gone before its accept
                    continue
                except OSError as exc:  # out of descriptors or memory after all: let some close
                    log.warning("the relay cannot accept a connection (%s); retrying in %.0f s", exc.strerror,
                                ACCEPT_RETRY_DELAY)
                    await asyncio.sleep(ACCEPT_RETRY_DELAY)
                    continue
                if not self._connections.make_room():
                    sock.close()
                    continue
                protocol = _Tracked(config.http_protocol_class(config=config, server_state=state, app_state={}),
                                    self._connections)
                try:
                    await loop.connect_accepted_socket(lambda p=protocol: p, sock)
                except OSError:  # reset meanwhile
                    sock.close()
        finally:
            listener.close()

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
        """The regular file a request path names inside the directory, or None (not a file of the stream's
        layout, outside, a directory, missing)."""
        relative = path.removeprefix("/")
        if not _is_stream_file(relative):
            return None
        try:
            target = self._root.joinpath(*relative.split("/")).resolve(strict=True)
        except (OSError, RuntimeError):  # missing, or a symlink loop
            return None
        if not target.is_relative_to(self._root) or not target.is_file():
            return None
        return target


def _is_stream_file(relative: str) -> bool:
    """Whether a path is one that readers read (FORMAT.md, "Layout"): ``stream.json``, ``latest.json``,
    ``assets/<name>``, ``manifests/<version>.json``, ``versions/<version>/<name>`` (names by the data-file
    name rule, so no dotfile, no ``.tmp-*`` name, no separator)."""
    if relative in (STREAM_FILE, LATEST_HINT_FILE):
        return True
    directory, _, name = relative.rpartition("/")
    if directory == ASSETS_DIR:
        return is_safe_file_name(name)
    version = parse_version_name(name if directory == MANIFESTS_DIR else directory.rpartition("/")[2])
    if version is None:
        return False
    if directory == MANIFESTS_DIR:
        return relative == manifest_path(version)
    return directory == version_dir(version) and is_safe_file_name(name)


def connection_limit() -> int:
    """``MAX_CONNECTIONS``, or fewer where the process's descriptor limit would run out first (two per
    connection, ``_RESERVED_FDS`` kept for the rest of the process)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    return max(1, min(MAX_CONNECTIONS, (soft - _RESERVED_FDS) // _FDS_PER_CONNECTION))


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


Peer = tuple[str, int]


def _peer(address: Any) -> Peer | None:
    """A connection's key: its client's address and port (as uvicorn puts them in the ASGI scope)."""
    if isinstance(address, (list, tuple)) and len(address) >= 2:
        return str(address[0]), int(address[1])
    return None


class _Connection:
    """One open connection: its transport, requests in progress, the deadline of the header it waits for."""

    def __init__(self, transport: Any):
        self.transport = transport
        self.requests = 0
        self.deadline: asyncio.TimerHandle | None = None


class _Connections:
    """The relay's open connections (touched only in the event loop's thread): a deadline on each one that
    waits for a request header, and room made at the limit by closing the oldest of those.

    Connections are told apart by their client's address and port: the ASGI scope says which connection a
    request came on by that alone.
    """

    def __init__(self, limit: int, header_timeout: float, dropped: Callable[[str], None]):
        self.limit = limit
        self.header_timeout = header_timeout
        self._dropped = dropped
        self._open: dict[Peer, _Connection] = {}
        self._waiting: dict[Peer, _Connection] = {}  # waiting for a request header, oldest first

    def make_room(self) -> bool:
        """Room for one more connection: at the limit the oldest connection waiting for a header is aborted
        (its descriptor is freed at once); False when every connection is in a request."""
        if len(self._open) < self.limit:
            return True
        self._dropped("limit")
        if not self._waiting:
            return False
        peer, victim = next(iter(self._waiting.items()))
        self._forget(peer, victim)
        victim.transport.abort()
        return True

    def opened(self, peer: Peer | None, transport: Any) -> _Connection:
        connection = _Connection(transport)
        if peer is not None:
            self._open[peer] = connection
            self._wait_for_header(peer, connection)
        return connection

    def lost(self, peer: Peer | None, connection: _Connection) -> None:
        if peer is not None and self._open.get(peer) is connection:
            self._forget(peer, connection)

    def request_started(self, peer: Peer | None) -> None:
        connection = self._open.get(peer) if peer is not None else None
        if connection is not None:
            connection.requests += 1
            self._stop_waiting(peer, connection)

    def request_finished(self, peer: Peer | None) -> None:
        connection = self._open.get(peer) if peer is not None else None
        if connection is not None and connection.requests > 0:
            connection.requests -= 1
            if not connection.requests:
                self._wait_for_header(peer, connection)

    def _wait_for_header(self, peer: Peer, connection: _Connection) -> None:
        self._waiting[peer] = connection
        connection.deadline = asyncio.get_running_loop().call_later(self.header_timeout, self._expire, peer,
                                                                    connection)

    def _expire(self, peer: Peer, connection: _Connection) -> None:
        if self._waiting.get(peer) is connection and not connection.transport.is_closing():
            self._dropped("header_timeout")
            connection.transport.close()  # it stays counted (and can be aborted) until it is gone

    def _stop_waiting(self, peer: Peer, connection: _Connection) -> None:
        if self._waiting.get(peer) is connection:
            del self._waiting[peer]
        if connection.deadline is not None:
            connection.deadline.cancel()
            connection.deadline = None

    def _forget(self, peer: Peer, connection: _Connection) -> None:
        self._stop_waiting(peer, connection)
        del self._open[peer]


class _Tracked(asyncio.Protocol):
    """uvicorn's HTTP protocol of one connection, which ``_Connections`` learns the opening and the end of."""

    def __init__(self, inner: asyncio.Protocol, connections: _Connections):
        self._inner = inner
        self._connections = connections
        self._peer: Peer | None = None
        self._connection: _Connection | None = None

    def connection_made(self, transport: Any) -> None:  # uvloop's transports are no asyncio.Transport
        # before uvicorn sees a byte: the first request's start finds the connection known
        self._peer = _peer(transport.get_extra_info("peername"))
        self._connection = self._connections.opened(self._peer, transport)
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._inner.connection_lost(exc)
        if self._connection is not None:
            self._connections.lost(self._peer, self._connection)


@functools.cache
def _file_response() -> type:
    """starlette's ranged ``FileResponse``, writing ``SEND_CHUNK_BYTES`` at a time."""
    from starlette.responses import FileResponse

    class StreamFileResponse(FileResponse):
        chunk_size = SEND_CHUNK_BYTES

    return StreamFileResponse
