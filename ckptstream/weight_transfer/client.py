"""The weight-transfer control plane of several vLLM servers at once, over HTTP.

One stream feeds every server: the trainer publishes a version once, then each server reads it. This
client drives the four routes of vLLM's weight-transfer API on every server concurrently (a
``VLLMWeightSyncClient``: vLLM's trainer-side engines and ckptstream's take it), and after each update
drops the servers' cached prefixes, which hold keys and values computed with the previous weights.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..errors import VllmError
from ..vllm_loader.client import VllmClient


class HttpWeightSyncClient:
    """vLLM's weight-sync routes on every server of ``urls``; a call returns once every server answered,
    and raises ``VllmError`` naming each server that failed and why.

    Args:
        urls: the servers' base URLs (``http://host:port``), started with ``--weight-transfer-config
            '{"backend": "ckptstream"}'`` and ``VLLM_SERVER_DEV_MODE=1``.
        api_key: vLLM's ``--api-key``, if set.
        timeout: seconds an update may take on a server (a full reload of a large model).
        reset_prefix_cache: drop the cached prefixes after each update (on by default: a prefix computed
            with the old weights would otherwise be reused with the new ones).

    Example::

        client = HttpWeightSyncClient(["http://10.0.0.1:8000", "http://10.0.0.2:8000"])
        client.init_weight_transfer_engine({"url": "s3://bucket/run1"})
        client.start_weight_update(); client.update_weights({"version": 7}); client.finish_weight_update("7")
    """

    def __init__(self, urls: str | Sequence[str], *, api_key: str | None = None, timeout: float = 1800.0,
                 reset_prefix_cache: bool = True):
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls:
            raise ValueError("HttpWeightSyncClient needs at least one server URL")
        self.servers = [VllmClient(url, api_key=api_key, reload_timeout=timeout) for url in urls]
        self.reset_prefix_cache = reset_prefix_cache

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._each(lambda server: server.init_weight_transfer_engine(init_info))

    def start_weight_update(self) -> None:
        self._each(VllmClient.start_weight_update)

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self._each(lambda server: server.update_weights(update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        def finish(server: VllmClient) -> None:
            server.finish_weight_update(weight_version)
            if self.reset_prefix_cache:
                server.reset_prefix_cache()

        self._each(finish)

    def _each(self, call: Callable[[VllmClient], None]) -> None:
        with ThreadPoolExecutor(max_workers=min(32, len(self.servers))) as pool:
            futures = [(server, pool.submit(call, server)) for server in self.servers]
        failures = [str(future.exception()) for _, future in futures if future.exception()]  # each names its URL
        if failures:
            raise VllmError(f"{len(failures)} of {len(self.servers)} server(s) failed: {'; '.join(failures)}")
