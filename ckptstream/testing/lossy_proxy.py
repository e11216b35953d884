r"""A real HTTP proxy on loopback in front of an S3 server that loses the answers to chosen requests.

The request still reaches the server (it stores the object); only the client never hears so: the proxy
answers 500 instead, or closes the connection. This is what a lost response looks like to botocore, which
then retries the request. For tests of code that commits to object stores::

    with LossyProxy("http://127.0.0.1:5000", r"/manifests/[0-9]{12}\.json$") as proxy:
        publisher = Publisher(url, storage_options={"endpoint_url": proxy.url})

With ``missing``, it stands in for an older server instead: the routes matching it answer 404 (e.g. a vLLM
before 0.25, which has no ``/update_weight_version`` nor ``/weight_info``)::

    with LossyProxy(server.url, "$^", losses=0, missing=r"^/(update_weight_version|weight_info)$") as old:
        follower = Follower(url, [old.url])

Only the standard library is used.
"""

from __future__ import annotations

import http.client
import http.server
import re
import socket
import threading
from urllib.parse import urlsplit

_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade",
               "expect"}


class LossyProxy:
    """Forwards every request to ``upstream``; the first ``losses`` PUTs whose path matches ``pattern`` are
    forwarded (not with ``forward=False``: then they never reach the server), and then answered with a 500
    (``mode="500"``) or a closed connection (``mode="reset"``). Requests whose path matches ``missing`` are
    answered 404 without reaching the server.

    Attributes:
        lost: paths of the requests whose response was lost, in order.
        seen: (method, path, status returned) of every request.
    """

    def __init__(self, upstream: str, pattern: str, *, mode: str = "500", losses: int = 1, forward: bool = True,
                 missing: str | None = None):
        if mode not in ("500", "reset"):
            raise ValueError(f"unknown mode {mode!r}")
        target = urlsplit(upstream)
        self.upstream = (target.hostname or "127.0.0.1", target.port or 80)
        self.pattern = re.compile(pattern)
        self.mode = mode
        self.losses = losses
        self.forward = forward
        self.missing = re.compile(missing) if missing is not None else None
        self.lost: list[str] = []
        self.seen: list[tuple[str, str, int | None]] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _forward(self) -> None:
                body = self._body()
                if proxy.missing is not None and proxy.missing.search(self.path.split("?")[0]):
                    proxy.seen.append((self.command, self.path, 404))
                    self.send_response(404)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", "22")
                    self.end_headers()
                    self.wfile.write(b'{"detail":"Not Found"}')
                    return
                if self.command == "PUT" and not proxy.forward and proxy._take_loss(self.path):
                    self._lose()
                    return
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=30)
                try:
                    conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                    for key, value in self.headers.items():
                        if key.lower() not in _HOP_BY_HOP and key.lower() != "content-length":
                            conn.putheader(key, value)
                    conn.putheader("Content-Length", str(len(body)))
                    conn.endheaders(body)
                    response = conn.getresponse()
                    payload = response.read()
                    status, headers = response.status, response.getheaders()
                finally:
                    conn.close()
                if self.command == "PUT" and proxy.forward and proxy._take_loss(self.path):
                    self._lose()
                    return
                proxy.seen.append((self.command, self.path, status))
                self.send_response(status)
                for key, value in headers:
                    if key.lower() not in _HOP_BY_HOP and key.lower() != "content-length":
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(payload)

            def _lose(self) -> None:
                """Answer with a server error or a closed connection instead of the server's answer."""
                proxy.seen.append((self.command, self.path, None if proxy.mode == "reset" else 500))
                if proxy.mode == "reset":
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True
                    return
                error = (b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>InternalError</Code>"
                         b"<Message>We encountered an internal error. Please try again.</Message></Error>")
                self.send_response(500)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(error)))
                self.end_headers()
                self.wfile.write(error)

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    parts = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass  # trailers
                            return b"".join(parts)
                        parts.append(self.rfile.read(size))
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def _take_loss(self, path: str) -> bool:
        with self._lock:
            if len(self.lost) < self.losses and self.pattern.search(path.split("?")[0]):
                self.lost.append(path)
                return True
            return False

    def __enter__(self) -> LossyProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

