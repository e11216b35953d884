"""Helpers shared by tests (importable, unlike conftest.py)."""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.context
import multiprocessing.process
import os
import uuid
from pathlib import Path
from typing import IO, Callable, Sequence

import torch

from ckptstream.codec import tensor_hash
from ckptstream.storage import Entry, Storage
from ckptstream.storage.wrapper import WrapperStorage


def new_bucket(endpoint: str) -> str:
    """Create an empty bucket with a fresh name on the S3 server at ``endpoint``; returns its name."""
    import boto3

    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=name)
    return name


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Bit-exact equality of two tensor sets (names, dtypes, shapes and bytes)."""
    assert list(got) == list(want) or set(got) == set(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert got[name].shape == tensor.shape, name
        assert tensor_hash(got[name]) == tensor_hash(tensor), name


def random_state(seed: int = 0, scale: int = 1) -> dict[str, torch.Tensor]:
    """A small mixed-dtype state dict."""
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": (torch.randn(64 * scale, 48, generator=g) * 0.02).bfloat16(),
        "layer.0.w": (torch.randn(48, 96 * scale, generator=g)).half(),
        "layer.0.b": torch.randn(96 * scale, generator=g),
        "layer.0.norm": torch.ones(48, dtype=torch.bfloat16),
        "steps": torch.arange(7, dtype=torch.int64),
    }


VLLM_CPU_ARGS = ["--skip-tokenizer-init", "--enforce-eager", "--dtype", "bfloat16", "--gpu-memory-utilization", "0.3",
                 "--max-model-len", "512", "--max-num-seqs", "16"]


PROMPTS = [[1, 2, 3, 4], [7, 8, 9], [100, 200, 300, 400, 5], [42] * 10]


RANK_PRELOAD = ["torch", "torch.distributed", "safetensors.torch", "s3fs", "ckptstream.writer", "ckptstream.cli",
                "megatron.core", "megatron.core.models.gpt", "ckptstream.testing.megatron",
                "ckptstream.writer.megatron", "tests.helpers"]
"""Modules the ranks' fork server imports once (those not installed are skipped): each spawned rank would
import them again, seconds of CPU per rank (megatron-core most)."""


def run_ranks(target, world_size: int, *args: object, timeout: float = 300) -> list[int | None]:
    """Run ``target(rank, world_size, port, *args)`` in ``world_size`` new processes (a real
    torch.distributed job on loopback); return their exit codes (None: still running at the timeout,
    then killed). The processes fork from a fork server that has imported ``RANK_PRELOAD`` and nothing
    else (no threads, no process group), and run with this process's environment as it is now."""
    import time

    from ckptstream.vllm_loader.serve import free_port

    port = free_port()
    processes = [preloaded_process(target, rank, world_size, port, *args) for rank in range(world_size)]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout
    codes: list[int | None] = []
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        codes.append(process.exitcode)
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()
    return codes


def preloaded_context() -> multiprocessing.context.BaseContext:
    """The multiprocessing context whose processes fork from a fork server that has imported
    ``RANK_PRELOAD`` (and started no thread): a new process in a fraction of a spawned one's time."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(RANK_PRELOAD)
    return context


def preloaded_process(target, *args: object) -> multiprocessing.process.BaseProcess:
    """A new (not started) process of ``preloaded_context`` running ``target(*args)`` with this process's
    environment as it is now."""
    return preloaded_context().Process(target=_in_environment, args=(dict(os.environ), target, *args))


def _in_environment(environment: dict[str, str], target, *args: object) -> None:
    """A process's body: the fork server's environment is the one of its start, not the caller's now."""
    os.environ.clear()
    os.environ.update(environment)
    target(*args)


class HookedStorage(WrapperStorage):
    """A storage that passes everything through to ``inner`` but first calls ``hook(operation, path)`` for
    each read, write ("put"), list and delete: a test interleaves another process's step at an exact point of the code
    under test (a real interleaving of real operations), or injects a fault that cannot be caused for real
    here (a permission error, when tests run as root)."""

    def __init__(self, inner: Storage, hook: Callable[[str, str], None]):
        super().__init__(inner)
        self.hook = hook

    def read(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        self.hook("read", path)
        return self.inner.read(path, start, end)

    def read_into(self, path: str, offset: int, buffer: memoryview) -> None:
        self.hook("read", path)
        self.inner.read_into(path, offset, buffer)

    def read_ranges(self, path: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        self.hook("read", path)
        return self.inner.read_ranges(path, ranges)

    def read_ranges_into(self, path: str, targets: Sequence[tuple[int, memoryview]]) -> None:
        self.hook("read", path)
        self.inner.read_ranges_into(path, targets)

    def open_read(self, path: str) -> IO[bytes]:
        self.hook("read", path)
        return self.inner.open_read(path)

    def open_write(self, path: str) -> contextlib.AbstractContextManager[IO[bytes]]:
        self.hook("put", path)
        return self.inner.open_write(path)

    def put_if_absent(self, path: str, data: bytes) -> None:
        self.hook("put", path)
        self.inner.put_if_absent(path, data)

    def put(self, path: str, data: bytes) -> None:
        self.hook("put", path)
        self.inner.put(path, data)

    def list(self, path: str) -> list[Entry]:
        self.hook("list", path)
        return self.inner.list(path)

    def delete(self, path: str) -> None:
        self.hook("delete", path)
        self.inner.delete(path)

    def delete_tree(self, path: str) -> None:
        self.hook("delete", path)
        self.inner.delete_tree(path)


def command_lines_under(pid: int) -> list[bytes]:
    """The command lines (``/proc/PID/cmdline``, what every user of the host reads) of the processes under
    ``pid`` now."""
    parents: dict[int, int] = {}
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            ppid = next(line for line in status.read_text().splitlines() if line.startswith("PPid:"))
        except (OSError, StopIteration):  # gone meanwhile
            continue
        parents[int(status.parent.name)] = int(ppid.split()[1])
    found, frontier = [], {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier}
        found += frontier
    lines = []
    for child in found:
        try:
            lines.append(Path(f"/proc/{child}/cmdline").read_bytes())
        except OSError:
            pass
    return lines
