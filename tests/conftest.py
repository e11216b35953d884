"""Shared fixtures: stream URLs on every backend (a local directory and a real S3-protocol server on
loopback, moto's server mode as in the s3fs test suite), tiny models and tensor helpers."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Iterator, Sequence

import pytest

from ckptstream.testing.models import TinyModelSpec, write_tiny_model
from tests.helpers import PROMPTS, VLLM_CPU_ARGS, new_bucket

BACKENDS = ["local", "s3"]
logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's request log


# ------------------------------------------------------------------------------------ parallel runs (xdist)

POOL_GROUP = "vllm-pool"
"""The xdist group of every test that takes servers from ``server_pool``."""

LONGEST_FIRST = (POOL_GROUP, "tests.fleet.test_fleet", "tests.vllm_loader.test_serve_replay", "tests.test_launch",
                 "tests.vllm_loader.test_multinode", "tests.vllm_loader.test_follower", "tests.test_docs",
                 "tests.test_demo", "tests.vllm_loader.test_follow_http", "tests.vllm_loader.test_in_place")
"""The groups that start vLLM servers or a Ray cluster, longest first (one after the other: ~500, 330, 150, 100,
100, 70, 165, 60, 100 and 150 s in serial runs): handed out first, so that the light groups fill the gaps at the end
rather than a long group starting last."""


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups into the test ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Groups for ``pytest -n 2 --dist loadgroup`` (the Makefile's test target): a test runs in the worker of its
    group, by default its module, so that a module-scoped fixture (a fleet, a two-node engine) is built once;
    the tests of the server pool share one group, so that one worker starts one pool (each worker process has
    its own session fixtures). Groups in ``LONGEST_FIRST`` come first (a stable sort keeps each group's order)."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            group = POOL_GROUP if uses_pool(item) else item.module.__name__
            item.add_marker(pytest.mark.xdist_group(group))

    def rank(item: pytest.Item) -> int:
        group = item.get_closest_marker("xdist_group").args[0]
        return LONGEST_FIRST.index(group) if group in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)


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

    def __init__(self, model_dir: Path, log_dir: Path, port: int | None = None, served_name: str = "model",
                 tensor_parallel: int = 1, vllm_args: Sequence[str] = (), env: dict[str, str] | None = None):
        import subprocess

        from ckptstream.vllm_loader import VllmClient, free_port, vllm_command

        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # The KV cache's size is VLLM_CPU_ARGS' --kv-cache-memory-bytes, which VLLM_CPU_KVCACHE_SPACE would override.
        env = {**{k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}, "VLLM_SERVER_DEV_MODE": "1",
               **(env or {})}
        args = [*VLLM_CPU_ARGS, *vllm_args]
        if tensor_parallel > 1:  # one core per rank: vllm-cpu binds each worker's threads
            args += ["--tensor-parallel-size", str(tensor_parallel), "--distributed-executor-backend", "mp"]
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(rank % (os.cpu_count() or 1))
                                                         for rank in range(tensor_parallel))
        self.log = open(log_dir / f"vllm-{self.port}.log", "wb")
        command = vllm_command(str(model_dir), "127.0.0.1", self.port, args, served_name)
        self.process = subprocess.Popen(command,
                                        env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.client = VllmClient(self.url)
        import threading

        died = threading.Event()
        threading.Thread(target=lambda: (self.process.wait(), died.set()), daemon=True).start()
        try:
            self.client.wait_ready(timeout=600, abort=died)
        except Exception as exc:  # its own log is empty when the wait, not vLLM, failed: the cause says why
            self.stop()
            raise RuntimeError(f"vLLM did not start ({exc!r}); see {self.log.name}") from exc

    def outputs(self, max_tokens: int = 8) -> list[list[int]]:
        """Greedy token ids for the fixed prompt set."""
        return [self.client.generate(p, max_tokens) for p in PROMPTS]

    def stop(self) -> None:
        """Stop vLLM as ``ckptstream serve`` does: SIGTERM, its processes given 60 s, then the shared memory
        they left removed."""
        from ckptstream.process import stop_process
        from ckptstream.shm import EngineSegments

        if self.process.poll() is None:
            segments = EngineSegments()
            segments.note(self.process.pid)
            stop_process(self.process, timeout=60)
            segments.remove_orphans()
        self.log.close()


@pytest.fixture(scope="session")
def vllm_log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where every vLLM server of the session writes its log (``vllm-PORT.log``)."""
    import importlib.util

    assert importlib.util.find_spec("vllm") is not None, "vllm is not installed: run `make test`"
    return tmp_path_factory.mktemp("vllm-logs")


@pytest.fixture(scope="module")
def vllm_servers(vllm_log_dir: Path) -> Iterator:
    """Start real vLLM servers: ``start(model_dir, tensor_parallel=1, vllm_args=(), env=None) -> VllmServer``
    (``vllm_args`` after the CPU ones, ``env`` over this process's environment). Those still running are
    stopped when the module's tests are done: servers left running add up (~1.6 GiB each)."""
    started: list[VllmServer] = []

    def start(model_dir: Path, port: int | None = None, tensor_parallel: int = 1, vllm_args: Sequence[str] = (),
              env: dict[str, str] | None = None) -> VllmServer:
        server = VllmServer(model_dir, vllm_log_dir, port, tensor_parallel=tensor_parallel, vllm_args=vllm_args,
                            env=env)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


class ServerPool:
    """Real vLLM servers of the tiny Qwen2 model (``TinyModelSpec()``, what the ``tiny_model`` fixture
    writes), shared by the tests that need a server serving that model but not a start of their own: a start
    costs 30-60 s on this machine, most of those tests' time. ``take`` hands servers out in the state of a
    fresh start on that model (its weights reloaded from the model directory, the prefix cache reset, the
    weight version ``default``); ``give_back`` returns them when the test or module is done with them.
    ``close`` stops them all: ``pytest_runtest_teardown`` calls it once the last of the tests that use the
    pool in a row is done (they run in a row: one xdist group), so that the pool's servers do not sit idle
    beside the servers of the tests after them; a later ``take`` starts servers again."""

    SIZE = 2
    """Servers started together on the first ``take``: the most one module takes (two overlapping starts
    cost little more than one)."""

    def __init__(self, model_dir: Path, log_dir: Path):
        self._model_dir = model_dir
        self._log_dir = log_dir
        self._idle: list[VllmServer] = []
        self._started: list[VllmServer] = []

    def start(self, port: int | None = None) -> VllmServer:
        """A fresh start of a server of the tiny model (on ``port``, if given), the pool's to stop."""
        server = VllmServer(self._model_dir, self._log_dir, port)
        self._started.append(server)
        return server

    def take(self, count: int) -> list[VllmServer]:
        """``count`` servers serving the tiny model with weight version ``default``, started if needed."""
        from concurrent.futures import ThreadPoolExecutor

        ready: list[VllmServer] = []
        while self._idle and len(ready) < count:
            server = self._idle.pop()
            if self._reset(server):
                ready.append(server)
        missing = count - len(ready)
        if missing:
            starts = max(missing, self.SIZE - len(ready) - len(self._idle))
            with ThreadPoolExecutor(starts) as starting:
                fresh = list(starting.map(lambda _: self.start(), range(starts)))
            ready += fresh[:missing]
            self._idle += fresh[missing:]
        return ready

    def give_back(self, servers: list[VllmServer]) -> None:
        """Return servers taken (or started by ``start``); stopped ones are dropped."""
        self._idle += [server for server in servers if server.process.poll() is None]

    def close(self) -> None:
        """Stop every server the pool started."""
        for server in self._started:
            server.stop()
        self._idle, self._started = [], []

    def _reset(self, server: VllmServer) -> bool:
        """Put a server back into the state of a fresh start; a server that cannot be is stopped."""
        from ckptstream.httpjson import request_json
        from ckptstream.vllm_loader.worker import SET_LABEL_METHOD

        client = server.client
        try:
            client.pause()
            client.reload_weights(str(self._model_dir))
            client.reset_prefix_cache()
            client.resume()
            client.set_weight_version("default")
            request_json(server.url + "/collective_rpc", "POST",  # the label a test without native ones left
                         {"method": SET_LABEL_METHOD, "kwargs": {"label": "default"}}, timeout=30)
            client.probe()
            return True
        except Exception:  # noqa: BLE001 - a server a test left broken is replaced, not reused
            server.stop()
            return False


POOL_KEY = pytest.StashKey[ServerPool]()


def uses_pool(item: pytest.Item | None) -> bool:
    """Whether ``item`` takes servers from the pool (itself or through a fixture)."""
    return item is not None and "server_pool" in item.fixturenames


@pytest.fixture(scope="session")
def server_pool(request: pytest.FixtureRequest, tiny_model: Path, vllm_log_dir: Path) -> Iterator[ServerPool]:
    """The session's shared vLLM servers of the tiny model (see ``ServerPool``)."""
    pool = request.config.stash[POOL_KEY] = ServerPool(tiny_model, vllm_log_dir)
    yield pool
    pool.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """After the last test of a row of tests using the pool (its fixtures torn down: the servers given back),
    the pool's servers are stopped."""
    try:
        return (yield)
    finally:
        pool = item.config.stash.get(POOL_KEY, None)
        if pool is not None and uses_pool(item) and not uses_pool(nextitem):
            pool.close()


@pytest.fixture
def pooled_servers(server_pool: ServerPool) -> Iterator:
    """``take(count) -> [VllmServer]`` from the session's pool, given back when the test ends."""
    taken: list[VllmServer] = []

    def take(count: int) -> list[VllmServer]:
        servers = server_pool.take(count)
        taken.extend(servers)
        return servers

    yield take
    server_pool.give_back(taken)


