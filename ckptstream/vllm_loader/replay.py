"""``ckptstream replay``: load versions one after another into running servers and evaluate each.

On a weights stream the replay takes the servers over and loads each version into them (``follow.replay``); on
an adapter stream it loads the versions beside what the servers serve, as LoRA adapters, with nothing taken over
(``adapters.replay``).
"""

from __future__ import annotations

from typing import Any, Sequence

from ..credentials import redact
from ..format import STREAM_KIND_ADAPTER
from ..reader import Stream
from .adapters.replay import replay_adapters
from .client import VllmControl
from .follow.config import FollowerConfig
from .follow.replay import ReplayResult, replay_weights

__all__ = ["ReplayResult", "replay"]


def replay(url: str, versions: str | Sequence[int], vllm_urls: Sequence[str | VllmControl], command: Sequence[str],
           *, config: FollowerConfig | None = None, takeover_timeout: float = 600.0, capture: bool = False,
           adapter_name: str | None = None, max_resident: int | None = None, side_by_side: bool = True,
           **options: Any) -> list[ReplayResult]:
    """Load each selected version into the servers, then run ``command`` with ``CKPTSTREAM_VERSION``,
    ``CKPTSTREAM_URL`` and ``CKPTSTREAM_VLLM_URL`` in its environment. On an adapter stream, the versions are
    loaded as LoRA adapters beside what the servers serve, and the command also gets ``CKPTSTREAM_MODEL``
    (``adapters.replay.replay_adapters``, which takes ``adapter_name``, ``max_resident`` and ``side_by_side``).

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
        return replay_adapters(url, versions, vllm_urls, command, name=adapter_name, max_resident=max_resident,
                               side_by_side=side_by_side, capture=capture, cache_dir=config.cache_dir,
                               storage_options=config.storage_options, api_key=config.api_key,
                               lease_ttl=config.lease_ttl)
    if (adapter_name, max_resident, side_by_side) != (None, None, True):
        raise ValueError(f"adapter_name, max_resident and side_by_side are for adapter streams; {redact(url)} is a "
                         f"weights stream")
    return replay_weights(url, versions, vllm_urls, command, config=config, takeover_timeout=takeover_timeout,
                          capture=capture)
