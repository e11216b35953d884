"""The device encoder's Triton kernels, run on CPU tensors in Triton's interpreter, against the torch
reference (``TorchKernels``) bit for bit, and the whole device-encoder test module run again with them.

Triton lives in ``build/triton`` (``make install-dev``), apart from the environment vLLM's CPU build imports;
the interpreted runs are subprocesses with it on their path and ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRITON_DIR = ROOT / "build" / "triton"


def _interpreted_pytest(*args: str) -> subprocess.CompletedProcess[str]:
    if not (TRITON_DIR / "triton").is_dir():
        message = f"Triton is not installed in {TRITON_DIR}: run `make install-dev`"
        if os.environ.get("CI"):
            pytest.fail(message)  # in CI a missing install is a failure, not a skip
        pytest.skip(message)
    env = dict(os.environ, TRITON_INTERPRET="1", CKPTSTREAM_TEST_TRITON_KERNELS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(TRITON_DIR), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)


def test_triton_kernels_match_the_torch_reference_in_the_interpreter():
    result = _interpreted_pytest(str(ROOT / "tests" / "writer" / "triton_interpreted.py"))
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]


def test_device_encoder_with_the_triton_kernels_stores_what_the_host_encoder_stores():
    """tests/writer/test_device_encode.py again, its snapshots on the Triton kernels (its autouse fixture
    switches them when ``CKPTSTREAM_TEST_TRITON_KERNELS`` is set) with spans of 50 elements: the byte-for-byte
    comparison with the host encoder, the two taking over from each other, a failed capture, the capture
    itself (not the variants where every tensor, or the host-compared ones, are staged whole: their
    staging runs no kernel)."""
    result = _interpreted_pytest(str(ROOT / "tests" / "writer" / "test_device_encode.py"), "-k",
                                 "not whole and not host_compared"
                                 " and (stores_what or take_over or failed_capture or changes_and_memory)")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]
