#!/usr/bin/env python3
"""Check, at one parallel layout, that MegatronPublisher publishes exactly the weights a Megatron model
holds and that vLLM-style consumers compute the same function: run under torchrun, on GPUs (NCCL, one per
rank, bf16) or CPU (gloo).

For each architecture a random Hugging Face model is loaded into a bf16 megatron-core GPTModel at the
layout, published (a keyframe, then a delta after an RL-like change), and its logits computed by
Megatron's own forward pass. Rank 0 then checks that the published tensors equal the Hugging Face tensors
bit for bit and compares logits: Megatron bf16 and Hugging Face transformers bf16 on the published
weights, each against transformers fp32 on the same weights. The two bf16 errors should be of the same
size (bf16 rounding); a wrong mapping gives errors orders of magnitude larger.

    torchrun --standalone --nproc-per-node 2 tools/check_megatron_logits.py --tp 2
    torchrun --standalone --nproc-per-node 4 tools/check_megatron_logits.py --tp 2 --pp 2
    torchrun --standalone --nproc-per-node 2 tools/check_megatron_logits.py --ep 2 --arch qwen3_moe
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckptstream.testing.models import TinyModelSpec, rl_like_step, tiny_state_dict, write_tiny_model  # noqa: E402

VOCAB = 1000  # not a multiple of Megatron's padding


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--arch", action="append", help="architectures (default: all that fit the layout)")
    parser.add_argument("--dir", help="scratch directory (default: a temp dir)")
    args = parser.parse_args()

    from megatron.core import parallel_state as mpu

    from ckptstream import Stream
    from ckptstream.testing.megatron import build_gpt_model, initialize_parallel, pipeline_logits
    from ckptstream.writer.megatron import MegatronPublisher, load_hf_weights

    device = initialize_parallel(tp=args.tp, pp=args.pp, ep=args.ep)
    cuda = device.type == "cuda"
    rank = dist.get_rank()
    archs = args.arch or (["qwen3_moe"] if args.ep > 1 else ["qwen2", "llama", "qwen3", "qwen3_moe"])
    root = Path(args.dir or tempfile.gettempdir()) / "ckptstream-check-megatron"
    tokens = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(0))
    results = []
    for arch in archs:
        spec = TinyModelSpec(arch=arch, hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=4,
                             intermediate_size=1536, vocab_size=VOCAB, tie_embeddings=arch == "llama",
                             num_experts=8, moe_intermediate_size=256)
        work = root / arch
        v0 = tiny_state_dict(spec)
        v1 = {name: tensor.clone() for name, tensor in v0.items()}
        rl_like_step(v1, generator=torch.Generator().manual_seed(1))
        if rank == 0:
            shutil.rmtree(work, ignore_errors=True)
            write_tiny_model(work / "hf", spec, state=v0)
        dist.barrier()
        model = build_gpt_model(work / "hf", params_dtype=torch.bfloat16).to(device)
        load_hf_weights(model, v0, work / "hf")
        with MegatronPublisher(str(work / "stream"), model, work / "hf") as publisher:
            publisher.publish(0)
            load_hf_weights(model, v1, work / "hf")
            publisher.publish(1).result()
        logits = pipeline_logits(model, tokens.to(device))
        if logits is not None and mpu.get_tensor_model_parallel_rank() == 0 and mpu.get_data_parallel_rank() == 0:
            torch.save(logits[..., :VOCAB].float().cpu(), work / "megatron_logits.pt")
        del model
        dist.barrier()
        if rank == 0:
            results.append(_compare(arch, Stream(str(work / "stream")), v1, work, tokens, device))
            print(json.dumps(results[-1]), flush=True)
        dist.barrier()
    layout = f"TP={args.tp} PP={args.pp} EP={args.ep}"
    if rank == 0:
        bad = [r["arch"] for r in results
               if not r["bit_exact"] or r["megatron_vs_fp32"] > 4 * r["hf_bf16_vs_fp32"] + 1e-2]
        print(f"{layout} on {torch.cuda.get_device_name() if cuda else 'CPU'}: "
              + ("all match" if not bad else f"MISMATCH in {', '.join(bad)}"), flush=True)
    dist.destroy_process_group()


def _compare(arch: str, stream, v1: dict, work: Path, tokens: torch.Tensor, device: torch.device) -> dict:
    from transformers import AutoModelForCausalLM

    published = dict(stream.iter_tensors(1))
    bit_exact = set(published) == set(v1) and all(torch.equal(published[n].view(torch.int16), v1[n].view(torch.int16))
                                                   for n in v1)
    stream.materialize(1, work / "materialized")
    logits = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = AutoModelForCausalLM.from_pretrained(str(work / "materialized"), dtype=dtype).to(device)
        with torch.no_grad():
            logits[dtype] = model(tokens.to(device)).logits.float().cpu()
        del model
    megatron = torch.load(work / "megatron_logits.pt")
    reference = logits[torch.float32]
    return {"arch": arch, "bit_exact": bit_exact, "delta_kind": stream.manifest(1).kind,
            "megatron_vs_fp32": float((megatron - reference).abs().max()),
            "hf_bf16_vs_fp32": float((logits[torch.bfloat16] - reference).abs().max()),
            "logit_scale": float(reference.abs().max())}


if __name__ == "__main__":
    main()
