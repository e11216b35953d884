#!/usr/bin/env python3
"""Check on a GPU machine: the device encoder on CUDA tensors against the host encoder.

A bf16 model of ``--size`` bytes (plus an int32, a float32 and a bool tensor) lives on the device; each
version changes 1 % of its elements (``rl_like_step``), one version changes every element of one tensor
and adds a tensor. Checks, printing one line each:
  1. the device encoder (``device_delta`` default for CUDA tensors) and the host encoder
     (``device_delta=False``) store the same tensor entries and the same chunks for every version;
  2. every version of both streams decodes bit-exactly to the device tensors (compared on the device);
  3. the mix: one stream written in turn by host and device publishers (a device-encoded delta on a
     host-encoded keyframe, host deltas on device-encoded versions, a device keyframe) decodes bit-exactly;
  4. device memory before, while publishing (peak) and after the publishers are closed.

    python tools/check_device_encode.py --size 512MB
    python tools/check_device_encode.py --device cpu --size 16MB     # the CPU reference
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckptstream import Publisher, Stream  # noqa: E402
from ckptstream.cli.options import parse_bytes  # noqa: E402
from ckptstream.testing.models import rl_like_step  # noqa: E402
from ckptstream.testing.storage import stored_entries  # noqa: E402
from tools.bench_gpu_snapshot import model_on, same_bits  # noqa: E402


def versions(device: torch.device, size: int, count: int) -> list[dict[str, torch.Tensor]]:
    """``count`` states, cloned on the device (the later ones differ as the docstring says)."""
    state = model_on(device, size, seed=2)
    generator = torch.Generator(device=device).manual_seed(3)
    state["step.ints"] = torch.arange(1001, dtype=torch.int32, device=device)
    state["mask"] = torch.rand(333, device=device, generator=generator) > 0.5
    state["scale"] = torch.ones(77, dtype=torch.float32, device=device)
    out = [{k: v.clone() for k, v in state.items()}]
    for number in range(1, count):
        rl_like_step(state, fraction=0.01, generator=generator)
        state["step.ints"][number::100] += number
        if number == 2:
            state["scale"] *= 3.0  # every element: dense chunks
            state["added"] = torch.arange(10, dtype=torch.float32, device=device)
        out.append({k: v.clone() for k, v in state.items()})
    return out


def publish(url: str, states: list[dict[str, torch.Tensor]], *, device_delta: bool | None, start: int = 0,
            keyframes: tuple[int, ...] = ()) -> None:
    with Publisher(url, keyframe_every=100, device_delta=device_delta, workers=8) as publisher:
        for number, state in enumerate(states, start):
            publisher.publish(state, number, keyframe=number in keyframes).result()


def decodes(stream: Stream, version: int, want: dict[str, torch.Tensor]) -> bool:
    got = dict(stream.iter_tensors(version))
    return set(got) == set(want) and all(same_bits(want[n], t.to(want[n].device)) for n, t in got.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=parse_bytes, default=parse_bytes("512MB"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    print(f"device: {torch.cuda.get_device_name(device) if cuda else 'CPU'}", flush=True)
    states = versions(device, args.size, 9)
    model_bytes = sum(t.numel() * t.element_size() for t in states[0].values())
    root = Path(tempfile.mkdtemp(prefix="ckptstream-check-"))
    on_device = None if cuda else True
    results: dict[str, object] = {"model_bytes": model_bytes}
    try:
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        publish(str(root / "device"), states[:5], device_delta=on_device)
        if cuda:
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device) - before
            results["device_memory"] = {"before": before, "peak_extra": peak,
                                        "after_close": torch.cuda.memory_allocated(device)}
        publish(str(root / "host"), states[:5], device_delta=False)
        host, dev = Stream(str(root / "host")), Stream(str(root / "device"))
        same = [stored_entries(dev, v) == stored_entries(host, v) for v in range(5)]
        kinds = [dev.manifest(v).kind for v in range(5)]
        results["same_entries_and_chunks"] = all(same)
        print(f"1. device and host encoders store the same entries and chunks, versions 0-4 ({kinds}): "
              f"{'ok' if all(same) else 'NO ' + str(same)}", flush=True)
        exact = [decodes(s, v, states[v]) for s in (dev, host) for v in range(5)]
        results["both_decode_bit_exactly"] = all(exact)
        print(f"2. both streams decode bit-exactly to the device tensors: {'ok' if all(exact) else 'NO'}", flush=True)

        url = str(root / "mixed")
        publish(url, states[:2], device_delta=False)  # host keyframe 0, host delta 1
        publish(url, states[2:4], device_delta=on_device, start=2)  # 2 host-encoded (fresh), 3 device delta
        publish(url, states[4:6], device_delta=False, start=4)  # host deltas on the device-encoded chain
        publish(url, states[6:9], device_delta=on_device, start=6, keyframes=(7,))  # device keyframe 7, delta 8
        mixed = Stream(url)
        kinds = [mixed.manifest(v).kind for v in range(9)]
        exact = [decodes(mixed, v, states[v]) for v in range(9)]
        expected = ["keyframe"] + ["delta"] * 6 + ["keyframe", "delta"]
        results["mix_decodes_bit_exactly"] = all(exact) and kinds == expected
        print(f"3. mix (host 0-1, device 2-3, host 4-5, device keyframe 7 + delta 8) decodes bit-exactly: "
              f"{'ok' if results['mix_decodes_bit_exactly'] else 'NO ' + str((kinds, exact))}", flush=True)
        if cuda:
            memory = results["device_memory"]
            assert isinstance(memory, dict)
            print(f"4. device memory: before {memory['before'] / 1e9:.3f} GB, peak extra while publishing "
                  f"{memory['peak_extra'] / 1e9:.3f} GB ({memory['peak_extra'] / model_bytes:.2f}x the model's "
                  f"{model_bytes / 1e9:.3f} GB), after close {memory['after_close'] / 1e9:.3f} GB", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    ok = all(results[k] for k in ("same_entries_and_chunks", "both_decode_bit_exactly", "mix_decodes_bit_exactly"))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
