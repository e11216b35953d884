"""Rolling updates behind a vLLM router: one server at a time leaves the router, drains, updates, returns.

``RouterGate`` is a follower's ``update_gate`` (``FollowerConfig.update_gate``); clients of the router then
never wait on a server's pause: the router sends their requests to the servers that stay in.
``register_when_current`` puts a (re)started server into the router once it serves the newest good version.

Example (one follower for the servers of a node, a router in front of them)::

    router = Router("http://127.0.0.1:30000")
    follower = Follower(stream_url, server_urls, update_gate=RouterGate(router))
    for url in server_urls:
        register_when_current(router, url, stream_url)   # in a thread, or after the follower's first step
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
import urllib.error
import urllib.request
from typing import Any, ContextManager, Iterator

from ..errors import RouterError, VllmUnreachable
from .router import Router, normalize

log = logging.getLogger("ckptstream.rolling")

DRAIN_TIMEOUT = 120.0
"""Seconds a server out of the router may take to finish its requests before it is paused anyway."""
DRAIN_INTERVAL = 0.05
"""Seconds between two reads of a server's queue; drained means empty at two reads in a row (a request the
router picked the server for just before its removal may still be on its way)."""

_PROCESS_SLOT = threading.Lock()
"""The default slot: one server out of the router at a time in this process."""

# vLLM's gauges (``/metrics``): requests being generated, and queued (also those held by a pause).
_QUEUE_METRIC = re.compile(r"^vllm:num_requests_(?:running|waiting)(?:\{[^}]*\})?\s+(\S+)", re.MULTILINE)


class RouterGate:
    """An ``UpdateGate``: the server leaves ``router`` (checked in its worker list), its running and waiting
    requests finish (vLLM's ``/metrics``, at most ``drain_timeout`` seconds), it is updated, and it returns
    to the router (checked), also after a failed update that was rolled back, since it serves again.

    Args:
        router: the router the servers are registered with.
        slot: held while a server is out (a reusable context manager: a lock, the fleet's slot), so that
            one server of those sharing it is out at a time. Default: one per process.
        api_key: the servers' ``--api-key``, for reading their ``/metrics``.
        drain_timeout: see ``DRAIN_TIMEOUT``.

    A server is taken out only if another worker of the router is live (answers ``/health``): one that is
    the router's only live worker is updated in place, in the router (its clients would get errors instead
    of a short wait; a dead server the router still lists does not count). A server that is not in the
    router when its update begins is not added afterwards.
    """

    def __init__(self, router: Router, *, slot: ContextManager[Any] | None = None, api_key: str | None = None,
                 drain_timeout: float = DRAIN_TIMEOUT):
        self.router = router
        self.slot = slot if slot is not None else _PROCESS_SLOT
        self.api_key = api_key
        self.drain_timeout = drain_timeout

    @contextlib.contextmanager
    def hold(self, server_url: str, version: int) -> Iterator[None]:
        """Out of the router, drained, while the follower updates ``server_url`` to ``version``."""
        server = normalize(server_url)
        with self.slot:
            listed = [normalize(w) for w in self.router.workers()]
            if server not in listed or not self._another_live(server, listed):
                log.info("%s %s; updating it in place", server,
                         "is the router's only live worker" if server in listed else "is not in the router")
                yield
                return
            self.router.remove(server)
            try:
                self._drain(server, version)
                yield
            except BaseException:
                self._return(server, failed=True)
                raise
            self._return(server, failed=False)

    def _another_live(self, server: str, listed: list[str]) -> bool:
        """Whether a worker of ``listed`` other than ``server`` answers ``/health``: the router lists a dead
        server until it is deregistered, and taking ``server`` out then would leave no live one."""
        from ..vllm_loader.client import VllmClient

        return any(VllmClient(w, api_key=self.api_key).healthy() for w in listed if w != server)

    def _return(self, server: str, *, failed: bool) -> None:
        try:
            self.router.add(server)
        except RouterError as exc:
            if not failed:
                raise
            # The update's own error says more; a server that does not answer /health is not re-added.
            log.error("could not return %s to the router after a failed update: %s", server, exc)

    def _drain(self, server: str, version: int) -> None:
        deadline = time.monotonic() + self.drain_timeout
        empty_reads = 0
        while empty_reads < 2:
            try:
                queued = server_queue(server, api_key=self.api_key)
            except VllmUnreachable:
                return  # the update finds out; nothing to wait for
            empty_reads = empty_reads + 1 if queued == 0 else 0
            if time.monotonic() > deadline:
                log.warning("%s still has %d requests after %.0f s out of the router; updating it to version %d "
                            "anyway (they wait for its pause)", server, queued, self.drain_timeout, version)
                return
            time.sleep(DRAIN_INTERVAL)


def server_queue(server_url: str, *, api_key: str | None = None, timeout: float = 5.0) -> int:
    """Requests running or waiting in a vLLM server (its ``vllm:num_requests_running`` and ``..._waiting``).

    Raises:
        VllmUnreachable: the server does not answer ``/metrics``.
    """
    request = urllib.request.Request(normalize(server_url) + "/metrics")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            text = response.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError) as exc:
        raise VllmUnreachable(f"GET {server_url}/metrics failed: {getattr(exc, 'reason', exc)}",
                              hint="Is the server running?") from None
    return int(sum(float(value) for value in _QUEUE_METRIC.findall(text)))


def register_when_current(router: Router, server_url: str, stream_url: str, *, api_key: str | None = None,
                          timeout: float = 600.0, poll_interval: float = 0.5,
                          storage_options: dict[str, Any] | None = None) -> int:
    """Add ``server_url`` to ``router`` once it serves the newest good version of the stream: the newest
    committed version that its follower did not refuse (its replica record names the server). Returns that
    version.

    Raises:
        RouterError: the server does not serve it within ``timeout`` seconds, or the router refused it.
    """
    from ..reader import Stream
    from ..vllm_loader.client import VllmClient

    server = normalize(server_url)
    stream = Stream(stream_url, storage_options=storage_options)
    client = VllmClient(server, api_key=api_key)
    deadline = time.monotonic() + timeout
    served: str | None = None
    while True:
        newest = newest_good_version(stream, server)
        try:
            served = client.weight_version()
        except VllmUnreachable:
            served = None
        if newest is not None and served == str(newest):
            router.add(server)
            return newest
        if time.monotonic() > deadline:
            raise RouterError(f"not registered: it serves {served!r}, the newest good version is {newest} "
                              f"(after {timeout:.0f} s)", router=router.url, worker=server,
                              hint="Is its follower running? `ckptstream replicas URL` shows its state")
        time.sleep(poll_interval)


def newest_good_version(stream: Any, server_url: str) -> int | None:
    """The newest committed version of ``stream`` (a ``Stream``) that no follower of ``server_url`` refused."""
    server = normalize(server_url)
    refused = {int(v) for record in stream.replicas() if server in (normalize(u) for u in record.urls)
               for v in record.refused}
    return next((v for v in reversed(stream.versions()) if v not in refused), None)
