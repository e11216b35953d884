"""A small megatron-core training loop that publishes every optimizer step to a ckptstream stream.

Run it with torchrun; every rank publishes (``MegatronPublisher``), rank 0 commits each version:

    torchrun --standalone --nproc-per-node 2 launch/megatron_train.py \\
        --stream /tmp/run/stream --hf-model /tmp/run/hf --tp 2 --steps 20

The model is initialized from the Hugging Face directory ``--hf-model`` (generated with
``ckptstream make-tiny-model`` if it does not exist), trained in fp32 on a fixed batch (the loss falls),
and published as bf16 under Hugging Face names, ready for ``ckptstream serve``. On a machine without GPUs
it runs on CPU over gloo; with GPUs, over NCCL, one GPU per rank. Rank 0 prints one line per step with
the loss and how long ``publish`` blocked training.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stream", required=True, help="stream URL to publish to")
    parser.add_argument("--hf-model", required=True, help="Hugging Face directory (generated if missing)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (the world size must be a multiple)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--keyframe-every", type=int, default=10)
    parser.add_argument("--min-step-seconds", type=float, default=0.0,
                        help="make each step last at least this long (a tiny model trains faster than a real one)")
    args = parser.parse_args()

    from ckptstream import Stream
    from ckptstream.hf import iter_hf_weights
    from ckptstream.testing.megatron import build_gpt_model, cpu_support, initialize_parallel
    from ckptstream.testing.models import TinyModelSpec, write_tiny_model
    from ckptstream.writer.megatron import MegatronPublisher, load_hf_weights

    device = initialize_parallel(tp=args.tp)
    rank = dist.get_rank()
    hf_dir = Path(args.hf_model)
    if rank == 0 and not (hf_dir / "config.json").exists():
        write_tiny_model(hf_dir, TinyModelSpec())
    dist.barrier()

    model = build_gpt_model(hf_dir)
    load_hf_weights(model, dict(iter_hf_weights(hf_dir)), hf_dir)
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    vocab = json.loads((hf_dir / "config.json").read_text())["vocab_size"]
    batch = torch.randint(0, vocab, (4, 65), generator=torch.Generator().manual_seed(0)).to(device)
    tokens, labels = batch[:, :-1], batch[:, 1:]
    positions = torch.arange(tokens.shape[1], device=device).expand_as(tokens)
    causal = torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool, device=device).triu(1)[None, None]

    publisher = MegatronPublisher(args.stream, model, hf_dir, dtype=torch.bfloat16, keyframe_every=args.keyframe_every)
    # Version numbers go on after what the stream already holds (a re-run, a restarted job); the ranks
    # agree on the first one, so a writer elsewhere cannot split them.
    newest = Stream(args.stream).latest()
    latest = torch.tensor([-1 if newest is None else newest])
    dist.all_reduce(latest, op=dist.ReduceOp.MAX)
    first = int(latest) + 1
    publisher.publish(first, step=0)
    for step in range(1, args.steps + 1):
        step_started = time.perf_counter()
        with cpu_support():
            loss = model(tokens, positions, attention_mask=causal, labels=labels).mean()
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        started = time.perf_counter()
        loss_value = loss.detach().item()
        publisher.publish(first + step, step=step, metadata={"loss": loss_value})
        blocked = time.perf_counter() - started
        if rank == 0:
            print(f"step {step:4d}  loss {loss_value:.4f}  publish blocked {1000 * blocked:.1f} ms", flush=True)
        time.sleep(max(0.0, args.min_step_seconds - (time.perf_counter() - step_started)))
    publisher.close()
    if rank == 0:
        print(f"published versions {first}..{first + args.steps} to {args.stream}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
