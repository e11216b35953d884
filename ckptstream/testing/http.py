"""Real HTTP servers on loopback for tests of HTTP streams: a static file server (``python -m http.server``,
which ignores ``Range`` and answers 200 with the whole file), and a TCP proxy that resets chosen
connections (what a flaky network or an overloaded load balancer does to a reader).

Example::

    with StaticHttpServer(stream_dir) as server, ResettingProxy(server.address, resets=2) as proxy:
        assert Stream(proxy.url).latest() is not None   # the first two connections were reset

Only the standard library is used.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(address: tuple[str, int], timeout: float = 30.0) -> None:
    """Return once something accepts TCP connections at ``address`` (TimeoutError after ``timeout`` s)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(address, timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens at {address[0]}:{address[1]} after {timeout} s") from None
            time.sleep(0.05)


class StaticHttpServer:
    """``python -m http.server`` serving ``directory`` on 127.0.0.1, in a child process.

    Attributes:
        url: ``http://127.0.0.1:<port>``.
        address: ``(host, port)``.
    """

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.address = ("127.0.0.1", free_port())
        self.url = f"http://{self.address[0]}:{self.address[1]}"
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> StaticHttpServer:
        self._process = subprocess.Popen(
            [sys.executable, "-m", "http.server", str(self.address[1]), "--bind", self.address[0],
             "--directory", str(self.directory)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_listening(self.address)
        return self

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            self._process.wait(timeout=30)

    def __enter__(self) -> StaticHttpServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ResettingProxy:
    """A TCP proxy on 127.0.0.1 in front of ``upstream`` that resets (RST) its first ``resets`` connections
    — at once, or after ``after_bytes`` bytes of the answer — and forwards the others untouched.

    Attributes:
        url: ``http://127.0.0.1:<port>``.
        connections: connections accepted so far.
        reset: connections reset so far.
    """

    def __init__(self, upstream: tuple[str, int], *, resets: int = 1, after_bytes: int | None = None):
        self.upstream = upstream
        self.resets = resets
        self.after_bytes = after_bytes
        self.connections = 0
        self.reset = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="resetting-proxy", daemon=True)

    def __enter__(self) -> ResettingProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopped.set()
        with contextlib.suppress(OSError):  # wakes the accept() of the other thread (close alone does not)
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._thread.join(timeout=10)

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self.connections += 1
                doomed = self.reset < self.resets
                if doomed:
                    self.reset += 1
            if doomed and self.after_bytes is None:
                _abort(client)
                continue
            threading.Thread(target=self._serve, args=(client, self.after_bytes if doomed else None),
                             daemon=True).start()

    def _serve(self, client: socket.socket, cut_after: int | None) -> None:
        try:
            upstream = socket.create_connection(self.upstream, timeout=30)
        except OSError:
            _abort(client)
            return
        threading.Thread(target=_pipe, args=(client, upstream, None), daemon=True).start()
        _pipe(upstream, client, cut_after)


def _pipe(source: socket.socket, target: socket.socket, cut_after: int | None) -> None:
    """Copy bytes from ``source`` to ``target`` until either side closes; with ``cut_after``, reset
    ``target`` once that many bytes went through."""
    sent = 0
    try:
        while True:
            data = source.recv(1 << 16)
            if not data:
                break
            if cut_after is not None and sent + len(data) >= cut_after:
                target.sendall(data[:cut_after - sent])
                _abort(target)
                source.close()
                return
            target.sendall(data)
            sent += len(data)
    except OSError:
        pass
    for s in (source, target):
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()


def _abort(connection: socket.socket) -> None:
    """Close with a TCP reset (linger 0), not an orderly FIN: the peer sees ECONNRESET."""
    try:
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        # Wakes a thread blocked reading this socket: the kernel closes it (and resets) only once no
        # system call holds it any more.
        connection.shutdown(socket.SHUT_RD)
    except OSError:
        pass
    finally:
        connection.close()
