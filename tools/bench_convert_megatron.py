#!/usr/bin/env python3
"""Benchmark: publishing a Megatron torch_dist checkpoint (``ckptstream publish --from-megatron``) against
publishing the same weights from a Hugging Face directory (``--from-hf``), in one run.

Saves a bf16 megatron-core GPTModel of about ``--size`` bytes (random weights, one rank) with
``dist_checkpointing.save``, materializes the same weights as a Hugging Face directory, then publishes
each ``--repeats`` times as a keyframe into fresh streams (page cache warm for both) and prints the
medians and their ratio; checks that both give the same tensors.

    python tools/bench_convert_megatron.py --size 1GB --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckptstream import Stream  # noqa: E402
from ckptstream.cli import main as cli  # noqa: E402
from ckptstream.cli.options import parse_bytes  # noqa: E402
from ckptstream.testing.models import TinyModelSpec, tiny_config  # noqa: E402
from ckptstream.vllm_loader.serve import free_port  # noqa: E402


def save_checkpoint(hf_dir: Path, save_dir: Path, size: int) -> None:
    """A torch_dist checkpoint of a random bf16 model (one rank), as megatron's training loop lays it out."""
    from megatron.core import dist_checkpointing

    from ckptstream.testing.megatron import build_gpt_model, cpu_support, initialize_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    initialize_parallel()
    spec = TinyModelSpec.for_size(size, vocab_size=8192)
    hf_dir.mkdir(parents=True)
    (hf_dir / "config.json").write_text(json.dumps(tiny_config(spec)))
    model = build_gpt_model(hf_dir, params_dtype=torch.bfloat16)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02)
    iteration_dir = save_dir / "iter_0000001"
    iteration_dir.mkdir(parents=True)
    with cpu_support():
        dist_checkpointing.save(model.sharded_state_dict(), str(iteration_dir))
    (save_dir / "latest_checkpointed_iteration.txt").write_text("1")


def timed_publish(root: Path, name: str, args: list[str]) -> float:
    stream = root / name
    shutil.rmtree(stream, ignore_errors=True)
    started = time.perf_counter()
    assert cli(["publish", str(stream), *args, "--cache-dir", ""]) == 0
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=parse_bytes, default=parse_bytes("1GB"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", help="scratch directory (default: a temp dir)")
    args = parser.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="ckptstream-convert-"))
    shutil.rmtree(root, ignore_errors=True)
    save_checkpoint(root / "hf", root / "megatron", args.size)
    megatron_args = ["--from-megatron", str(root / "megatron"), "--hf-config", str(root / "hf")]
    timed_publish(root, "reference", megatron_args)
    Stream(str(root / "reference")).materialize(0, root / "hf-weights")
    rows = []
    for _ in range(args.repeats):
        rows.append((timed_publish(root, "from-megatron", megatron_args),
                     timed_publish(root, "from-hf", ["--from-hf", str(root / "hf-weights")])))
    same = ({t.name: t.hash for t in Stream(str(root / "from-megatron")).manifest(0).tensors}
            == {t.name: t.hash for t in Stream(str(root / "from-hf")).manifest(0).tensors})
    megatron_s, hf_s = statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)
    size = Stream(str(root / "from-hf")).manifest(0).full_bytes
    print(f"{size / 1e9:.2f} GB bf16, keyframe, medians of {args.repeats}: --from-megatron {megatron_s:.2f} s, "
          f"--from-hf {hf_s:.2f} s -> ratio {megatron_s / hf_s:.2f}; same tensors: {same}")


if __name__ == "__main__":
    main()
