"""The nodes of an engine spanning nodes, as its head's follower sees them (``nodes_ready_timeout`` set): each
rank reads a version's files, or stages a change, from its own node's cache, so the head asks every rank before
using either (``wait_for``), and after each update has every rank hold the version it serves on its node
(``hold_served``), which the node agents keep and build the next change on. Both go through the ckptstream
worker extension's collective RPCs (``worker.py``)."""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Callable, Sequence

from ...errors import NodesNotReady
from ...format import Manifest
from ..client import VllmControl, VllmError, VllmUnreachable
from .cache import CHANGES_DIR, VersionCache
from .config import FollowerConfig

log = logging.getLogger("ckptstream.follow")


class EngineNodes:
    """The nodes of a follower's engines: one-node servers (no ``nodes_ready_timeout``) ask nothing.

    Args:
        config: the follower's (``nodes_ready_timeout``, ``poll_interval``).
        cache: its cache (the same path on every node).
        on_lagging: told the nodes lagging behind (named ``node N (host)``) whenever they change: the follower
            reports them in its replica record.
    """

    def __init__(self, config: FollowerConfig, cache: VersionCache, on_lagging: Callable[[list[str]], None]):
        self.config, self.cache, self.on_lagging = config, cache, on_lagging
        self._lagging: list[str] = []

    def wait_for(self, client: VllmControl, manifest: Manifest, path: Path) -> None:
        """Return once every rank of ``client``'s engine reports, at ``path`` on its own node, ``manifest``'s
        version complete with its manifest hash (a node lacking it is asked for it: its agent decodes it on
        demand), or, for a change file (``VersionCache.change_path``), that file; NodesNotReady (naming the
        lagging nodes, also in the replica record) after ``nodes_ready_timeout``. The servers keep serving
        meanwhile."""
        assert self.config.nodes_ready_timeout is not None
        deadline = time.monotonic() + self.config.nodes_ready_timeout
        change = path.parent.name == CHANGES_DIR
        while True:
            lagging = self._lacking(client, manifest, path, request=not change)
            if lagging != self._lagging:
                if lagging:
                    log.info("version %d: waiting for %s", manifest.version, ", ".join(lagging))
                self._lagging = lagging
                self.on_lagging(lagging)
            if not lagging:
                return
            if time.monotonic() >= deadline:
                what = f"its change {path.name} in {path.parent}" if change else f"it in {path.parent}"
                raise NodesNotReady(f"{', '.join(lagging)} of {client.url} lack(s) {what} after "
                                    f"{self.config.nodes_ready_timeout:.0f} s", version=manifest.version,
                                    lagging=lagging, hint="Is the node agent (ckptstream serve --node-rank N) "
                                                          "running there?")
            time.sleep(min(self.config.poll_interval, max(0.0, deadline - time.monotonic())))

    def _lacking(self, client: VllmControl, manifest: Manifest, path: Path, request: bool) -> list[str]:
        """The nodes of ``client``'s engine (named ``node N (host)``) lacking at ``path`` ``manifest``'s version
        complete with its manifest hash, or the change file ``path``; one cache report (with ``request``, a
        node lacking the version is asked for it)."""
        key = str(manifest.version)
        change = path.parent.name == CHANGES_DIR
        versions_dir = path.parent.parent if change else path.parent
        ranks = client.cache_report(str(versions_dir), request=manifest.version if request and not change else None)
        return list(dict.fromkeys(f"node {r.get('node_rank')} ({r.get('host')})" for r in ranks
                                  if (path.name not in (r.get("changes") or []) if change else
                                      r.get("versions", {}).get(key) != manifest.manifest_hash)))

    def restorable(self, client: VllmControl, manifest: Manifest, path: Path | None) -> Path | None:
        """``path`` (the served version, ``manifest``'s, to reload inside the pause should the update fail) where
        every rank of ``client``'s engine has it complete on its node now (one cache report, asking nothing),
        else None: the follower then writes the old values back, or reloads it after the pause once every node
        has it (vLLM treats a missing directory as a hub repository id and its engine dies of it)."""
        if self.config.nodes_ready_timeout is None or path is None:
            return path
        lagging = self._lacking(client, manifest, path, request=False)
        if lagging:
            log.warning("%s: %s lack(s) version %d in %s: a failed update is undone after the pause", client.url,
                        ", ".join(lagging), manifest.version, path.parent)
            return None
        return path

    def ready_to_check(self, client: VllmControl, manifest: Manifest, path: Path) -> bool:
        """Whether every rank of ``client``'s engine has ``manifest``'s version at ``path`` for the full reload
        that checks an update applied in place (``--verify-apply``): at once on a one-node server, else
        ``wait_for``; a node lacking it is logged (not checked this time)."""
        if self.config.nodes_ready_timeout is None:
            return True
        try:
            self.wait_for(client, manifest, path)
        except NodesNotReady as exc:
            log.warning("version %d: not checked against a full reload on %s (%s)", manifest.version, client.url,
                        exc)
            self.hold_served(client, manifest.version)  # (it serves it: applied in place) the requests are over
            return False
        return True

    def end_requests(self, clients: Sequence[VllmControl], served: int | None) -> None:
        """After a refused version, the head's requests to the nodes of ``clients``' engines are over: their
        ranks hold the version served again (``hold_served``), which removes them; a server away keeps them
        until its next load ends them."""
        for client in clients:
            with contextlib.suppress(VllmUnreachable):
                self.hold_served(client, served)

    def hold_served(self, client: VllmControl, version: int | None) -> None:
        """On an engine spanning nodes, have every rank hold the version it now serves on its node, by number
        (``cache.hold_served_version``: after an update applied in place, vLLM's model path names an older
        version): the node agents keep it, to restore after a failed reload, and build the next change on it,
        and need no replica record to know it (a read-only stream has none). A failure is logged: the servers
        serve on. It also ends the head's requests to the nodes (``cache.hold_served_version``)."""
        if self.config.nodes_ready_timeout is None or version is None:
            return
        try:
            ranks = client.hold_served(str(self.cache.stream_dir), version)
        except VllmUnreachable:
            raise
        except VllmError as exc:
            log.warning("%s: its ranks could not hold the version they serve (%s); a node agent may delete it",
                        client.url, exc)
            return
        unheld = [f"node {r.get('node_rank')} ({r.get('host')})" for r in ranks if r.get("version") is None]
        if unheld:
            log.warning("%s: %s serve(s) no version of the cache, which its agent may delete",
                        client.url, ", ".join(dict.fromkeys(unheld)))
