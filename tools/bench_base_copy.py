#!/usr/bin/env python3
"""What reading an FP8 unit back from the base version's copy costs (``inplace.base_copy.BaseCopy.values``): the
staging quantizes a unit whose scale may move again whole from it. A fused Linear's unit of two bf16 checkpoint
tensors (``--rows`` × ``--cols`` each, copied in order one after the other, as a gate and up projection are), read
whole; with ``--baseline`` (a copy of an older ``base_copy.py``, e.g. ``git show b67ff0e^:ckptstream/vllm_loader/
inplace/base_copy.py > /tmp/base_copy_old.py``) timed beside it, the two in turn, medians of ``--repeat``.

    python tools/bench_base_copy.py --baseline /tmp/base_copy_old.py   # the 15 GB dense shape's gate and up
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckptstream.vllm_loader.inplace import base_copy  # noqa: E402
from ckptstream.vllm_loader.inplace.trace import Target, TensorPlan  # noqa: E402
from ckptstream.vllm_loader.inplace.upload import Uploads  # noqa: E402
from baseline_module import load_baseline  # noqa: E402  (tools/, beside this script)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=12288)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--baseline", help="path of an older base_copy.py to time beside the current one")
    args = parser.parse_args()
    modules = {"current": base_copy}
    if args.baseline:
        modules["baseline"] = load_baseline(args.baseline, "ckptstream.vllm_loader.inplace._baseline_base_copy")
    rows, cols, cpu = args.rows, args.cols, torch.device("cpu")
    elements = rows * cols
    plans = {"gate": TensorPlan([Target("w", (rows, cols), 0, (cols, 1), 0, (cols, 1))]),
             "up": TensorPlan([Target("w", (rows, cols), 0, (cols, 1), elements, (cols, 1))])}
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "model.safetensors"
        tensors = {name: torch.randn(rows, cols).to(torch.bfloat16) for name in plans}
        save_file(tensors, str(path))
        expected = torch.cat([tensors["gate"].reshape(-1), tensors["up"].reshape(-1)])
        seconds: dict[str, list[float]] = {label: [] for label in modules}
        for _ in range(args.repeat):
            for label, module in modules.items():
                # (a baseline from before ``upload.Uploads`` takes the device)
                to_device = Uploads(cpu) if module is base_copy else cpu
                copy = module.BaseCopy({name: path for name in plans}, plans, to_device)
                try:
                    started = time.perf_counter()
                    (values,) = copy.values("w", [(0, 2 * elements)])
                    seconds[label].append(time.perf_counter() - started)
                finally:
                    copy.close()
                assert torch.equal(values, expected), label
    print(f"a unit of 2 × {rows} × {cols} bf16 elements read back whole, medians of {args.repeat}: "
          + ", ".join(f"{label} {statistics.median(s):.3f} s" for label, s in seconds.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
