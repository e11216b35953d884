"""Shared fixtures: stream URLs on every backend (a local directory and a real S3-protocol server on
loopback, moto's server mode as in the s3fs test suite), tiny models and tensor helpers."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Iterator

import pytest

from ckptstream.testing.models import TinyModelSpec, write_tiny_model
from tests.helpers import PROMPTS, VLLM_CPU_ARGS, new_bucket

BACKENDS = ["local", "s3"]
logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's request log


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """A moto S3 server on 127.0.0.1, configured the standard AWS way (environment variables)."""
    pytest.importorskip("s3fs")
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
                                            "AWS_ENDPOINT_URL")}
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=endpoint)
    yield endpoint
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    server.stop()


@pytest.fixture(params=BACKENDS)
def stream_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, empty stream location on each backend."""
    if request.param == "local":
        return str(tmp_path / "stream")
    endpoint = request.getfixturevalue("s3_endpoint")
    return f"s3://{new_bucket(endpoint)}/runs/stream"


@pytest.fixture
def local_url(tmp_path: Path) -> str:
    return str(tmp_path / "stream")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 model directory (single safetensors file)."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2", TinyModelSpec())


# ------------------------------------------------------------------------------------------ vLLM servers


class VllmServer:
    """A real vLLM (vllm-cpu here) OpenAI server in a child process, with the dev-mode routes on loopback."""

    def __init__(self, model_dir: Path, log_dir: Path, port: int | None = None, served_name: str = "model"):
        import subprocess

        from ckptstream.vllm_loader import VllmClient, free_port, vllm_command

        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
        self.log = open(log_dir / f"vllm-{self.port}.log", "wb")
        command = vllm_command(str(model_dir), "127.0.0.1", self.port, VLLM_CPU_ARGS, served_name)
        self.process = subprocess.Popen(command,
                                        env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.client = VllmClient(self.url)
        import threading

        died = threading.Event()
        threading.Thread(target=lambda: (self.process.wait(), died.set()), daemon=True).start()
        try:
            self.client.wait_ready(timeout=600, abort=died)
        except Exception:
            self.stop()
            raise RuntimeError(f"vLLM did not start; see {self.log.name}") from None

    def outputs(self, max_tokens: int = 8) -> list[list[int]]:
        """Greedy token ids for the fixed prompt set."""
        return [self.client.generate(p, max_tokens) for p in PROMPTS]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=60)
            except Exception:
                self.process.kill()
                self.process.wait()
        self.log.close()


@pytest.fixture(scope="session")
def vllm_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """Start real vLLM servers: ``start(model_dir) -> VllmServer``; all are stopped at the end."""
    import importlib.util

    assert importlib.util.find_spec("vllm") is not None, "vllm is not installed: run `make test`"
    log_dir = tmp_path_factory.mktemp("vllm-logs")
    started: list[VllmServer] = []

    def start(model_dir: Path, port: int | None = None) -> VllmServer:
        server = VllmServer(model_dir, log_dir, port)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


