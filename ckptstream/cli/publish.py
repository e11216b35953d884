"""``ckptstream publish``: a Hugging Face model directory, a Megatron torch_dist checkpoint or a PEFT LoRA adapter
directory as a new version."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Iterator

from ..errors import EXIT_OK
from ..format import ADAPTER_WEIGHTS_FILE, HASH_PREFIX, is_hash
from .options import UsageError, add_command, add_url, positive_int, storage_options, version_number
from .output import human, print_json, progress, version_summary

# The dtypes `--dtype` offers (torch attribute names); the default follows config.json.
PUBLISH_DTYPES = ("bfloat16", "float16", "float32")


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "publish", run_publish, "publish a Hugging Face model directory, a Megatron checkpoint "
                                                 "or a PEFT LoRA adapter as a new version", """
        ckptstream publish /mnt/nfs/run1 --from-hf ./checkpoint-100 --step 100
        ckptstream publish s3://bucket/run1 --from-hf ./ckpt --version 7 --keyframe
        ckptstream publish /mnt/nfs/run1 --from-megatron ./megatron_save --hf-config ./Qwen3-8B
        ckptstream publish /mnt/nfs/run1 --from-megatron ./save/iter_0000200 --hf-config ./Qwen3-8B --dtype bfloat16
        ckptstream publish /mnt/nfs/lora1 --from-peft ./checkpoint-100 --step 100   # an adapter stream
        ckptstream publish s3://bucket/lora1 --from-peft ./adapter --base-dir ./Qwen3-8B  # base identity from its dir
        """)
    add_url(p)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--from-hf", metavar="DIR", help="model directory with *.safetensors")
    source.add_argument("--from-megatron", metavar="CKPT_DIR",
                        help="Megatron torch_dist checkpoint: the save directory (its newest iteration, from "
                             "latest_checkpointed_iteration.txt) or one iter_XXXXXXX/ directory; needs --hf-config")
    source.add_argument("--from-peft", metavar="DIR",
                        help="a LoRA adapter saved by PeftModel.save_pretrained (adapter_config.json, "
                             "adapter_model.safetensors): the stream is an adapter stream of its base model")
    p.add_argument("--base-dir", metavar="DIR",
                   help="with --from-peft: the base model's directory, to record its identity (its hash) in a new "
                        "stream (default: adapter_config.json's base_model_name_or_path, where that is a local "
                        "directory)")
    p.add_argument("--base-hash", metavar="HASH", type=base_hash,
                   help="with --from-peft: the base model's hash (`ckptstream base-hash DIR` of the directory "
                        "servers load), instead of --base-dir")
    p.add_argument("--hf-config", metavar="DIR", help="with --from-megatron: a Hugging Face directory of the "
                                                      "architecture (config.json, tokenizer files)")
    p.add_argument("--dtype", choices=PUBLISH_DTYPES,
                   help="with --from-megatron: dtype to publish (default: config.json's torch_dtype, else the "
                        "checkpoint's)")
    p.add_argument("--version", type=version_number, dest="number", help="version number (default: latest + 1)")
    p.add_argument("--step", type=int, help="training step to record")
    p.add_argument("--keyframe", action="store_true", help="write a keyframe, not a delta")
    p.add_argument("--keyframe-every", type=positive_int, default=10, metavar="K",
                   help="versions per chain (default 10)")
    p.add_argument("--cache-dir", default=os.environ.get("CKPTSTREAM_CACHE", "~/.cache/ckptstream/publish"),
                   help="local copy of the last version published, so the next delta need not decode the "
                        "stream (default ~/.cache/ckptstream/publish or $CKPTSTREAM_CACHE; '' disables)")


def run_publish(args: argparse.Namespace) -> int:
    from ..writer import Publisher

    adapter = None
    if (args.base_dir or args.base_hash) and not args.from_peft:
        raise UsageError("--base-dir and --base-hash apply to --from-peft only")
    if args.from_megatron:
        if not args.hf_config:
            raise UsageError("--from-megatron needs --hf-config DIR (config.json and tokenizer of the architecture)")
        assets, source, total, step = _megatron_source(args)
    elif args.from_peft:
        from ..writer.adapter import peft_dir_source

        if args.hf_config or args.dtype:
            raise UsageError("--hf-config and --dtype apply to --from-megatron only")
        if args.base_dir and args.base_hash:
            raise UsageError("give the base model's identity once: --base-dir or --base-hash")
        adapter = peft_dir_source(args.from_peft, base_dir=args.base_dir, base_hash=args.base_hash)
        assets, source, step = None, adapter.read(), args.step
        total = (Path(args.from_peft) / ADAPTER_WEIGHTS_FILE).stat().st_size
    else:
        from ..hf import iter_hf_weights

        if args.hf_config or args.dtype:
            raise UsageError("--hf-config and --dtype apply to --from-megatron only")
        assets, source, step = args.from_hf, iter_hf_weights(args.from_hf), args.step
        total = sum(path.stat().st_size for path in Path(args.from_hf).glob("*.safetensors"))
    with Publisher(args.url, storage_options=storage_options(args), assets=assets, adapter_of=adapter,
                   keyframe_every=args.keyframe_every, base_cache_dir=args.cache_dir or None) as publisher:
        with progress(total, "read") as advance:
            def tensors() -> Iterator[tuple[str, Any]]:
                for name, tensor in source:
                    if advance:
                        advance(tensor.numel() * tensor.element_size())
                    yield name, tensor

            future = publisher.publish(tensors(), args.number, step=step, keyframe=args.keyframe)
        if sys.stderr.isatty():
            print("encoding, writing and committing ...", file=sys.stderr, flush=True)
        manifest = future.result()
    summary = version_summary(manifest)
    if args.json:
        print_json(summary)
    else:
        print(f"published version {manifest.version} ({manifest.kind}"
              + (f" on {manifest.base_version}" if manifest.base_version is not None else "")
              + f"): {human(manifest.stored_bytes)} stored for {human(manifest.full_bytes)} of weights "
              f"({100 * summary['stored_fraction']:.2f}%)")
    return EXIT_OK


def base_hash(text: str) -> str:
    """A base model hash given on the command line (``xxh3-128:`` and 32 lowercase hex digits)."""
    if not is_hash(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a base model hash ({HASH_PREFIX} and 32 lowercase hex "
                                         "digits, as `ckptstream base-hash DIR` prints)")
    return text


def _megatron_source(args: argparse.Namespace) -> tuple[str, Iterator[tuple[str, Any]], int, int | None]:
    """Assets, HF tensors, byte count and step of ``--from-megatron`` (step: --step, else the iteration)."""
    import torch

    from ..writer.megatron_hf import HFArchitecture
    from ..writer.torch_dist import TorchDistCheckpoint

    arch = HFArchitecture.from_dir(args.hf_config)
    checkpoint = TorchDistCheckpoint(args.from_megatron)
    dtype = getattr(torch, args.dtype) if args.dtype else arch.dtype
    step = args.step if args.step is not None else checkpoint.iteration
    return args.hf_config, checkpoint.iter_hf(arch, dtype), checkpoint.nbytes, step
