"""``ckptstream replay``: load versions one after another into running servers and evaluate each.

On an adapter stream, the versions are loaded beside what the servers serve instead, as LoRA adapters, with
nothing taken over (``adapter_replay.py``); what follows is about weights streams.

The replay takes the servers over (``takeover.Takeover``) for its whole run: a ``serve``/``follow``
keeping them current stands aside meanwhile, and brings them back to its newest version when the replay
ends. The replay uses the followers' shared cache (``cache.py``): what they hold is reused, and what only
the replay held is deleted at the end.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from typing import Any, Sequence

from ..credentials import redact
from ..errors import CkptStreamError
from ..format import STREAM_KIND_ADAPTER
from ..reader import Stream
from ..reader.selection import select_versions
from .client import VllmControl, VllmError
from .follower import Follower, FollowerConfig
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


def replay(url: str, versions: str | Sequence[int], vllm_urls: Sequence[str | VllmControl], command: Sequence[str],
           *, config: FollowerConfig | None = None, takeover_timeout: float = 600.0, capture: bool = False,
           adapter_name: str | None = None, max_resident: int | None = None, side_by_side: bool = True,
           **options: Any) -> list[ReplayResult]:
    """Load each selected version into the servers, then run ``command`` with ``CKPTSTREAM_VERSION``,
    ``CKPTSTREAM_URL`` and ``CKPTSTREAM_VLLM_URL`` in its environment. On an adapter stream, the versions are
    loaded as LoRA adapters beside what the servers serve, and the command also gets ``CKPTSTREAM_MODEL``
    (``adapter_replay.replay_adapters``, which takes ``adapter_name``, ``max_resident`` and ``side_by_side``).

    Args:
        versions: ``A:B[:STEP]`` (see ``select_versions``), or the version numbers themselves.
        vllm_urls: the servers (base URLs, or ``VllmControl`` objects).
        capture: keep the command's output (stdout and stderr together) in each result instead of
            passing it on (a fleet's replay returns it from another node).
        config, options: the follower's options (``FollowerConfig`` and/or its fields as keywords:
            ``storage_options``, ``cache_dir``, ``api_key``, ...).
        takeover_timeout: seconds to wait for the servers' followers to finish an update in flight.
        adapter_name, max_resident, side_by_side: for adapter streams (ValueError on a weights stream).
    """
    if not command:
        raise ValueError("give the evaluation command after --")
    config = (config or FollowerConfig()).with_options(**options)
    if Stream(url, storage_options=config.storage_options).info().kind == STREAM_KIND_ADAPTER:
        from .adapter_replay import replay_adapters  # (it imports this module)

        return replay_adapters(url, versions, vllm_urls, command, name=adapter_name, max_resident=max_resident,
                               side_by_side=side_by_side, capture=capture, cache_dir=config.cache_dir,
                               storage_options=config.storage_options, api_key=config.api_key,
                               lease_ttl=config.lease_ttl)
    if (adapter_name, max_resident, side_by_side) != (None, None, True):
        raise ValueError(f"adapter_name, max_resident and side_by_side are for adapter streams; {redact(url)} is a "
                         f"weights stream")
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
    started = time.perf_counter()
    if capture:
        done = subprocess.run(list(command), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        code, output = done.returncode, done.stdout.decode("utf-8", "replace")
    else:
        code, output = subprocess.run(list(command), env=env).returncode, None
    return ReplayResult(version, load_s, code, time.perf_counter() - started, output=output)


def command_environment(version: int, url: str, vllm_url: str) -> dict[str, str]:
    """The evaluation command's environment: this process's, with the version, the stream and the server."""
    return {**os.environ, "CKPTSTREAM_VERSION": str(version), "CKPTSTREAM_URL": url, "CKPTSTREAM_VLLM_URL": vllm_url}
