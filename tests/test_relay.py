"""The relay (``ckptstream relay``) and streams read through it: what it serves and refuses, its metrics,
discovery without listing (the latest-version hint, gc'd streams), the CLI over HTTP, and a follower."""

from __future__ import annotations

import functools
import http.client
import json
import logging
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from ckptstream import Publisher, Stream
from ckptstream.cli import main
from ckptstream.errors import EXIT_INTERRUPTED, EXIT_USAGE, StorageAccessError
from ckptstream.format import LATEST_HINT_FILE, LEASES_DIR, REPLICAS_DIR, STREAM_FILE, manifest_path
from ckptstream.hf import iter_hf_weights
from ckptstream.relay import Relay
from ckptstream.storage import open_storage
from ckptstream.testing.fake_vllm import FakeVllmClient
from ckptstream.testing.models import rl_like_step
from ckptstream.vllm_loader import Follower
from ckptstream.writer import collect_garbage
from tests.helpers import assert_same_tensors, random_state

TOKEN = "relay-token"


def _get(relay: Relay, path: str, *, method: str = "GET", token: str | None = TOKEN,
         headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """One raw request (http.client sends the path as given: no client-side normalization of `..`)."""
    connection = http.client.HTTPConnection("127.0.0.1", relay.port, timeout=10)
    try:
        sent = dict(headers or {})
        if token is not None:
            sent["Authorization"] = f"Bearer {token}"
        connection.request(method, path, headers=sent)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def _sample(relay: Relay, name: str, **labels: str) -> float:
    status, body = _get(relay, "/metrics")
    assert status == 200
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return 0.0


DATA = "versions/000000000000/model-0123456789ab-00001-of-00001.safetensors"
MANIFEST = "manifests/000000000000.json"


@pytest.fixture
def served(tmp_path: Path):
    """A directory in the stream's layout, a few files outside it (hidden, temporary, notes, a replica record,
    a lease, a link), relayed with a token."""
    root = tmp_path / "root"
    for path, data in ((MANIFEST, b'{"a": 1}'), (DATA, bytes(range(256)) * 64), (STREAM_FILE, b"{}"),
                       (LATEST_HINT_FILE, b'{"version": 0}'), ("assets/config.json", b"{}"),
                       (".hidden", b"secret"), ("manifests/.tmp-123-a.json", b"partial"), ("NOTES.txt", b"notes"),
                       (f"{REPLICAS_DIR}/x.json", b'{"host": "rollout-7", "url": "http://10.0.0.7:8000"}'),
                       (f"{LEASES_DIR}/000000000000-abc.json", b"{}"), ("manifests/1.json", b"{}"),
                       ("versions/1/x.safetensors", b"x"), ("versions/000000000000/.tmp-1-x", b"partial")):
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(data)
    (tmp_path / "outside.txt").write_bytes(b"outside")
    (root / "versions" / "000000000000" / "link").symlink_to(tmp_path / "outside.txt")
    with Relay(root, token=TOKEN) as relay:
        yield relay


# ------------------------------------------------------------------------------------- what it serves


def test_token_is_required(served):
    assert _get(served, f"/{DATA}", token=None)[0] == 401
    assert _get(served, f"/{DATA}", token="wrong")[0] == 401
    assert _get(served, "/metrics", token=None)[0] == 401
    status, body = _get(served, f"/{DATA}")
    assert status == 200 and body == bytes(range(256)) * 64
    with pytest.raises(StorageAccessError, match="401.*token"):
        open_storage(served.url, {"token": "wrong"}).read(DATA)


def test_token_from_the_environment(served, monkeypatch):
    monkeypatch.setenv("CKPTSTREAM_HTTP_TOKEN", TOKEN)
    assert open_storage(served.url).read(MANIFEST) == b'{"a": 1}'


def test_only_the_streams_files_are_served(served):
    for path in ("/.hidden", "/manifests/.tmp-123-a.json", "/../outside.txt", "/manifests/../../outside.txt",
                 "/%2e%2e/outside.txt", "/versions/000000000000/link", "/manifests", "/manifests/", "/",
                 "/nothing", f"//{DATA}", "/versions/000000000000/.tmp-1-x", "/manifests/missing.json"):
        assert _get(served, path)[0] == 404, path
    for method in ("PUT", "POST", "DELETE"):
        assert _get(served, f"/{DATA}", method=method)[0] == 405
    for path in (MANIFEST, DATA, STREAM_FILE, LATEST_HINT_FILE, "assets/config.json"):
        assert _get(served, f"/{path}")[0] == 200, path
    connection = http.client.HTTPConnection("127.0.0.1", served.port, timeout=10)
    connection.request("GET", "/manifests/000000000001.json", headers={"Authorization": f"Bearer {TOKEN}"})
    assert connection.getresponse().getheader("Cache-Control") == "no-store"  # a CDN must not keep the miss
    connection.close()


def test_files_outside_the_stream_layout_are_not_served(served):
    """Only what readers read (FORMAT.md, "Layout"): not an operator's notes, nor replica records (host
    names and URLs of the rollout servers) or leases, nor names that are not versions."""
    for path in ("/NOTES.txt", f"/{REPLICAS_DIR}/x.json", f"/{LEASES_DIR}/000000000000-abc.json",
                 "/manifests/1.json", "/versions/1/x.safetensors"):
        assert _get(served, path)[0] == 404, path


def test_ranges_and_sent_bytes_in_metrics(served):
    data = bytes(range(256)) * 64
    status, body = _get(served, f"/{DATA}", headers={"Range": "bytes=100-199"})
    assert status == 206 and body == data[100:200]
    assert _get(served, f"/{DATA}", headers={"Range": "bytes=99999-"})[0] == 416
    assert _get(served, f"/{DATA}", method="HEAD")[0] == 200
    storage = open_storage(served.url, {"token": TOKEN})
    received = len(storage.read(DATA)) + sum(map(len, storage.read_ranges(DATA, [(0, 10), (50, 5000)])))
    received += len(storage.read(MANIFEST))
    assert _get(served, "/nothing")[0] == 404
    assert _get(served, f"/{DATA}", token=None)[0] == 401
    expected = 100 + received
    assert served.sent_bytes == expected
    assert _sample(served, "ckptstream_relay_sent_bytes_total") == expected
    assert _sample(served, "ckptstream_relay_requests_total", status="206") == 3
    assert _sample(served, "ckptstream_relay_requests_total", status="404") == 1
    assert _sample(served, "ckptstream_relay_requests_total", status="401") == 1
    assert _sample(served, "ckptstream_relay_requests_total", status="416") == 1


# ---------------------------------------------------------------------------------------- connections

HEADER_DEADLINE = 0.5


def _closed_by_relay(sock: socket.socket, timeout: float = 10.0) -> bool:
    """Whether the relay closes ``sock`` within ``timeout`` seconds (having sent nothing more)."""
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:  # closed while the client was still sending
        return True
    except TimeoutError:
        return False


def _trickle(sock: socket.socket, stop: threading.Event) -> None:
    """A slow client: a request header sent a byte at a time, never ended, until the relay hangs up."""
    try:
        sock.sendall(b"GET /stream.json HTTP/1.1\r\nHost: relay\r\nX-Slow: ")
        while not stop.wait(0.05):
            sock.send(b"a")
    except OSError:
        pass


def _connect(relay: Relay) -> socket.socket:
    return socket.create_connection(("127.0.0.1", relay.port), timeout=10)


def test_a_header_not_complete_by_the_deadline_is_cut_off(served):
    """A silent connection, a trickled header and a trickled second request of a keep-alive connection are
    each closed once the header deadline has passed (before, they kept the connection open for ever)."""
    with Relay(served.directory, token=TOKEN, header_timeout=HEADER_DEADLINE) as relay:
        kept_alive = http.client.HTTPConnection("127.0.0.1", relay.port, timeout=10)
        kept_alive.request("GET", f"/{STREAM_FILE}", headers={"Authorization": f"Bearer {TOKEN}"})
        assert kept_alive.getresponse().read() == b"{}"
        silent, trickled = _connect(relay), _connect(relay)
        stop = threading.Event()
        trickling = [threading.Thread(target=_trickle, args=(s, stop)) for s in (trickled, kept_alive.sock)]
        started = time.monotonic()
        for thread in trickling:
            thread.start()
        try:
            for sock in (silent, trickled, kept_alive.sock):
                assert _closed_by_relay(sock)
            assert time.monotonic() - started >= HEADER_DEADLINE * 0.9
        finally:
            stop.set()
            for thread in trickling:
                thread.join()
            for sock in (silent, trickled):
                sock.close()
            kept_alive.close()
        assert _sample(relay, "ckptstream_relay_dropped_connections_total", reason="header_timeout") == 3
        assert _get(relay, f"/{MANIFEST}") == (200, b'{"a": 1}')


def test_connections_beyond_the_limit_make_room_or_are_refused(served):
    """At the limit a new connection closes the oldest that waits for a request header, and is refused at
    once when every connection is in a request; valid requests are served either way."""
    big = served.directory / "versions" / "000000000000" / "big.safetensors"
    with open(big, "wb") as f:
        f.truncate(64 << 20)  # more than the socket buffers hold: a client that does not read stays in a request
    with Relay(served.directory, token=TOKEN, max_connections=4) as relay:
        silent = [_connect(relay) for _ in range(10)]
        try:
            assert all(_closed_by_relay(sock) for sock in silent[:6])  # the oldest, to make room
            assert _get(relay, f"/{MANIFEST}") == (200, b'{"a": 1}')
        finally:
            for sock in silent:
                sock.close()
        busy = [_connect(relay) for _ in range(4)]
        try:
            for sock in busy:
                sock.sendall(f"GET /{big.relative_to(served.directory)} HTTP/1.1\r\nHost: relay\r\n"
                             f"Authorization: Bearer {TOKEN}\r\n\r\n".encode())
                sock.recv(1)  # the answer has started: in a request, and it stops reading
            refused = _connect(relay)
            assert _closed_by_relay(refused)
            refused.close()
        finally:
            for sock in busy:
                sock.close()
        assert _get(relay, f"/{MANIFEST}") == (200, b'{"a": 1}')
        assert _sample(relay, "ckptstream_relay_dropped_connections_total", reason="limit") >= 7


def test_half_open_connections_do_not_block_a_valid_request(tmp_path):
    """300 connections that never send a byte, at a relay process allowed 256 descriptors: a valid request
    is still answered (it used to find the descriptors used up and be reset)."""
    url = str(tmp_path / "stream")
    _small_stream(url, 1)
    limit = functools.partial(resource.setrlimit, resource.RLIMIT_NOFILE, (256, 256))
    env = {**os.environ, "CKPTSTREAM_RELAY_TOKEN": TOKEN}
    process = subprocess.Popen([sys.executable, "-m", "ckptstream.cli", "relay", url, "--port", "0"], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=limit)
    half_open: list[socket.socket] = []
    try:
        host, port = process.stdout.readline().decode().strip().removeprefix("http://").split(":")
        half_open = [socket.create_connection((host, int(port)), timeout=10) for _ in range(300)]
        stream = Stream(f"http://{host}:{port}", storage_options={"token": TOKEN, "retries": 0})
        assert stream.versions() == [0]
    finally:
        for sock in half_open:
            sock.close()
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=30)
    assert code == 0, process.stderr.read().decode()


def test_an_empty_token_is_a_usage_error(served, capsys, monkeypatch):
    """An empty token used to mean no authentication, silently."""
    assert main(["relay", str(served.directory), "--port", "0", "--token", ""]) == EXIT_USAGE
    assert capsys.readouterr().err.startswith("Error:")
    monkeypatch.setenv("CKPTSTREAM_RELAY_TOKEN", "")
    assert main(["relay", str(served.directory), "--port", "0"]) == EXIT_USAGE
    assert "CKPTSTREAM_RELAY_TOKEN" in capsys.readouterr().err
    with pytest.raises(ValueError, match="empty"):
        Relay(served.directory, token="")


def test_secrets_on_the_command_line_still_work_with_a_warning(tmp_path, caplog, monkeypatch):
    """Command lines are readable by every user of the host: --token and --api-key say so (their variables
    are the quiet way)."""
    from ckptstream.cli import build_parser

    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    parser = build_parser()
    with caplog.at_level(logging.WARNING, "ckptstream.cli"):
        assert parser.parse_args(["relay", str(tmp_path), "--token", TOKEN]).token == TOKEN
        assert parser.parse_args(["serve", str(tmp_path), "--api-key", "k"]).api_key == "k"
        assert parser.parse_args(["follow", str(tmp_path), "--vllm-url", "http://x", "--api-key", "k"]).api_key == "k"
        monkeypatch.setenv("VLLM_API_KEY", "from-env")
        assert build_parser().parse_args(["serve", str(tmp_path)]).api_key == "from-env"
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 3 and all("visible to every user of this host" in w for w in warnings)
    assert "--token" in warnings[0] and "$CKPTSTREAM_RELAY_TOKEN" in warnings[0] and "$VLLM_API_KEY" in warnings[1]


def test_serving_beyond_loopback_without_a_token_warns(served, caplog, monkeypatch):
    monkeypatch.delenv("CKPTSTREAM_RELAY_TOKEN", raising=False)
    with caplog.at_level(logging.WARNING, "ckptstream.relay"):
        for host, token in (("0.0.0.0", None), ("0.0.0.0", TOKEN), ("127.0.0.1", None)):
            with Relay(served.directory, host=host, token=token):
                pass
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "0.0.0.0 without a token" in warnings[0]


# ------------------------------------------------------------------------------ streams over the relay


@pytest.fixture
def published(tmp_path: Path, tiny_model: Path):
    """A local stream of a tiny model (a keyframe and two deltas) and a relay serving it."""
    url = str(tmp_path / "stream")
    state = dict(iter_hf_weights(tiny_model))
    generator = torch.Generator().manual_seed(0)
    with Publisher(url, assets=tiny_model, keyframe_every=1000) as publisher:
        for step in range(3):
            if step:
                rl_like_step(state, fraction=0.1, generator=generator)
            publisher.publish(state).result()
    with Relay(url, token=TOKEN) as relay:
        yield url, relay


def _cli(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert code == 0, err
    return code, out


def test_ls_verify_materialize_over_http_match_the_local_stream(published, tmp_path, capsys, monkeypatch):
    url, relay = published
    monkeypatch.setenv("CKPTSTREAM_HTTP_TOKEN", TOKEN)
    _, local_ls = _cli(capsys, "ls", url, "--json")
    _, http_ls = _cli(capsys, "ls", relay.url, "--json")
    assert json.loads(http_ls) == json.loads(local_ls) and len(json.loads(local_ls)) == 3
    _, verified = _cli(capsys, "verify", relay.url, "--json")
    assert [(r["version"], r["ok"]) for r in json.loads(verified)] == [(0, True), (1, True), (2, True)]
    _cli(capsys, "materialize", relay.url, "latest", str(tmp_path / "over-http"), "--json")
    _cli(capsys, "materialize", url, "latest", str(tmp_path / "local"), "--json")
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "over-http" / name).read_bytes() == (tmp_path / "local" / name).read_bytes()
    assert_same_tensors(dict(Stream(relay.url, storage_options={"token": TOKEN}).iter_tensors(2)),
                        dict(Stream(url).iter_tensors(2)))


def test_the_publisher_writes_the_latest_version_hint(published):
    url, relay = published
    assert json.loads(Path(url, LATEST_HINT_FILE).read_bytes()) == {"version": 2}
    stream = Stream(relay.url, storage_options={"token": TOKEN})
    assert stream.latest() == 2 and stream.versions() == [0, 1, 2]


def _small_stream(url: str, versions: int) -> None:
    with Publisher(url, keyframe_every=1) as publisher:  # keyframes only: gc may retire any old version
        for step in range(versions):
            publisher.publish(random_state(step)).result()


def test_discovery_of_a_gcd_stream_with_and_without_the_hint(tmp_path):
    url = str(tmp_path / "stream")
    _small_stream(url, 30)
    collect_garbage(Stream(url), keep_last=3, keep_every=10, grace_seconds=0)
    kept = [0, 10, 20, 27, 28, 29]
    assert Stream(url).versions() == kept
    hint = Path(url, LATEST_HINT_FILE)
    with Relay(url) as relay:
        stream = Stream(relay.url)
        assert stream.versions() == kept and stream.latest() == 29
        hint.write_bytes(b'{"version": 24}')  # stale and gone: probing goes forward from it
        assert stream.versions() == kept and stream.latest() == 29
        hint.write_bytes(b'{"version": 31}')  # ahead of the stream (a broken writer): backward from it
        assert stream.versions() == kept and stream.latest() == 29
        hint.write_bytes(b"not json")  # worthless: probing starts at 0
        assert stream.versions() == kept and stream.latest() == 29
        hint.unlink()
        assert stream.versions() == kept  # from 0: the gaps are shorter than the probe window
        collect_garbage(Stream(url), keep_last=3, grace_seconds=0)
        # Without the hint, versions more than VERSION_PROBE_GAP past 0 are out of reach.
        assert stream.versions() == [] and stream.latest() is None
        hint.write_bytes(b'{"version": 29}')
        assert stream.versions() == [27, 28, 29] and stream.resolve("latest") == 29


def test_discovery_tolerates_skipped_numbers(tmp_path):
    url = str(tmp_path / "stream")
    with Publisher(url, keyframe_every=1) as publisher:
        for version in (0, 1, 5, 20, 21):  # gaps below VERSION_PROBE_GAP
            publisher.publish(random_state(version), version).result()
    with Relay(url) as relay:
        assert Stream(relay.url).versions() == [0, 1, 5, 20, 21]
        Path(url, LATEST_HINT_FILE).unlink()
        assert Stream(relay.url).latest() == 21


def test_follower_over_the_relay_follows_while_the_publisher_writes(tmp_path, caplog):
    url = str(tmp_path / "stream")
    publisher = Publisher(url, keyframe_every=4)
    publisher.publish(random_state(0)).result()
    server = FakeVllmClient()
    with Relay(url, token=TOKEN) as relay, caplog.at_level(logging.INFO, "ckptstream.follow"):
        follower = Follower(relay.url, [server], storage_options={"token": TOKEN}, cache_dir=tmp_path / "cache",
                            poll_interval=0.05, heartbeat_interval=0.05, list_every=3)
        stop = threading.Event()
        thread = threading.Thread(target=follower.run, args=(stop,))
        thread.start()
        try:
            for version in range(1, 6):
                assert publisher.publish(random_state(version)).result().version == version
                _wait(lambda: server.loaded_version == version)  # noqa: B023 - waited on at once
                Stream(url).check_materialized(server.loaded, version)  # every tensor's hash
        finally:
            stop.set()
            thread.join(timeout=30)
            follower.close()
            publisher.close()
    assert list(server.reloaded)[-5:] == [1, 2, 3, 4, 5]
    assert not Path(url, REPLICAS_DIR).exists()  # read-only: no records, and said once
    messages = [r.getMessage() for r in caplog.records]
    assert sum("writes no replica record" in m for m in messages) == 1
    assert not any("cannot write replica record" in m for m in messages)
    assert relay.sent_bytes > 0


def _wait(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


# ---------------------------------------------------------------------------------- the command


def test_relay_command_prints_its_url_serves_and_stops_on_ctrl_c(tmp_path):
    url = str(tmp_path / "stream")
    _small_stream(url, 2)
    env = {**os.environ, "CKPTSTREAM_RELAY_TOKEN": TOKEN}
    process = subprocess.Popen([sys.executable, "-m", "ckptstream.cli", "relay", url, "--port", "0"], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        relay_url = process.stdout.readline().decode().strip()
        assert relay_url.startswith("http://127.0.0.1:")
        assert Stream(relay_url, storage_options={"token": TOKEN}).versions() == [0, 1]
        with pytest.raises(StorageAccessError):
            Stream(relay_url, storage_options={"retries": 0}).versions()
    finally:
        process.send_signal(signal.SIGINT)
        code = process.wait(timeout=30)
    assert code == EXIT_INTERRUPTED, process.stderr.read().decode()


def test_relay_of_a_missing_directory_is_not_found(tmp_path, capsys):
    assert main(["relay", str(tmp_path / "nothing"), "--port", "0"]) == 4
    assert capsys.readouterr().err.startswith("Error:")


def test_manifest_path_is_probed_not_listed(published):
    """Discovery over HTTP asks only for names it knows (HEAD of manifests), never a directory."""
    url, relay = published
    before = _sample(relay, "ckptstream_relay_requests_total", status="404")
    assert Stream(relay.url, storage_options={"token": TOKEN}).latest() == 2
    misses = _sample(relay, "ckptstream_relay_requests_total", status="404") - before
    assert 0 < misses <= 16 and Path(url, manifest_path(2)).exists()


def test_a_stream_on_a_plain_static_server(published, capsys):
    """python's http.server ignores Range (200 with the whole file): every read still gets its bytes."""
    from ckptstream.testing.http import StaticHttpServer

    url, _ = published
    with StaticHttpServer(url) as server:
        stream = Stream(server.url)
        assert stream.versions() == [0, 1, 2] and stream.verify("latest").tensors > 0
        assert_same_tensors(dict(stream.iter_tensors(1)), dict(Stream(url).iter_tensors(1)))
        assert main(["ls", f"{server.url}/nothing-here"]) == 4
        assert "no stream at" in capsys.readouterr().err


def test_cli_without_the_token_says_to_set_it(published, capsys):
    _, relay = published
    assert main(["ls", relay.url, "-o", "retries=0"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("Error:") and "401" in err and "CKPTSTREAM_HTTP_TOKEN" in err


def test_backward_probing_is_bounded(tmp_path):
    """A long stream over HTTP lists the newest MAX_BACKWARD_PROBES + 1 versions (probing only looks at
    names, so empty manifest files stand in for real ones here)."""
    from ckptstream.reader.probe import MAX_BACKWARD_PROBES

    root = tmp_path / "long"
    (root / "manifests").mkdir(parents=True)
    newest = MAX_BACKWARD_PROBES + 100
    for version in range(newest + 1):
        (root / manifest_path(version)).touch()
    (root / LATEST_HINT_FILE).write_bytes(json.dumps({"version": newest}).encode())
    with Relay(root) as relay:
        stream = Stream(relay.url)
        assert stream.latest() == newest
        assert stream.versions() == list(range(newest - MAX_BACKWARD_PROBES, newest + 1))


def test_a_port_in_use_is_a_clear_error(served):
    from ckptstream.errors import CkptStreamError

    with pytest.raises(CkptStreamError, match=f"cannot listen on 127.0.0.1:{served.port}"):
        Relay(served.directory, port=served.port).start()
