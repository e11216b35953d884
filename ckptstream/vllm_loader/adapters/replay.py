"""``ckptstream replay`` on an adapter stream: versions loaded side by side as LoRA adapters, a command run
against each.

Nothing is taken over, reloaded or paused: the servers keep serving the base model and whatever an adapter
follower keeps resident, while the replay loads the selected versions beside them, in groups of as many as
the servers have free LoRA slots (``--max-loras`` less the adapters they hold; ``max_resident`` where given),
and runs the command against each version of a group at once (``side_by_side``) or one after another.

- Each version is decoded into the host's shared cache (``cache.py``: every tensor's hash checked; one a
  follower decoded is reused from there) and loaded into every server under a name of the replay's own,
  ``<name>@<version>.replay-<pid>`` (``replay_name``), in which ``adapters.parse_version_name`` reads no
  version: a follower never counts it as one of its versions, so never unloads it. The replay unloads it
  when the group's commands have ended, also on an error or Ctrl-C, and deletes the cached versions only it
  held (an ephemeral ``VersionCache``).
- Even a version a follower holds as ``<name>@<version>`` is loaded under the replay's name: the follower
  unloads its own once a newer version arrives, which can happen while an evaluation runs, between two of
  its requests.
- A version that fails its hashes or that vLLM refuses gets its error in its result; the others still run.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Sequence

from ...errors import CkptStreamError, VllmError
from ...format import STREAM_KIND_ADAPTER
from ...reader import DEFAULT_LEASE_TTL, Stream
from ...reader.selection import select_versions
from .follower import default_adapter_name
from .resident import version_name
from ..follow.cache import VersionCache, default_cache_dir
from ...process import run_together
from ..client import VllmClient
from ..follow.replay import ReplayResult, command_environment

log = logging.getLogger("ckptstream.replay")

REPLAY_MARK = ".replay-"
"""Between a version's adapter name and the replay's process id in the name of an adapter a replay loaded."""
MODEL_ENV = "CKPTSTREAM_MODEL"
"""The command's environment variable naming the adapter to put in requests' ``model``."""
DEFAULT_MAX_RESIDENT = 2
"""Versions loaded at once where a server does not tell its ``--max-loras``."""


def replay_name(name: str, version: int) -> str:
    """The adapter name under which this process's replay loads ``version`` of the adapter stream ``name``."""
    return f"{version_name(name, version)}{REPLAY_MARK}{os.getpid()}"


@dataclass
class _Loaded:
    """One version of a group: the adapter name its requests use, or why it could not be loaded."""

    version: int
    model: str | None
    load_s: float
    error: str | None = None


def replay_adapters(url: str, versions: str | Sequence[int], vllm_urls: Sequence[str | VllmClient],
                    command: Sequence[str], *, name: str | None = None, max_resident: int | None = None,
                    side_by_side: bool = True, capture: bool = False, cache_dir: str | os.PathLike[str] | None = None,
                    storage_options: dict[str, Any] | None = None, api_key: str | None = None,
                    lease_ttl: float = DEFAULT_LEASE_TTL) -> list[ReplayResult]:
    """Load the selected versions of the adapter stream at ``url`` into the servers as LoRA adapters, a group at
    a time, and run ``command`` against each with ``CKPTSTREAM_VERSION``, ``CKPTSTREAM_URL``,
    ``CKPTSTREAM_VLLM_URL`` (the first server) and ``CKPTSTREAM_MODEL`` (the adapter name to put in requests'
    ``model``) in its environment. Returns one result per version, in order.

    Args:
        versions: ``A:B[:STEP]`` (see ``select_versions``), or the version numbers themselves; a bad selection
            is refused before any server is asked anything.
        vllm_urls: servers started with ``--enable-lora``, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` and
            ``VLLM_SERVER_DEV_MODE=1`` on the stream's base model.
        name: the stream's adapter name, as its followers use it (default the URL's last part).
        max_resident: versions loaded at once; None: the servers' free LoRA slots (``--max-loras`` less the
            adapters each holds, at least 1), or ``DEFAULT_MAX_RESIDENT`` where a server does not tell.
        side_by_side: run the commands of a group at once (False: one after another).
        capture: keep each command's output (stdout and stderr together) in its result.
        cache_dir, storage_options, api_key, lease_ttl: as for ``AdapterFollower``.
    """
    if not command:
        raise ValueError("give the evaluation command after --")
    if not vllm_urls:
        raise ValueError("at least one vLLM server URL is needed")
    if max_resident is not None and max_resident < 1:
        raise ValueError(f"max_resident must be at least 1, not {max_resident}")
    stream = Stream(url, storage_options=storage_options, lease_ttl=lease_ttl)
    stream.require_kind(STREAM_KIND_ADAPTER)
    selected = select_versions(stream, versions) if isinstance(versions, str) else \
        [stream.resolve(v) for v in versions]
    clients = [VllmClient(u, api_key=api_key) if isinstance(u, str) else u for u in vllm_urls]
    name = name or default_adapter_name(url)
    cache = VersionCache(cache_dir or default_cache_dir(), stream.info().stream_id,
                         f"replay-{name}-{os.getpid()}", ephemeral=True)
    with cache:
        replay = _AdapterReplay(stream, cache, clients, name, max_resident)
        results: list[ReplayResult] = []
        remaining = list(selected)
        while remaining:
            group = replay.next_group(remaining)
            del remaining[:len(group)]
            results += replay.run_group(group, url, command, side_by_side=side_by_side, capture=capture)
        return results


class _AdapterReplay:
    """One adapter replay: its servers, its share of the cache, and the servers' LoRA slots."""

    def __init__(self, stream: Stream, cache: VersionCache, clients: list[VllmClient], name: str,
                 max_resident: int | None):
        self.stream, self.cache, self.clients, self.name = stream, cache, clients, name
        self.max_resident = max_resident
        self._limits: list[int | None] | None = None  # each server's --max-loras, asked once

    def next_group(self, remaining: list[int]) -> list[int]:
        """The versions of ``remaining`` to load next: the first ones, as many as there are free slots."""
        return remaining[:self._free_slots()]

    def run_group(self, group: list[int], url: str, command: Sequence[str], *, side_by_side: bool,
                  capture: bool) -> list[ReplayResult]:
        """Load ``group``, run the command against each version loaded, unload the private adapters."""
        loaded: list[_Loaded] = []
        try:
            for version in group:
                loaded.append(self._load(version, keep={entry.version for entry in loaded if entry.model}))
            ready = [entry for entry in loaded if entry.model is not None]
            envs = [{**command_environment(entry.version, url, self.clients[0].url), MODEL_ENV: str(entry.model)}
                    for entry in ready]
            batches = [envs] if side_by_side else [[env] for env in envs]
            runs = [(code, seconds, None, output) for batch in batches
                    for code, seconds, output in run_together([(command, env) for env in batch], capture=capture)]
        finally:
            for entry in loaded:
                if entry.model is not None:
                    self._unload(entry.model, self.clients)
            # the newest version decoded stays held: the base of the next group's first delta
            decoded = [entry.version for entry in loaded if entry.model is not None]
            self.cache.prune(set(decoded[-1:]))
        by_version = dict(zip((entry.version for entry in ready), runs))
        return [ReplayResult(entry.version, entry.load_s, None, 0.0, entry.error) if entry.model is None else
                ReplayResult(entry.version, entry.load_s, *by_version[entry.version]) for entry in loaded]

    # ------------------------------------------------------------------------------------------ private

    def _free_slots(self) -> int:
        if self.max_resident is not None:
            return self.max_resident
        if self._limits is None:
            self._limits = [client.max_loras() for client in self.clients]
            if None in self._limits:
                log.warning("a server does not tell its --max-loras (is it started with VLLM_SERVER_DEV_MODE=1?): "
                            "loading %d versions at a time (--max-resident sets another number)",
                            DEFAULT_MAX_RESIDENT)
        if None in self._limits:
            return DEFAULT_MAX_RESIDENT
        free = [limit - len(client.lora_adapters()) for limit, client in zip(self._limits, self.clients)
                if limit is not None]
        return max(1, min(free))

    def _load(self, version: int, keep: set[int]) -> _Loaded:
        """``version`` decoded and loaded as ``replay_name`` on every server; on failure the error, nothing
        left loaded."""
        started = time.perf_counter()
        try:
            path = self.cache.acquire(self.stream, version, keep=keep,
                                      holder=f"adapter replay {self.name}")[0]
        except CkptStreamError as exc:
            log.error("replay: version %d refused: %s", version, exc)
            return _Loaded(version, None, time.perf_counter() - started, str(exc))
        model = replay_name(self.name, version)
        done: list[VllmClient] = []
        try:
            for client in self.clients:
                client.load_lora_adapter(model, str(path))
                done.append(client)
        except VllmError as exc:
            self._unload(model, done)
            self.cache.release(version)
            log.error("replay: version %d refused: %s", version, exc)
            return _Loaded(version, None, time.perf_counter() - started, str(exc))
        log.info("replay: version %d loaded as %s from %s", version, model, path)
        return _Loaded(version, model, time.perf_counter() - started)

    def _unload(self, model: str, clients: Sequence[VllmClient]) -> None:
        for client in clients:
            try:
                client.unload_lora_adapter(model)
            except VllmError as exc:  # the others are still unloaded; this one says what is left behind
                log.warning("replay: %s stays loaded in %s: %s", model, client.url, exc)
