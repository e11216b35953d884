"""Following an adapter stream: each new version loaded into running vLLM servers as a LoRA adapter.

A version of an adapter stream (FORMAT.md, "Adapter streams") is decoded into the host's shared cache as a
PEFT directory (``adapter_config.json``, ``adapter_model.safetensors``), checked against the stream's rank
and every tensor's hash, then loaded into every server as ``<name>@<version>``; the stable ``<name>`` moves
to the newest version (``adapters.ResidentAdapters``). The newest ``keep`` versions stay resident; an older
one is unloaded once no request uses it, and its directory deleted once nothing can read it any more.
Nothing pauses: vLLM loads an adapter between two engine steps, while requests for the base model and the
other versions keep running. A version vLLM refuses (a corrupt file, a rank above ``--max-lora-rank``,
another base) is logged and skipped; every resident version keeps serving.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import AdapterRefused, CkptStreamError
from ..format import STREAM_KIND_ADAPTER
from ..reader import DEFAULT_LEASE_TTL, Stream
from ..reader.adapter import check_adapter_fits
from .adapters import ResidentAdapters
from .cache import VersionCache, default_cache_dir, safe_owner
from .client import VllmClient
from .follower import prepare_version

log = logging.getLogger("ckptstream.follow")


class AdapterFollower:
    """Keeps the newest ``keep`` versions of the adapter stream at ``url`` resident in running vLLM servers.

    Args:
        url: the adapter stream.
        vllm_urls: servers started with ``--enable-lora`` (``--max-loras`` at least ``keep`` + 1),
            ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` and ``VLLM_SERVER_DEV_MODE=1`` on the stream's base model.
        name: the stable adapter name (default the stream URL's last part); versions are ``<name>@<version>``.
        keep: versions kept resident.
        base_dir: the base model the servers serve, to check the stream's base identity against it.
        aliases: the alias file of the servers' ``CKPTSTREAM_LORA_ALIASES`` (``lora_aliases``), so that a
            request for ``<name>`` arriving while it moves is answered; None: such a request gets a 404.
        cache_dir, storage_options, api_key, poll_interval, lease_ttl: as for :class:`Follower`.
    """

    def __init__(self, url: str, vllm_urls: Sequence[str | Any], *, name: str | None = None, keep: int = 2,
                 base_dir: str | Path | None = None, aliases: str | Path | None = None,
                 cache_dir: str | Path | None = None, storage_options: dict[str, Any] | None = None,
                 api_key: str | None = None, poll_interval: float = 1.0, lease_ttl: float = DEFAULT_LEASE_TTL):
        if not vllm_urls:
            raise ValueError("at least one vLLM server URL is needed")
        self.stream = Stream(url, storage_options=storage_options, lease_ttl=lease_ttl)
        self.stream.require_kind(STREAM_KIND_ADAPTER)
        info = self.stream.info()
        assert info.adapter is not None  # an adapter stream's stream.json has its block
        base_hash = None
        if base_dir is not None:
            from ..basehash import base_model_hash

            base_hash = base_model_hash(base_dir)
        check_adapter_fits(info.adapter, base_hash=base_hash, max_lora_rank=None, version=None)
        self.name = name or default_adapter_name(url)
        self.poll_interval = poll_interval
        clients = [VllmClient(u, api_key=api_key) if isinstance(u, str) else u for u in vllm_urls]
        self.servers = [ResidentAdapters(c, self.name, keep, aliases=None if aliases is None else Path(aliases))
                        for c in clients]
        self.cache = VersionCache(cache_dir or default_cache_dir(), info.stream_id, safe_owner(f"lora-{self.name}"))
        self.refused: dict[int, str] = {}
        self._dirs: set[int] = set()  # versions loaded whose directories something may still read
        for server in self.servers:
            for version in server.recover():  # a restarted follower takes the resident set over
                self._dirs.add(version)
                self.cache.hold(version)

    def resident(self) -> list[int]:
        """The versions resident on every server."""
        sets = [set(server.resident()) for server in self.servers]
        return sorted(set.intersection(*sets))

    def step(self) -> int | None:
        """One round: load the newest version where it is not resident yet, then unload and release what
        is beyond the newest ``keep``; returns the version loaded, or None."""
        loaded = None
        newest = self.stream.latest()
        if newest is not None and newest not in self.refused and newest not in self.resident():
            loaded = self._load(newest)
        for server in self.servers:
            eviction = server.evict()
            for version in eviction.released:
                if all(version not in s.resident() for s in self.servers):
                    self._dirs.discard(version)
                    self.cache.release(version)
        self.cache.prune(self._dirs)
        return loaded

    def run(self, stop: threading.Event) -> None:
        """``step`` every ``poll_interval`` seconds until ``stop`` is set; a failure of storage or of a
        server is logged and retried at the next round."""
        while not stop.is_set():
            try:
                self.step()
            except CkptStreamError as exc:
                log.warning("adapter %s: %s; retrying", self.name, exc)
            stop.wait(self.poll_interval)

    def close(self) -> None:
        self.cache.close()

    def __enter__(self) -> AdapterFollower:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _load(self, version: int) -> int | None:
        try:
            path = prepare_version(self.stream, self.cache, version, keep=self._dirs,
                                   holder=f"adapter follower {self.name}")[0]
        except CkptStreamError as exc:  # corrupt, or not of the stream's rank: every resident version serves
            self._refuse(version, exc)
            return None
        self._dirs.add(version)
        try:
            for server in self.servers:
                server.load(version, path)
        except AdapterRefused as exc:
            self._refuse(version, exc)
            return None
        log.info("adapter %s: version %d resident (as %s@%d); %s means it", self.name, version, self.name,
                 version, self.name)
        return version

    def _refuse(self, version: int, exc: Exception) -> None:
        self.refused[version] = str(exc)
        log.error("adapter %s: version %d refused: %s; every resident version keeps serving", self.name,
                  version, exc)


def default_adapter_name(url: str) -> str:
    """The stable adapter name of a stream: the last part of its URL (``s3://b/runs/policy`` → ``policy``)."""
    name = url.rstrip("/").rsplit("/", 1)[-1] or "adapter"
    return name.replace("@", "-").replace(",", "-")
