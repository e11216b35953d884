"""The HTTP backend: the read-only storage suite against a real static server (``python -m http.server``)
and the relay (with a token), and what is particular to HTTP: auth, retries, directories."""

from __future__ import annotations

import contextlib
import http.server
import queue
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO

import pytest

from ckptstream.relay import Relay
from ckptstream.errors import IntegrityError, StorageAccessError, StorageCapabilityError
from ckptstream.format import LATEST_HINT_FILE, MAX_LATEST_HINT_BYTES
from ckptstream.reader.probe import read_latest_hint
from ckptstream.storage import Storage, open_storage
from ckptstream.storage.http import HttpStorage
from ckptstream.storage.wrapper import WrapperStorage
from ckptstream.testing.http import ResettingProxy, StaticHttpServer
from ckptstream.testing.storage import DATA, ReadOnlyStorageSuite
from tests.helpers import serving

TOKEN = "s3cret-token"


def _write_files(root: Path, files: Mapping[str, bytes]) -> None:
    for path, data in files.items():
        target = root.joinpath(*path.split("/"))
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)


@contextlib.contextmanager
def _answering(answer: Callable[[http.server.BaseHTTPRequestHandler], None]) -> Iterator[str]:
    """A real HTTP server on 127.0.0.1 (its URL) that answers every GET and HEAD by ``answer(handler)``."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            answer(self)

        do_HEAD = do_GET

    with serving(Handler) as url:
        yield url


def _redirect(handler: http.server.BaseHTTPRequestHandler, location: str) -> None:
    handler.send_response(302)
    handler.send_header("Location", location)
    handler.send_header("Content-Length", "0")
    handler.end_headers()


def _ok(handler: http.server.BaseHTTPRequestHandler, body: bytes) -> None:
    handler.send_response(200)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    if handler.command == "GET":
        handler.wfile.write(body)


@pytest.fixture(scope="module")
def static_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StaticHttpServer]:
    with StaticHttpServer(tmp_path_factory.mktemp("static")) as server:
        yield server


@pytest.fixture
def relay(tmp_path: Path) -> Iterator[Relay]:
    (tmp_path / "relayed").mkdir()
    with Relay(tmp_path / "relayed", token=TOKEN) as relay:
        yield relay


IN_LAYOUT = "versions/000000000000"
"""Where the relay's tests put their files: the relay serves only the names of a stream's layout."""


def _in_layout(path: str) -> str:
    return f"{IN_LAYOUT}/{path.replace('/', '-')}"


class _InLayout(WrapperStorage):
    """The suite's names (``d/data.bin``) read where the relay serves files (``versions/<v>/d-data.bin``)."""

    def read(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        return self.inner.read(_in_layout(path), start, end)

    def read_small(self, path: str, limit: int) -> bytes:
        try:
            return self.inner.read_small(_in_layout(path), limit)
        except IntegrityError as exc:  # (the relay's name of the file is not the suite's)
            raise IntegrityError(str(exc).replace(_in_layout(path), path)) from None

    def read_into(self, path: str, offset: int, buffer: memoryview) -> None:
        self.inner.read_into(_in_layout(path), offset, buffer)

    def read_ranges(self, path: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        return self.inner.read_ranges(_in_layout(path), ranges)

    def read_ranges_into(self, path: str, targets: Sequence[tuple[int, memoryview]]) -> None:
        self.inner.read_ranges_into(_in_layout(path), targets)

    def open_read(self, path: str) -> IO[bytes]:
        return self.inner.open_read(_in_layout(path))

    def size(self, path: str) -> int:
        return self.inner.size(_in_layout(path))

    def exists(self, path: str) -> bool:
        return self.inner.exists(_in_layout(path))


class TestStaticHttpStorage(ReadOnlyStorageSuite):
    """HttpStorage against python's http.server: no Range support (200 with the whole body), directories
    redirected to a name ending in / and listed as HTML."""

    @pytest.fixture
    def storage(self, static_server: StaticHttpServer, tmp_path: Path) -> Storage:
        self.root = static_server.directory / tmp_path.name
        self.root.mkdir()
        return open_storage(f"{static_server.url}/{tmp_path.name}")

    def populate(self, storage: Storage, files: Mapping[str, bytes]) -> None:
        _write_files(self.root, files)


class TestRelayHttpStorage(ReadOnlyStorageSuite):
    """HttpStorage against the relay (starlette's ranged FileResponse), with a bearer token; the suite's
    files are put, and read, inside the stream's layout (``_InLayout``)."""

    @pytest.fixture
    def storage(self, relay: Relay) -> Storage:
        self.root = relay.directory
        return _InLayout(open_storage(relay.url, {"token": TOKEN}))

    def populate(self, storage: Storage, files: Mapping[str, bytes]) -> None:
        _write_files(self.root, {_in_layout(path): data for path, data in files.items()})


# ------------------------------------------------------------------------------------ particular to HTTP


def test_http_urls_open_the_http_backend(static_server):
    for url in (static_server.url, static_server.url.replace("http://", "https://")):
        assert isinstance(open_storage(url), HttpStorage)
    with pytest.raises(StorageCapabilityError, match="unknown storage option.*endpoint_url"):
        open_storage(static_server.url, {"endpoint_url": "x"})


def test_resets_are_retried(static_server, tmp_path):
    root = static_server.directory / tmp_path.name
    _write_files(root, {"f.bin": DATA})
    with ResettingProxy(static_server.address, resets=2) as proxy:
        storage = open_storage(f"{proxy.url}/{tmp_path.name}")
        assert storage.read("f.bin", 10, 20) == DATA[10:20]
        assert proxy.reset == 2 and proxy.connections == 3


def test_a_body_cut_short_is_fetched_again(relay):
    """Connections reset in the middle of the answer: ranged reads retry, a streamed read resumes."""
    data = bytes(range(256)) * 4096  # 1 MiB
    big = _in_layout("big.bin")
    _write_files(relay.directory, {big: data})
    host, port = relay.url.removeprefix("http://").split(":")
    with ResettingProxy((host, int(port)), resets=2, after_bytes=100_000) as proxy:
        storage = open_storage(proxy.url, {"token": TOKEN})
        assert storage.read(big, 1000, 900_000) == data[1000:900_000]
        assert proxy.reset == 2
    with ResettingProxy((host, int(port)), resets=2, after_bytes=300_000) as proxy:
        storage = open_storage(proxy.url, {"token": TOKEN})
        with storage.open_read(big) as f:
            assert f.read() == data
        assert proxy.reset == 2


def test_a_server_that_keeps_failing_is_a_clear_error_in_bounded_time(static_server):
    with ResettingProxy(static_server.address, resets=10**9) as proxy:
        storage = open_storage(f"{proxy.url}/x", {"retries": 3})
        started = time.monotonic()
        with pytest.raises(StorageAccessError, match=f"GET {proxy.url}/x/f.bin failed after 4 attempts"):
            storage.read("f.bin")
        assert time.monotonic() - started < 10
        assert proxy.connections == 4


def test_server_errors_are_retried_then_reported(tmp_path):
    """A server answering 503 (then 200, or 503 for ever): retried with backoff, then named."""
    answers: list[int] = []
    plan = [503, 503]

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            status = plan.pop(0) if plan else 200
            answers.append(status)
            body = b"ok" if status == 200 else b"busy"
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    with serving(Handler) as url:
        assert open_storage(url).read("f") == b"ok" and answers == [503, 503, 200]
        plan.extend([503] * 10)
        with pytest.raises(StorageAccessError, match=r"failed after 3 attempts \(HTTP 503\)"):
            open_storage(url, {"retries": 2}).read("f")


def test_an_endless_latest_hint_is_read_no_further_than_its_limit():
    """A server whose ``latest.json`` never ends (it ignores ``Range``; capped here so that reading it whole
    ends too): the hint is read to just past its limit, the connection dropped, probing starts from 0."""
    cap = 64 << 20
    sent: queue.Queue[int] = queue.Queue()

    def endless(handler: http.server.BaseHTTPRequestHandler) -> None:
        handler.send_response(200)  # no Content-Length: the body ends when the connection closes
        handler.end_headers()
        block, total = b" " * (64 << 10), 0
        with contextlib.suppress(OSError):  # the reader hung up
            while total < cap:
                handler.wfile.write(block)
                total += len(block)
        sent.put(total)

    with _answering(endless) as url:
        storage = open_storage(url)
        with pytest.raises(IntegrityError, match=f"file {LATEST_HINT_FILE}: over the {MAX_LATEST_HINT_BYTES}-byte"):
            storage.read_small(LATEST_HINT_FILE, MAX_LATEST_HINT_BYTES)
        assert read_latest_hint(storage) is None
        # What the server got out before the reader hung up is what the sockets' buffers hold, not the body.
        assert max(sent.get(timeout=60) for _ in range(2)) < cap // 2


def test_a_redirect_to_another_origin_is_refused_and_the_headers_stay_home():
    """The stream's server redirects to another origin (another port of the same host): refused, naming
    the URL, and the other server gets no request, so neither the `headers` option nor the token reach it."""
    elsewhere_got: list[str] = []

    def elsewhere(handler: http.server.BaseHTTPRequestHandler) -> None:
        elsewhere_got.append(f"{handler.command} {handler.path} {handler.headers.get('X-Api-Key')}")
        _ok(handler, b"not the stream's")

    with _answering(elsewhere) as other, _answering(lambda h: _redirect(h, f"{other}{h.path}")) as url:
        storage = open_storage(f"{url}/run", {"headers": {"X-Api-Key": "k3y"}, "token": TOKEN})
        for read in (lambda: storage.read("stream.json"), lambda: storage.exists("stream.json"),
                     lambda: storage.read_small("stream.json", 100)):
            with pytest.raises(StorageAccessError, match=f"redirects to {other}/run/stream.json, another origin"):
                read()
    assert elsewhere_got == []


def test_a_redirect_within_the_origin_is_followed_with_the_headers():
    got: list[str | None] = []

    def moved(handler: http.server.BaseHTTPRequestHandler) -> None:
        if handler.path.startswith("/old/"):
            _redirect(handler, handler.path.replace("/old/", "/new/"))  # relative: the same origin
            return
        got.append(handler.headers.get("X-Api-Key"))
        _ok(handler, b"moved here")

    with _answering(moved) as url:
        storage = open_storage(f"{url}/old", {"headers": {"X-Api-Key": "k3y"}})
        assert storage.read("f") == b"moved here" and storage.exists("f")
    assert got == ["k3y", "k3y"]


def test_unauthorized_names_the_token(relay):
    with pytest.raises(StorageAccessError, match="401.*CKPTSTREAM_HTTP_TOKEN"):
        open_storage(relay.url).read("anything")


def test_a_directory_is_not_a_file(static_server, tmp_path):
    _write_files(static_server.directory / tmp_path.name, {"d/f": b"x"})
    storage = open_storage(f"{static_server.url}/{tmp_path.name}")
    assert not storage.exists("d")
    with pytest.raises(FileNotFoundError):
        storage.read("d")
