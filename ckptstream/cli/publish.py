"""``ckptstream publish``: a Hugging Face model directory or a Megatron torch_dist checkpoint as a new version."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Iterator

from ..errors import EXIT_OK
from .options import UsageError, add_command, add_url, positive_int, storage_options, version_number
from .output import human, print_json, progress, version_summary

# The dtypes `--dtype` offers (torch attribute names); the default follows config.json.
PUBLISH_DTYPES = ("bfloat16", "float16", "float32")


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "publish", run_publish, "publish a Hugging Face model directory or a Megatron checkpoint "
                                                 "as a new version", """
        ckptstream publish /mnt/nfs/run1 --from-hf ./checkpoint-100 --step 100
        ckptstream publish s3://bucket/run1 --from-hf ./ckpt --version 7 --keyframe
        ckptstream publish /mnt/nfs/run1 --from-megatron ./megatron_save --hf-config ./Qwen3-8B
        ckptstream publish /mnt/nfs/run1 --from-megatron ./save/iter_0000200 --hf-config ./Qwen3-8B --dtype bfloat16
        """)
    add_url(p)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--from-hf", metavar="DIR", help="model directory with *.safetensors")
    source.add_argument("--from-megatron", metavar="CKPT_DIR",
                        help="Megatron torch_dist checkpoint: the save directory (its newest iteration, from "
                             "latest_checkpointed_iteration.txt) or one iter_XXXXXXX/ directory; needs --hf-config")
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

    if args.from_megatron:
        if not args.hf_config:
            raise UsageError("--from-megatron needs --hf-config DIR (config.json and tokenizer of the architecture)")
        assets, source, total, step = _megatron_source(args)
    else:
        from ..hf import iter_hf_weights

        if args.hf_config or args.dtype:
            raise UsageError("--hf-config and --dtype apply to --from-megatron only")
        assets, source, step = args.from_hf, iter_hf_weights(args.from_hf), args.step
        total = sum(path.stat().st_size for path in Path(args.from_hf).glob("*.safetensors"))
    with Publisher(args.url, storage_options=storage_options(args), assets=assets,
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
