"""The fleet-wide update slot of rolling updates: one server at a time is out of the router.

The slot is held in the fleet's controller actor; ``FleetSlot`` is its client in a server's process (the
``slot`` a ``RouterGate`` holds while its server is out of the router for an update).
"""

from __future__ import annotations

import time
from typing import Any

SLOT_WAIT = 0.2
"""Seconds between attempts to take the slot while another server holds it."""


class FleetSlot:
    """A lock over the fleet's servers, served by the controller actor: ``with slot:`` (or ``acquire()``/
    ``release()``) lets one holder in at a time. A holder whose actor dies releases it (the controller
    frees the slot of a server it replaces)."""

    def __init__(self, controller: Any, holder: str):
        self._controller, self.holder = controller, holder

    def acquire(self, timeout: float | None = None) -> bool:
        """Wait for the slot (at most ``timeout`` seconds); returns whether this holder has it."""
        import ray

        deadline = None if timeout is None else time.monotonic() + timeout
        while not ray.get(self._controller.try_slot.remote(self.holder)):
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(SLOT_WAIT)
        return True

    def release(self) -> None:
        """Give the slot back (a no-op unless this holder has it)."""
        import ray

        ray.get(self._controller.release_slot.remote(self.holder))

    def __enter__(self) -> FleetSlot:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def router_gate(router_url: str, controller: Any, api_key: str | None, server_url: str) -> Any:
    """The ``update_gate`` of the server at ``server_url`` for rolling updates (``rolling.RouterGate``):
    out of the router while it updates, one server of the fleet at a time."""
    from .rolling import RouterGate
    from .router import Router

    return RouterGate(Router(router_url), slot=FleetSlot(controller, server_url), api_key=api_key)
