"""The LoRA adapters of an adapter stream resident in one running vLLM server.

Each version is loaded as the adapter ``<name>@<version>``; the stable name ``<name>`` always means the newest
version loaded. Loading never pauses generation: vLLM's engine reads a new adapter between two steps while
requests for the base model and for the other adapters keep running. The newest ``keep`` versions stay
resident; an older one is unloaded only once no request uses it, and its directory is released (the caller
may delete it) one round later. vLLM's version label (``/weight_info``) names the version the stable name
means, as it names the version of a weights stream's server (so a fleet's controller reads both alike).

What vLLM 0.32 does, and what follows from it:

- The stable name is moved by unloading it and loading it again from the new version's directory, with
  ckptstream's alias resolver answering a request that comes in between (``ckptstream.lora_aliases`` says
  why not ``load_inplace``). The new load gets an engine id of its own, so requests already running on the
  stable name finish on the version they started with.
- An unload only makes vLLM's API server forget the name (``entrypoints/openai/models/serving.py:231-245``):
  a request that already took the adapter runs on, and vLLM's engine reads the adapter's directory again
  if it dropped the weights from its cache meanwhile (``lora/worker_manager.py:274-287``). So a directory
  must outlive every request on it, including requests on the stable name from when it pointed there.
- Which names have requests is vLLM's ``vllm:lora_requests_info`` gauge (``VllmClient.lora_in_use``): a
  request counts from when the engine queued it, a moment after it took its adapter; the round between an
  unload and the release covers that moment.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Collection

from ...errors import AdapterRefused, VllmError
from ...lora_aliases import write_alias
from ..client import AdapterControl

log = logging.getLogger("ckptstream.adapters")

STABLE_DRAIN_SECONDS = 600.0
"""How long a version's directory outlives the stable name's move away from it while requests on the stable
name never stop (a rollout under constant load): vLLM does not tell which version those requests started on,
so those older than this are taken to have ended. A running request needs the directory only if vLLM's engine
dropped the adapter from its cache meanwhile, which ``--max-cpu-loras`` (``adapter_vllm_settings``) prevents."""
VERSION_SEPARATOR = "@"
"""Between the stream's adapter name and a version number in an adapter name (``policy@17``)."""


def version_name(name: str, version: int) -> str:
    """The adapter name of ``version`` of the adapter stream ``name``."""
    return f"{name}{VERSION_SEPARATOR}{version}"


def parse_version_name(name: str, adapter: str) -> int | None:
    """The version of the adapter name ``adapter`` if it is one of ``name``'s versions, else None."""
    prefix, separator, version = adapter.rpartition(VERSION_SEPARATOR)
    return int(version) if separator and prefix == name and version.isdigit() else None


@dataclass(frozen=True)
class Eviction:
    """What one ``evict`` round did.

    Attributes:
        unloaded: versions unloaded in this round (their names are gone; requests that took them run on).
        held: versions beyond the newest ``keep`` still resident because a request uses them (retried next
            round).
        released: versions unloaded in an earlier round that no request can read any more: their
            directories may be deleted.
        resident: the versions the server holds after the round, oldest first.
    """

    unloaded: list[int] = field(default_factory=list)
    held: list[int] = field(default_factory=list)
    released: list[int] = field(default_factory=list)
    resident: list[int] = field(default_factory=list)


class ResidentAdapters:
    """The adapters of the adapter stream ``name`` resident in one vLLM server (not thread-safe: one follower
    loop drives it).

    Args:
        client: the server (``VllmClient``, or a fake ``AdapterControl``).
        name: the stream's adapter name (the stable name; versions are ``<name>@<version>``); it must differ
            from the served base model's name (vLLM refuses an adapter named like it).
        keep: how many of the newest versions stay resident (at least 1).
        aliases: the alias file the server's resolver reads (``lora_aliases.ALIASES_ENV`` in vLLM's
            environment, which ``serve`` sets); None where vLLM runs without it: then a request for the stable
            name that arrives while it moves is refused by vLLM (404).
    """

    def __init__(self, client: AdapterControl, name: str, keep: int, *, aliases: Path | None = None):
        if keep < 1:
            raise ValueError(f"keep must be at least 1 (the newest version), not {keep}")
        if not name or VERSION_SEPARATOR in name or "," in name:
            raise ValueError(f"adapter name {name!r} must be non-empty, without {VERSION_SEPARATOR!r} or ','")
        self.client, self.name, self.keep, self.aliases = client, name, keep, aliases
        self._stable: int | None = None
        # versions the stable name pointed at since it was last seen without requests (their requests may
        # run), each with when it moved away
        self._stable_before: dict[int, float] = {}
        self._draining: set[int] = set()  # unloaded, not released yet
        self._unlabelled = False  # the server took no version label (said once)
        if aliases is None:
            log.warning("no alias file for adapter %s: requests for it while it moves are refused", name)

    # ------------------------------------------------------------------------------------------- state

    def resident(self) -> list[int]:
        """The versions the server holds as ``<name>@<version>``, oldest first (asked of the server)."""
        versions = (parse_version_name(self.name, adapter) for adapter in self.client.lora_adapters())
        return sorted(v for v in versions if v is not None)

    @property
    def stable(self) -> int | None:
        """The version the stable name means (None before the first load)."""
        return self._stable

    def recover(self) -> list[int]:
        """Take over what the server holds (a restarted follower): its resident versions, oldest first, and
        which of them the stable name means (the one loaded from the same directory)."""
        adapters = self.client.lora_adapters()
        paths = {v: path for a, path in adapters.items() if (v := parse_version_name(self.name, a)) is not None}
        stable_path = adapters.get(self.name)
        matching = [v for v, path in paths.items() if path == stable_path]
        self._stable = max(matching) if matching else None
        self._stable_before.clear()
        self._draining.clear()
        if stable_path is not None and self._stable is None:
            log.warning("adapter %s is loaded from %s, which no resident version is: it moves at the next load",
                        self.name, stable_path)
        return sorted(paths)

    # ------------------------------------------------------------------------------------------ change

    def current(self, version: int) -> bool:
        """Whether the server holds ``version`` and its stable name means it (asked of the server: a restarted
        one holds nothing)."""
        held = self.client.lora_adapters()
        return version_name(self.name, version) in held and held.get(self.name) == held[version_name(self.name,
                                                                                                        version)]

    def load(self, version: int, peft_dir: Path) -> None:
        """Load ``version`` from the PEFT directory ``peft_dir`` as ``<name>@<version>`` (nothing to do if it is
        resident); if it is newer than the version the stable name means, or the server lacks the stable name
        (restarted), move the stable name to it.

        Raises:
            AdapterRefused: vLLM refused the adapter (naming the version and the directory); the server keeps
                every adapter it held, the stable name included.
        """
        adapter, path = version_name(self.name, version), str(peft_dir)
        held = self.client.lora_adapters()
        if adapter not in held:
            try:
                self.client.load_lora_adapter(adapter, path)
            except AdapterRefused as exc:
                raise AdapterRefused(f"not loaded: {exc}", adapter=adapter, path=path, status=exc.status,
                                     version=version, hint=exc.hint) from None
            log.info("adapter %s loaded from %s", adapter, path)
        if self._stable is None or version > self._stable or self.name not in held:
            self._move_stable(version, held.get(adapter, path))

    def withdraw(self, version: int, fallback: tuple[int, Path] | None) -> None:
        """Take ``version`` back (another server refused it: the servers must agree): the stable name back to
        ``fallback`` (version, PEFT directory) if it means ``version``, then ``<name>@<version>`` unloaded."""
        held = self.client.lora_adapters()
        if self._stable == version and fallback is not None:
            self._move_stable(fallback[0], held.get(version_name(self.name, fallback[0]), str(fallback[1])))
        if version_name(self.name, version) in held:
            self.client.unload_lora_adapter(version_name(self.name, version))
            self._draining.add(version)

    def _move_stable(self, version: int, path: str) -> None:
        """Point the stable name at ``version``'s directory: alias first, so that a request arriving while
        the name is unloaded is resolved to the new directory."""
        if self.aliases is not None:
            write_alias(self.aliases, self.name, path)
        try:
            self.client.unload_lora_adapter(self.name)
        except AdapterRefused as exc:
            if exc.status != 404:  # 404: not loaded yet (the first version) or already unloaded
                raise
        try:
            self.client.load_lora_adapter(self.name, path)
        except AdapterRefused as exc:
            # 400: a request came in between and the resolver loaded the name, from the alias: check that
            if exc.status != 400 or self.client.lora_adapters().get(self.name) != path:
                raise AdapterRefused(f"{self.name} not moved to it: {exc}", adapter=self.name, path=path,
                                     status=exc.status, version=version) from None
        if self._stable is not None:
            self._stable_before[self._stable] = time.monotonic()
        self._stable = version
        # vLLM's version label says it too: what /weight_info readers (a fleet's controller) take as served;
        # a vLLM without labels (before 0.25, no ckptstream worker extension) serves the adapter all the same
        try:
            self.client.set_weight_version(str(version))
        except VllmError as exc:
            if not self._unlabelled:
                log.warning("%s: version label not set (%s): /weight_info does not name adapter versions",
                            self.client.url, exc)
            self._unlabelled = True
        log.info("adapter %s means version %d", self.name, version)

    def evict(self, hold: Collection[int] = ()) -> Eviction:
        """One round: unload every resident version beyond the newest ``keep`` (and not in ``hold``: versions a
        replay still needs) that no request uses; release the versions unloaded in an earlier round that no
        request can read any more. A version in use is kept and tried again at the next round."""
        in_use = self.client.lora_in_use()
        if self.name not in in_use:
            self._stable_before.clear()

        def used(version: int) -> bool:
            moved = self._stable_before.get(version)
            return version_name(self.name, version) in in_use or (
                moved is not None and time.monotonic() - moved < STABLE_DRAIN_SECONDS)

        released = [v for v in sorted(self._draining) if not used(v)]
        self._draining.difference_update(released)
        resident = self.resident()
        beyond = [v for v in resident[:max(0, len(resident) - self.keep)] if v not in hold and v != self._stable]
        unloaded, held = [], []
        for version in beyond:
            if version_name(self.name, version) in in_use:
                held.append(version)
                continue
            self.client.unload_lora_adapter(version_name(self.name, version))
            self._draining.add(version)
            unloaded.append(version)
        if unloaded or held:
            log.info("adapter %s: unloaded %s, in use %s", self.name, unloaded, held)
        return Eviction(unloaded=unloaded, held=held, released=released,
                        resident=[v for v in resident if v not in unloaded])
