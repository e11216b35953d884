"""One server's pause in an update: the version reloaded whole, or the change staged on its ranks applied (in one
call to the server where vLLM has ckptstream's route: ``pause_route``), then labelled and resumed; where a reload
fails, the served version reloaded back inside the same pause; then the checks that need no pause. Where each
pause went is logged (``paused 0.012 s in one call (pause 0.001 s, apply 0.008 s, ...)``).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from ...errors import CkptStreamError
from ...format import MARKER_FILE
from ..client import VllmControl, VllmError
from .in_place import InPlaceUpdates, step_seconds
from .nodes import EngineNodes

log = logging.getLogger("ckptstream.follow")


class ServerPause:
    """Pauses one server at a time for a follower (its ``in_place`` updates, its engine's ``nodes``, vLLM's pause
    ``mode``)."""

    def __init__(self, in_place: InPlaceUpdates, nodes: EngineNodes, mode: str):
        self.in_place, self.nodes, self.mode = in_place, nodes, mode

    def load_into(self, client: VllmControl, version: int, path: Path | None, current: int | None,
                  restore: Path | None = None, restored: list[VllmControl] | None = None,
                  change: Path | None = None) -> tuple[float, float, str | None]:
        """Pause, reload ``path`` (or apply the ``change`` staged on every rank), label, resume, check;
        (seconds paused, seconds reloading or applying, the fallback reason where the apply failed and
        ``path`` was reloaded instead, or, with no ``path`` yet, ``restore``: the server then serves the
        current version again). If the reload fails and ``restore`` (the current version's directory) is
        given, it is reloaded before ``/resume`` (a rank whose reload failed half-way holds placeholders,
        and ranks that succeeded hold the new version); then the client is appended to ``restored``."""
        directory = path if path is not None else restore
        if (directory is None and change is None) or (directory is not None and
                                                      not (directory / MARKER_FILE).is_file()):
            # vLLM treats a missing directory as a hub repository id and its engine dies of it.
            raise CkptStreamError(f"{directory} is not a complete materialized directory; not handing it to vLLM",
                                  version=version)
        started = time.perf_counter()
        calls = _Laps(started)  # (where the pause goes, in the log: each call a round trip to the engine)
        serves = version
        in_one = self.in_place.apply_in_pause(client, version, self.mode) if change is not None else None
        if in_one is not None and in_one.resumed:
            paused = time.perf_counter() - started
            log.info("%s: version %d paused %.3f s in one call (%s)", client.url, version, paused,
                     step_seconds(in_one.seconds))
            self._check_serving(client, version)
            return paused, in_one.seconds.get("apply", 0.0), None
        if in_one is not None:
            calls.lap("one call")
        client.pause(self.mode)  # (where the one call failed, the server may be paused already)
        calls.lap("pause")
        try:
            reload_started = time.perf_counter()
            failed = in_one.failed if in_one is not None else None
            try:
                if change is not None and in_one is None:
                    failed = self.in_place.apply_paused(client, version)
                    calls.lap("apply")
                if change is None or failed is not None:
                    # A half-applied change is overwritten on every rank.
                    if path is None:
                        assert current is not None
                        if restore is None:  # nothing cached to reload (--cache-versions 0): written back
                            self.in_place.revert_paused(client, version)
                        else:
                            client.reload_weights(str(restore))
                        serves = current
                    else:
                        client.reload_weights(str(path))
                    calls.lap("reload")
                reload_s = time.perf_counter() - reload_started
                client.reset_prefix_cache()
                calls.lap("prefix cache reset")
                client.set_weight_version(str(serves), check=False)
                calls.lap("label")
            except VllmError:
                if restore is not None and self._restore_paused(client, restore, current) and restored is not None:
                    restored.append(client)
                raise
        finally:
            client.resume(check=False)
        paused = time.perf_counter() - started
        calls.lap("resume")
        log.info("%s: version %d paused %.3f s (%s)", client.url, version, paused, calls)
        self._check_serving(client, serves)
        return paused, reload_s, failed

    def _check_serving(self, client: VllmControl, serves: int) -> None:
        """After a pause: the server generates again, labelled ``serves``, which its ranks hold. None of these
        needs the pause."""
        client.check_resumed()
        client.check_weight_version(str(serves))
        client.probe()
        self.nodes.hold_served(client, serves)

    def _restore_paused(self, client: VllmControl, restore: Path, current: int | None) -> bool:
        """Reload the current version into a paused server whose reload failed (every rank): whether it did."""
        try:
            client.reload_weights(str(restore))
            client.reset_prefix_cache()
            client.set_weight_version(str(current), check=False)
        except VllmError as exc:
            log.error("could not restore version %s on %s inside the pause: %s", current, client.url, exc)
            return False
        log.warning("reload failed on %s; every rank reloaded version %s", client.url, current)
        return True


class _Laps:
    """Seconds between named points of a pause, shown as ``step_seconds`` shows the one call's."""

    def __init__(self, started: float):
        self._last = started
        self.seconds: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name], self._last = now - self._last, now

    def __str__(self) -> str:
        return step_seconds(self.seconds)
