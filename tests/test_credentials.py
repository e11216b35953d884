"""Credentials in URLs and storage options (``ckptstream.credentials``): every form found and refused by the
weight-transfer backend's check, every form redacted; and secrets fed through the failure paths of the
follower, a relay's clients, the mirror and the fleet (the CLI's too) appear in no log record, exception text
(its whole traceback) or answer. The weight-transfer backend's own paths run on real vLLM in
``tests/vllm_loader/test_weight_transfer.py``."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
import traceback
from typing import Iterator

import pytest

from ckptstream import Publisher, Stream
from ckptstream.cli import main
from ckptstream.credentials import REDACTED, credential_paths, redact
from ckptstream.errors import CkptStreamError, StorageAccessError
from ckptstream.format import REPLICAS_DIR
from ckptstream.mirror import Mirror, MirrorConfig
from ckptstream.process import free_port
from ckptstream.relay import Relay
from ckptstream.storage import open_storage
from ckptstream.testing.fake_vllm import FakeVllmClient
from ckptstream.weight_transfer import refuse_credentials
from tests.helpers import CREDENTIAL_FORMS, SECRET, random_state


# ------------------------------------------------------------------------------------------ refusal


@pytest.mark.parametrize(("received", "where"), CREDENTIAL_FORMS, ids=[where for _, where in CREDENTIAL_FORMS])
def test_each_form_of_credential_is_refused_naming_where_it_is_never_its_value(received, where):
    assert credential_paths(received) == [where]
    with pytest.raises(ValueError) as refused:
        refuse_credentials(received, "init_info")
    message = str(refused.value)
    assert where in message and SECRET not in message
    for belongs in ("AWS_ACCESS_KEY_ID", "fsspec", "$CKPTSTREAM_HTTP_TOKEN", "$CKPTSTREAM_RELAY_TOKEN"):
        assert belongs in message


def test_what_holds_no_credential_passes():
    refuse_credentials({"url": "s3://b/run@2", "cache_dir": "/dev/shm/x", "prefetch": True, "poll_interval": 0.5,
                        "storage_options": {"endpoint_url": "http://127.0.0.1:9000", "region_name": "x",
                                            "headers": {"User-Agent": "rl", "X-Trace": "abc"}, "retries": 3,
                                            "s3_additional_kwargs": {"SSEKMSKeyId": "arn:k"},
                                            "config_kwargs": {"retries": {"max_attempts": 3},
                                                              "signature_version": "s3v4"}}}, "init_info")


# ---------------------------------------------------------------------------------------- redaction


@pytest.mark.parametrize(("text", "shown"), [
    (f"http://reader:{SECRET}@host:8/s", "http://***@host:8/s"),
    (f"https://{SECRET}@host/s/x.json", "https://***@host/s/x.json"),
    (f"GET http://u:p@{SECRET}@127.0.0.1:9/s/stream.json failed", "GET http://***@127.0.0.1:9/s/stream.json failed"),
    (f"{{'url': 'http://u:{SECRET}@h', 'b': \"s3://k:{SECRET}@bucket/r\"}}", "{'url': 'http://***@h', 'b': \"s3://***@bucket/r\"}"),
    (f"GET https://b.s3.amazonaws.com/r/x?X-Amz-Date=1&X-Amz-Signature={SECRET}#f failed",
     "GET https://b.s3.amazonaws.com/r/x?X-Amz-Date=1&X-Amz-Signature=***#f failed"),
    (f"'https://a.blob.core.windows.net/c?sv=1&sig={SECRET}&se=2', http://u:{SECRET}@h/x?token={SECRET}",
     "'https://a.blob.core.windows.net/c?sv=1&sig=***&se=2', http://***@h/x?token=***"),
    *[(kept, kept) for kept in ("s3://bucket/run@2 http://host/p?a=b@c mail me@example.org", "/dev/shm/x@2",
                                "http://h/p?versionId=3 and then a&token=3 outside the URL")],
])
def test_urls_lose_their_userinfo_wherever_they_are_in_a_text(text, shown):
    assert redact(text) == shown


def test_options_lose_credentials_and_header_values_at_any_depth():
    options = {"headers": {"X-Trace": SECRET, "Authorization": SECRET}, "token": SECRET, "retries": 3,
               "client_kwargs": {"endpoint_url": f"http://u:{SECRET}@s3", "aws_secret_access_key": SECRET,
                                 "region_name": "eu"}, "list": [f"http://u:{SECRET}@a", 1.5, None, True],
               "pair": ("x", f"Bearer {SECRET}")}
    assert redact(options) == {
        "headers": {"X-Trace": REDACTED, "Authorization": REDACTED}, "token": REDACTED, "retries": 3,
        "client_kwargs": {"endpoint_url": "http://***@s3", "aws_secret_access_key": REDACTED, "region_name": "eu"},
        "list": ["http://***@a", 1.5, None, True], "pair": ("x", f"Bearer {SECRET}")}
    assert redact(FileNotFoundError(f"http://u:{SECRET}@h/s: not found")) == "http://***@h/s: not found"
    assert SECRET not in str(CkptStreamError(f"reading http://u:{SECRET}@h/s failed", hint=f"http://{SECRET}@h"))


# ------------------------------------------------------------------------------------ failure paths


def closed_url(path: str = "s") -> str:
    """An HTTP stream URL with a password, on a port nothing listens on."""
    return f"http://reader:{SECRET}@127.0.0.1:{free_port()}/{path}"


def wait_until(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


QUICK = {"retries": 0, "timeout": 5, "headers": {"X-Trace": SECRET}}
"""Storage options of a stream that fails at once, carrying a secret in a header (not refused: only sent)."""


def assert_nowhere(caplog: pytest.LogCaptureFixture, *texts: object) -> None:
    """The secret is in no log record (message and traceback) and in none of ``texts`` (an exception: its
    whole traceback, chained exceptions included)."""
    for record in caplog.records:
        assert SECRET not in record.getMessage(), record.getMessage()
        if record.exc_info:
            assert SECRET not in logging.Formatter().formatException(record.exc_info)
    for text in texts:
        if isinstance(text, BaseException):
            text = "".join(traceback.format_exception(text))
        assert SECRET not in str(text), text


@contextlib.contextmanager
def logged(logger: str, words: str) -> Iterator[threading.Event]:
    """An event set when ``logger`` (or a child) logs a line holding ``words``."""
    seen = threading.Event()

    class Watch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if words in record.getMessage():
                seen.set()

    watch = Watch()
    logging.getLogger(logger).addHandler(watch)
    try:
        yield seen
    finally:
        logging.getLogger(logger).removeHandler(watch)


def test_the_follower_against_an_unreachable_stream(caplog, capsys, tmp_path):
    from ckptstream.vllm_loader import Follower

    caplog.set_level(logging.DEBUG)
    url = closed_url()
    with pytest.raises(StorageAccessError) as failed:
        Follower(url, [f"http://127.0.0.1:{free_port()}"], storage_options=QUICK, cache_dir=str(tmp_path / "c"))
    assert "http://***@127.0.0.1" in str(failed.value)
    code = main(["follow", url, "--vllm-url", f"http://127.0.0.1:{free_port()}", "--cache-dir", str(tmp_path / "c"),
                 "-o", "retries=0", "-o", f"headers={json.dumps(QUICK['headers'])}"])
    err = capsys.readouterr().err
    assert code != 0 and "Error:" in err and "http://***@127.0.0.1" in err
    assert_nowhere(caplog, failed.value, err)


def test_a_follower_whose_relay_goes_away(caplog, tmp_path):
    from ckptstream.vllm_loader import Follower

    caplog.set_level(logging.DEBUG)
    root, server = tmp_path / "run", FakeVllmClient()
    with Publisher(str(root)) as publisher:
        publisher.publish(random_state()).result()
    relay = Relay(root, token=SECRET).start()
    url = relay.url.replace("http://", f"http://reader:{SECRET}@")
    follower = Follower(url, [server], storage_options={**QUICK, "token": SECRET}, cache_dir=tmp_path / "cache",
                        poll_interval=0.05, heartbeat_interval=0.05, metrics_port=0)
    stop = threading.Event()
    thread = threading.Thread(target=follower.run, args=(stop,))
    with logged("ckptstream", "retrying") as retrying:
        thread.start()
        try:
            wait_until(lambda: server.loaded_version == 0)
            relay.stop()
            assert retrying.wait(60), "the follower never retried"
        finally:
            stop.set()
            thread.join(60)
            follower.close()
    assert "http://***@127.0.0.1" in follower.record.last_error
    assert_nowhere(caplog, follower.record.last_error, json.dumps(follower.record.__dict__, default=str))


def test_a_relays_clients_refused_or_missing(caplog, tmp_path):
    caplog.set_level(logging.DEBUG)
    root = tmp_path / "run"
    with Publisher(str(root)) as publisher:
        publisher.publish(random_state()).result()
    with Relay(root, token=SECRET) as relay:
        url = relay.url.replace("http://", f"http://reader:{SECRET}@")
        failures = []
        for options, path in (({**QUICK, "token": "wrong"}, "stream.json"), ({**QUICK, "token": SECRET}, "absent")):
            with pytest.raises((StorageAccessError, FileNotFoundError)) as failed:
                open_storage(url, options).read(path)
            failures.append(failed.value)
        with pytest.raises(CkptStreamError) as missing:
            Stream(f"{url}/absent", storage_options={**QUICK, "token": SECRET}).info()
        failures.append(missing.value)
    assert "401" in str(failures[0]) and "not found" in str(failures[1])
    assert all("http://***@127.0.0.1" in str(f) for f in failures)
    assert_nowhere(caplog, *failures)


def test_the_mirror_of_an_unreachable_stream(caplog, capsys, tmp_path):
    caplog.set_level(logging.DEBUG)
    url, dst = closed_url(), tmp_path / "dst"
    mirror = Mirror(Stream(url, storage_options=QUICK), open_storage(str(dst)),
                    MirrorConfig(replica_id="site", poll_interval=0.05, heartbeat_interval=0.05))
    with pytest.raises(StorageAccessError) as failed:
        mirror.run_once()
    stop = threading.Event()
    thread = threading.Thread(target=mirror.follow, args=(stop,))
    with logged("ckptstream.mirror", "retrying") as retrying:
        thread.start()
        try:
            assert retrying.wait(60), "the mirror never retried"
        finally:
            stop.set()
            thread.join(60)
    (record_file,) = (dst / REPLICAS_DIR).iterdir()
    record = json.loads(record_file.read_text())
    assert record["source"] == redact(url) and record["last_error"]
    code = main(["mirror", url, str(tmp_path / "dst2"), "-o", "retries=0"])
    err = capsys.readouterr().err
    assert code != 0 and "http://***@127.0.0.1" in err
    assert_nowhere(caplog, failed.value, record_file.read_text(), err)


def test_a_fleet_of_an_unreachable_stream(caplog):
    from ckptstream.fleet import Fleet

    caplog.set_level(logging.DEBUG)
    with pytest.raises(CkptStreamError) as failed:
        Fleet(closed_url(), storage_options=QUICK)
    assert "http://***@127.0.0.1" in str(failed.value)
    assert_nowhere(caplog, failed.value)

