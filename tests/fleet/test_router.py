"""A real vllm-router: its worker list changed by URL and checked (a 200 is no proof), and a clear error
when it is gone; a ``RouterGate`` counts only live workers. The workers are loopback HTTP servers answering
``/health`` (all the router asks of a worker it adds) and ``/metrics`` (empty: nothing queued); real vLLM
servers behind the router are in ``tests/vllm_loader/test_rolling.py``."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator

import pytest

from ckptstream.errors import RouterError
from ckptstream.fleet.rolling import RouterGate
from ckptstream.fleet.router import Router
from tests.helpers import command_lines_under


class _Healthy(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def _healthy_servers(count: int) -> Iterator[list[ThreadingHTTPServer]]:
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), _Healthy) for _ in range(count)]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield servers
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


def _url(server: ThreadingHTTPServer) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


@pytest.fixture(scope="module")
def workers() -> Iterator[list[str]]:
    with _healthy_servers(2) as servers:
        yield [_url(s) for s in servers]


@pytest.fixture(scope="module")
def router(tmp_path_factory) -> Iterator[Router]:
    with Router.start(log=tmp_path_factory.mktemp("router") / "router.log", timeout=5) as router:
        yield router


def test_add_list_remove_are_checked_in_the_worker_list(router, workers):
    a, b = workers
    assert router.workers() == []
    router.add(a)
    router.add(b + "/")  # the same worker as without the slash
    assert sorted(router.workers()) == sorted([a, b])
    router.add(a)  # listed already: nothing changes
    assert sorted(router.workers()) == sorted([a, b])
    router.remove(a)
    assert router.workers() == [b]
    router.remove(b)
    assert router.workers() == []


def test_the_router_answers_200_to_a_delete_that_removes_nothing(router, workers):
    """Why remove() reads the list back: deleting by anything but the encoded URL is a silent no-op."""
    a = workers[0]
    router.add(a)
    for path in ("/workers/0", "/workers/" + urllib.parse.quote("http://127.0.0.1:1", safe="")):
        with urllib.request.urlopen(urllib.request.Request(router.url + path, method="DELETE"), timeout=5) as answer:
            assert answer.status == 200
    assert router.workers() == [a]
    router.remove(a)
    assert router.workers() == []


def test_removing_an_unknown_url_changes_nothing(router, workers):
    router.add(workers[0])
    router.remove("http://127.0.0.1:1")
    assert router.workers() == [workers[0]]
    router.remove(workers[0])


def test_adding_a_server_that_does_not_answer_is_a_router_error(router):
    impatient = Router(router.url, timeout=1)  # the router itself would wait for the server's start
    with pytest.raises(RouterError, match="could not add it") as caught:
        impatient.add("http://127.0.0.1:1")
    assert caught.value.worker == "http://127.0.0.1:1" and caught.value.router == router.url
    assert router.workers() == []


def test_a_router_that_is_gone_is_a_clear_error(tmp_path, workers):
    router = Router.start(timeout=2)
    url = router.url
    router.close()
    for call in (router.workers, lambda: router.add(workers[0]), lambda: router.remove(workers[0])):
        with pytest.raises(RouterError, match="Is the router running there") as caught:
            call()
        assert url in str(caught.value) and caught.value.router == url


def test_the_gate_takes_a_server_out_only_while_another_live_one_stays_in(router):
    with _healthy_servers(2) as servers:
        live, other = (_url(s) for s in servers)
        router.add(live)
        router.add(other)
        gate = RouterGate(router)
        with gate.hold(live, 1):
            assert router.workers() == [other]  # out for its update: the other one serves meanwhile
        assert sorted(router.workers()) == sorted([live, other])

        servers[1].shutdown()  # the other one dies; the router still lists it (nobody deregistered it)
        servers[1].server_close()
        with gate.hold(live, 2):
            assert sorted(router.workers()) == sorted([live, other])  # updated in place: still routed to
        assert sorted(router.workers()) == sorted([live, other])
        router.remove(other)
        router.remove(live)


class _Recording(BaseHTTPRequestHandler):
    """A worker that answers every request with an empty JSON object and keeps the Authorization headers."""

    authorizations: list[str | None] = []

    def _answer(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        type(self).authorizations.append(self.headers.get("Authorization"))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    do_GET = do_POST = _answer  # noqa: N815 - http.server's names

    def log_message(self, *args: object) -> None:
        pass


def test_the_routers_api_key_is_in_its_environment_not_on_its_command_line(tmp_path):
    """vllm-router takes its key only as --api-key, and its command line is readable by every user of the host
    (until vllm-router renames its process, ~0.5 s after its start): while Router.start starts it, no process
    under this one shows the key; the router still sends it to its workers (the cache-aware policy asks a
    worker to tokenize a prompt, with the key)."""
    key = "s3cret-router-key"
    worker = ThreadingHTTPServer(("127.0.0.1", 0), _Recording)
    threading.Thread(target=worker.serve_forever, daemon=True).start()
    lines: list[bytes] = []
    started = threading.Event()

    def watch() -> None:
        while not started.is_set():
            lines.extend(command_lines_under(os.getpid()))

    watching = threading.Thread(target=watch)
    watching.start()
    try:  # started from this thread: the router dies with the thread that started it
        router = Router.start(api_key=key, policy="cache_aware", log=tmp_path / "log")
    finally:
        started.set()
        watching.join()
    try:
        assert any(b"launch" in line for line in lines)  # seen while it started
        assert not any(key.encode() in line for line in lines)
        url = f"http://127.0.0.1:{worker.server_address[1]}"
        router.add(url)
        request = urllib.request.Request(router.url + "/v1/completions", method="POST",
                                         data=json.dumps({"model": "m", "prompt": "x"}).encode(),
                                         headers={"Content-Type": "application/json"})
        urllib.request.urlopen(request, timeout=30).read()
        assert f"Bearer {key}" in _Recording.authorizations
    finally:
        router.close()
        worker.shutdown()
