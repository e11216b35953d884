"""Replay on a weights stream (``ckptstream replay``, ``vllm_loader.replay``): load versions one after another
into running servers and evaluate each.

The replay takes the servers over (``takeover.Takeover``) for its whole run: a ``serve``/``follow``
keeping them current stands aside meanwhile, and brings them back to its newest version when the replay
ends. The replay uses the followers' shared cache (``cache.py``): what they hold is reused, and what only
the replay held is deleted at the end.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Sequence

from ...errors import CkptStreamError
from ...process import run_together
from ...reader.selection import select_versions
from ..client import VllmControl, VllmError
from .config import FollowerConfig
from .follower import Follower
from .takeover import Takeover


@dataclass(frozen=True)
class ReplayResult:
    """One version of a replay: how loading it went and what the command returned."""

    version: int
    load_s: float
    exit_code: int | None  # None: the version could not be loaded, the command did not run
    run_s: float
    error: str | None = None
    output: str | None = None  # the command's stdout and stderr, when the replay captured them


def replay_weights(url: str, versions: str | Sequence[int], vllm_urls: Sequence[str | VllmControl],
                   command: Sequence[str], *, config: FollowerConfig, takeover_timeout: float,
                   capture: bool) -> list[ReplayResult]:
    """``replay`` on a weights stream: take the servers over, load each selected version, run ``command``."""
    config = config.with_options(replica_id=config.replica_id or f"replay-{os.getpid()}", stand_aside=False,
                                 ephemeral_cache=True)
    with Follower(url, vllm_urls, config) as follower:
        # Refused before the servers are touched.
        selected = select_versions(follower.stream, versions) if isinstance(versions, str) else \
            [follower.stream.resolve(v) for v in versions]
        with Takeover([c.url for c in follower.clients], timeout=takeover_timeout):
            return [_replay_one(follower, version, url, command, capture) for version in selected]


def _replay_one(follower: Follower, version: int, url: str, command: Sequence[str], capture: bool) -> ReplayResult:
    """Load ``version`` into the servers, then run ``command`` against it."""
    started = time.perf_counter()
    try:
        follower.load(version)
    except (CkptStreamError, VllmError) as exc:
        return ReplayResult(version, time.perf_counter() - started, None, 0.0, str(exc))
    load_s = time.perf_counter() - started
    env = command_environment(version, url, follower.clients[0].url)
    [(code, run_s, output)] = run_together([(command, env)], capture=capture)
    return ReplayResult(version, load_s, code, run_s, output=output)


def command_environment(version: int, url: str, vllm_url: str) -> dict[str, str]:
    """The evaluation command's environment: this process's, with the version, the stream and the server."""
    return {**os.environ, "CKPTSTREAM_VERSION": str(version), "CKPTSTREAM_URL": url, "CKPTSTREAM_VLLM_URL": vllm_url}
