"""``ckptstream replay``: load versions one after another into running servers and evaluate each."""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ..errors import CkptStreamError
from ..reader import Stream
from .client import VllmError
from .follower import Follower


@dataclass(frozen=True)
class ReplayResult:
    """One version of a replay: how loading it went and what the command returned."""

    version: int
    load_s: float
    exit_code: int | None  # None: the version could not be loaded, the command did not run
    run_s: float
    error: str | None = None


def select_versions(stream: Stream, spec: str) -> list[int]:
    """The committed versions selected by ``A:B[:STEP]`` (inclusive; ``latest`` allowed; STEP counts
    version numbers from A) or by a single version."""
    parts = spec.split(":")
    if not 1 <= len(parts) <= 3 or not all(parts[:2]):
        raise ValueError(f"--versions wants A:B[:STEP], got {spec!r}")
    first = stream.resolve(parts[0])
    last = stream.resolve(parts[1]) if len(parts) > 1 else first
    step = int(parts[2]) if len(parts) == 3 and parts[2] else 1
    if step < 1:
        raise ValueError("STEP must be at least 1")
    chosen = [v for v in stream.versions() if first <= v <= last and (v - first) % step == 0]
    if not chosen:
        raise ValueError(f"no committed version in {spec}")
    return chosen


def replay(url: str, versions: str, vllm_urls: Sequence[str], command: Sequence[str], *,
           storage_options: Mapping[str, Any] | None = None, cache_dir: str | None = None,
           api_key: str | None = None) -> list[ReplayResult]:
    """Load each selected version into the servers, then run ``command`` with ``CKPTSTREAM_VERSION``,
    ``CKPTSTREAM_URL`` and ``CKPTSTREAM_VLLM_URL`` in its environment."""
    if not command:
        raise ValueError("give the evaluation command after --")
    follower = Follower(url, vllm_urls, storage_options=storage_options, cache_dir=cache_dir, api_key=api_key,
                        replica_id=f"replay-{os.getpid()}")
    results = []
    for version in select_versions(follower.stream, versions):
        started = time.perf_counter()
        try:
            follower.load(version)
        except (CkptStreamError, VllmError) as exc:
            results.append(ReplayResult(version, time.perf_counter() - started, None, 0.0, str(exc)))
            continue
        load_s = time.perf_counter() - started
        env = {**os.environ, "CKPTSTREAM_VERSION": str(version), "CKPTSTREAM_URL": url,
               "CKPTSTREAM_VLLM_URL": vllm_urls[0]}
        started = time.perf_counter()
        code = subprocess.run(list(command), env=env).returncode
        results.append(ReplayResult(version, load_s, code, time.perf_counter() - started))
    return results
