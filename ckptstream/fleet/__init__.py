"""Rollout fleets on Ray (extra ``ray``): vLLM servers following a stream, supervised, behind a router.

``Fleet(url, replicas=N, ...)`` on a running Ray cluster (``ray.init(address=...)`` first) starts a
detached controller actor that runs one actor per server (per node of a multi-node engine), each running
``ckptstream serve`` in-process; ``Fleet.connect(url)`` finds it again. See docs/guides/fleets.md.

Names are imported on first use: importing this package imports no Ray.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_face

_LAZY_NAMES = {
    "Fleet": ".fleet",
    **dict.fromkeys(("FleetReplayResult", "FleetSpec", "ServerStatus", "fleet_name"), ".spec"),
}

if TYPE_CHECKING:
    from .fleet import Fleet
    from .spec import FleetReplayResult, FleetSpec, ServerStatus, fleet_name

__getattr__, __dir__ = lazy_face(__name__, _LAZY_NAMES)

__all__ = ["Fleet", "FleetReplayResult", "FleetSpec", "ServerStatus", "fleet_name"]
