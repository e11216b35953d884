"""The update gate: what a follower enters around each server's update (``FollowerConfig.update_gate``).

A gate is entered before the follower pauses a server and exited once it resumed and passed its one-token
probe, or once a failed update was rolled back; the follower updates one server inside it at a time. A
rolling update (``ckptstream.fleet.rolling.RouterGate``) takes the server out of a router meanwhile, so no
client request waits on its pause.
"""

from __future__ import annotations

from typing import ContextManager, Protocol


class UpdateGate(Protocol):
    """Around one server's pause → reload → resume → probe.

    ``hold`` raising when entered leaves the server untouched: the follower retries the version at its
    next round (a ``RouterError``; any other ``CkptStreamError`` refuses the version). Exiting is not told
    whether the update succeeded: the server serves either version then, or is unreachable.
    """

    def hold(self, server_url: str, version: int) -> ContextManager[None]:
        """A context entered before ``server_url`` is paused to load ``version``."""
