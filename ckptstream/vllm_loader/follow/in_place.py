"""A follower's in-place updates: the change from the served version to the next one (built once per host in the
cache), its staging on every worker of a server while it generates, its apply inside the pause, and the check of
a patched server against a full reload (``--verify-apply``), which turns them off on a server that differs.

Every reason against it, or failure of it, is a fallback reason (``observe.FALLBACK_REASONS``): the caller
(``Follower``) then reloads the version fully.
"""

from __future__ import annotations

import collections
import contextlib
import logging
from pathlib import Path
from typing import NamedTuple, Sequence

from ...format import ENCODING_UNCHANGED, MARKER_FILE, parse_version_name
from ...reader import Stream
from ..client import VllmControl, VllmError, VllmUnreachable
from ..inplace.checks import staging_problem
from ..inplace.exact import Traced
from ..inplace.change import (KEPT_DELTAS_BYTES, MAX_CHANGE_FRACTION, UNCHECKED, WHOLE, ChangeSummary,
                              build_change, build_change_from_deltas, build_change_from_stored, with_old_values)
from .cache import VersionCache
from .config import FollowerConfig

log = logging.getLogger("ckptstream.follow")

_OLD_VALUES_FROM_NOW_ON = ("%s: %s; its changes are staged with their old values (from the cached copy of the served "
                           "version) from now on")


class PausedApply(NamedTuple):
    """What the server's one call (``InPlaceUpdates.apply_in_pause``) did."""

    resumed: bool  # applied on every rank, labelled, generating again
    failed: str | None  # else why not (``observe.FALLBACK_REASONS``): the server may be paused
    seconds: dict[str, float]  # per step inside the server: pause (the prefix cache reset), apply, label, resume


def step_seconds(seconds: dict[str, float]) -> str:
    """Where a pause went, for the log: ``pause 0.007 s, apply 0.029 s, ...``."""
    return ", ".join(f"{step} {took:.3f} s" for step, took in seconds.items())


class InPlaceUpdates:
    """The in-place side of one follower's updates (its servers ``clients``, its ``stream`` and ``cache``).

    Attributes:
        off: server URL -> why in-place updates stopped on it (``verify``), for good.
        old_values: server URL -> why its ranks cannot check a change from the deltas alone (``unverifiable``:
            a runtime dtype that rounds the checkpoint's values, a tensor held unevenly); from then on only the
            change with old values (``packed-1``) is built for it, where the served version is cached, else its
            updates are full reloads (``unverifiable``) without a change staged.
    """

    def __init__(self, config: FollowerConfig, stream: Stream, cache: VersionCache, clients: Sequence[VllmControl]):
        self.config, self.stream, self.cache, self.clients = config, stream, cache, clients
        self.off: dict[str, str] = {}
        self.old_values: dict[str, str] = {}
        self._count: collections.Counter[str] = collections.Counter()  # updates applied in place, per server URL
        self._explained: set[str] = set()  # fallback explanations logged (each once)
        self._unprepared: set[str] = set()  # servers that refused ``prepare``
        # server URL -> its ranks' answers, once their traces are done (``prepare``); None where its extension does
        # not say (older)
        self._traced: dict[str, list[Traced] | None] = {}
        self._asked_again: set[str] = set()  # servers asked once more at a change whether their traces are done

    def change(self, version: int, path: Path | None, current: int | None) -> tuple[Path | None, str | None]:
        """The change from the served version to ``version`` in the cache, or why there is none
        (``observe.FALLBACK_REASONS``): built from the stored deltas between them (``path`` None: from the
        deltas alone where ``version`` is a chain of deltas on the served one with change checks, else with the
        served version's cached copy), else by comparing the cached ``path`` with the served version's.
        (None, None): none from the deltas (a version between stores tensors whole), the comparison may
        find one."""
        if not self.config.apply_in_place or all(c.url in self.off for c in self.clients):
            return None, "disabled"
        if current is None:
            return None, "first_version"
        cached = (self.cache.path(current) / MARKER_FILE).is_file()
        if not cached and path is not None:
            return self._uncached(version, current)
        active = [c for c in self.clients if c.url not in self.off]
        from_deltas_with_old_values = path is None and cached and self._builds_old_values()
        if from_deltas_with_old_values:
            self._mark_rounding(active, version, current)
        # A server that cannot check a change from the deltas alone is staged the one with old values (which
        # every server can check), built directly: the deltas are read once.
        packed = from_deltas_with_old_values and any(c.url in self.old_values for c in active)
        if path is None and not packed and all(c.url in self.old_values for c in active):
            if cached and self._stored_whole_since(version, current):
                return None, None  # (a keyframe between: the comparison builds the change with old values)
            for client in active:
                self._unverifiable(client)
            return None, "unverifiable"
        built: list[ChangeSummary] = []
        base, stream_id = current, self.stream.info().stream_id

        def build(out: Path) -> None:
            if path is None:
                with self.stream.keeping_reads(KEPT_DELTAS_BYTES):  # the decode reads them from memory
                    if packed:
                        built.append(build_change_from_deltas(self.stream, self.cache.path(base), out, base=base,
                                                              version=version, max_fraction=MAX_CHANGE_FRACTION))
                        return
                    built.append(build_change_from_stored(self.stream, out, base=base, version=version,
                                                          base_dir=self.cache.path(base) if cached else None,
                                                          max_fraction=MAX_CHANGE_FRACTION))
            else:
                built.append(build_change(self.cache.path(base), path, out, stream_id=stream_id, base=base,
                                          version=version, max_fraction=MAX_CHANGE_FRACTION))

        try:
            change = self.cache.change(base, version, build)
        except Exception as exc:  # noqa: BLE001 - e.g. a full disk, a corrupt delta: the decode refuses that
            # What was kept may be the bad read itself: the decode reads storage again, so that a transient
            # fault does not refuse a good version.
            self.stream.drop_kept_reads()
            self.explain("no_change", f"version {version} on {base}: building the change failed: {exc}")
            return None, "no_change"
        if change is None:  # too many elements changed (some counted), or the versions do not compare
            if path is None and built and built[0].problem == WHOLE:
                return (None, None) if cached else self._uncached(version, current)
            if built and built[0].problem == UNCHECKED:
                return self._uncached(version, current)
            reason = "large_change" if built and built[0].changed else "no_change"
            self.explain(reason, f"version {version} on {base}: {built[0].problem if built else 'not built'}")
            return None, reason
        if built:
            log.info("version %d: %d of %d elements changed since version %d, in %d tensors", version,
                     built[0].changed, built[0].total, base, built[0].tensors)
        return change, None

    def _stored_whole_since(self, version: int, base: int) -> bool:
        """Whether a version after ``base`` up to ``version`` stores a tensor whole (or the chain between them
        cannot be read: the decode says why); from the manifests alone (the generator is never started)."""
        try:
            changes = self.stream.changes_since(version, base, lambda *found: None, max_tensor_bytes=0)
        except Exception:  # noqa: BLE001 - e.g. a base gone: the decode reports it
            return True
        if changes is None:
            return True
        changes.close()
        return False

    def _uncached(self, version: int, current: int) -> tuple[None, str]:
        """Why no change to ``version`` is built where one needs the served version's copy, which is not cached."""
        if self.config.cache_versions == 0:
            self.explain("no_change", f"version {version}: the served version {current} is not cached "
                                      "(--cache-versions 0) to build the change on, and the deltas since carry "
                                      "no change checks")
            return None, "no_change"
        return None, "first_version"

    def prepare(self, clients: Sequence[VllmControl], served: Path) -> None:
        """Have the workers of ``clients`` trace their loaders on the directory ``served`` of the version they
        serve while they generate, so that the first change stages sooner (where in-place updates are on). Asked
        after every start and full reload (a restarted server's workers have traced nothing); a worker traces
        once. A server that refused it once (no worker extension, or an older one) is not asked again. Once their
        traces are done, its ranks' answers say which checkpoint tensors they round (``_mark_rounding``)."""
        if not self.config.apply_in_place:
            return
        for client in clients:
            if client.url in self.off or client.url in self._unprepared:
                continue
            try:
                answers = client.prepare_in_place(str(served))
            except VllmError as exc:  # (the first change traces what it needs)
                log.info("%s: tracing the loaders before the first change failed: %s", client.url, exc)
                continue
            if answers is None:
                self._unprepared.add(client.url)
                continue
            traced = [Traced.from_json(a) for a in answers] if isinstance(answers, list) else [None]
            known = [t for t in traced if t is not None]
            if len(known) < len(traced):
                self._traced[client.url] = None  # (an older extension: the first change finds out)
            elif all(t.done for t in known):
                self._traced[client.url] = known
            else:  # (a restarted server's ranks: what was said before is not theirs)
                self._traced.pop(client.url, None)
                self._asked_again.discard(client.url)

    def _mark_rounding(self, clients: Sequence[VllmControl], version: int, base: int) -> None:
        """Mark (``old_values``) each of ``clients`` whose ranks round a tensor that a version after ``base`` up to
        ``version`` changes (from the manifests): the change with old values is then built for it directly, not
        the change from the deltas alone first, which its ranks would refuse. A server whose traces were not done
        when asked at its start is asked once more here (its answer kept for the next change)."""
        unknown = [c for c in clients if c.url not in self.old_values and c.url not in self._traced
                   and c.url not in self._asked_again]
        if unknown:
            self._asked_again.update(c.url for c in unknown)
            self.prepare(unknown, self.cache.path(base))
        rounding = {c.url: self._traced[c.url] for c in clients if c.url not in self.old_values
                    and any(t.rounded for t in self._traced.get(c.url) or ())}
        # (a version between stores a tensor whole: the change is built by comparing copies, with old values)
        if not rounding or self._stored_whole_since(version, base):
            return
        try:
            changed = {t.name for m in self.stream.chain(version) if m.version > base for t in m.tensors
                       if t.encoding != ENCODING_UNCHANGED}
        except Exception:  # noqa: BLE001 - e.g. a base gone: building the change says why
            return
        for url, traced in rounding.items():
            for why, names in (group for t in traced for group in t.rounded.items()):
                met = changed.intersection(names)
                if met:
                    self.old_values[url] = f"{why} ({min(met)}, which version {version} changes)"
                    log.warning(_OLD_VALUES_FROM_NOW_ON, url, self.old_values[url])
                    break

    def stage(self, client: VllmControl, change: Path) -> tuple[Path | None, str | None]:
        """Have every worker of ``client`` stage ``change`` (the server keeps generating); the change staged
        (the one with old values where its ranks cannot check one from the deltas alone: ``old_values``), or
        None and why it will be reloaded fully instead."""
        if client.url in self.old_values:  # known: the change from the deltas alone is not staged again
            packed = self._with_old_values(change)
            if packed is None:
                self._unverifiable(client)
                return None, "unverifiable"
        else:
            packed = None
        try:
            problem = self._stage(client, packed or change)
            if problem is not None and problem[0] == "unverifiable" and packed is None:
                self.old_values[client.url] = problem[1]
                packed = self._with_old_values(change)
                if packed is not None and packed != change:
                    log.warning(_OLD_VALUES_FROM_NOW_ON, client.url, problem[1])
                    problem = self._stage(client, packed)
                else:
                    packed = None
                    problem = problem[0], self._unverifiable_detail(client)
        except VllmUnreachable:
            raise
        except VllmError as exc:
            self.explain("no_extension", f"{client.url}: {exc}")
            return None, "no_extension"
        if problem is not None:
            with contextlib.suppress(VllmError):
                client.discard_change()
            reason, detail = problem
            self.explain(reason, f"{client.url}: {detail}")
            return None, reason
        return packed or change, None

    def _unverifiable(self, client: VllmControl) -> None:
        self.explain("unverifiable", f"{client.url}: {self._unverifiable_detail(client)}")

    def _unverifiable_detail(self, client: VllmControl) -> str:
        """Why ``client``'s updates are full reloads (``unverifiable``), in the same words every update."""
        return f"{self.old_values[client.url]}; no change with old values to stage instead{self._where()}"

    def _stage(self, client: VllmControl, change: Path) -> tuple[str, str] | None:
        results = client.stage_change(str(change))
        timed = [r["seconds"] for r in results if isinstance(r.get("seconds"), dict)]
        if timed:  # (the slowest rank's: where a staging beside generation goes)
            slowest = max(timed, key=lambda seconds: seconds.get("wall", 0.0))
            log.info("%s: %s staged on its workers in %s", client.url, change.name,
                     ", ".join(f"{phase} {value:.3f} s" for phase, value in slowest.items()))
        return staging_problem(results)

    def _with_old_values(self, change: Path) -> Path | None:
        """``change.with_old_values`` for ``change``, built where this node has the served version's copy: not
        on an engine spanning nodes (the other nodes' agents build only the change from the deltas alone)."""
        base = self._base_of(change)
        base_dir = self.cache.path(base) if self._builds_old_values() and base is not None else None
        if base_dir is not None and not (base_dir / MARKER_FILE).is_file():
            base_dir = None
        try:
            return with_old_values(self.stream, base_dir, change)
        except Exception as exc:  # noqa: BLE001 - e.g. a full disk: reloaded fully, said why
            log.warning("building the change %s with old values failed: %s", change.name, exc)
            return None

    def _builds_old_values(self) -> bool:
        """Whether this node builds changes with old values (``_with_old_values``): it caches the served version,
        and the engine does not span nodes (whose other nodes have only the change from the deltas)."""
        return self.config.nodes_ready_timeout is None and self.config.cache_versions > 0

    def _base_of(self, change: Path) -> int | None:
        """The base version of a change file in the cache (``VersionCache.change_path``: ``<base>-<version>``)."""
        return parse_version_name(change.name.split("-", 1)[0])

    def _where(self) -> str:
        if self.config.nodes_ready_timeout is not None:
            return " (an engine spanning nodes: its other nodes have only the change from the deltas)"
        return " (the served version is not cached: --cache-versions 0)" if self.config.cache_versions == 0 else ""

    def apply_in_pause(self, client: VllmControl, version: int, mode: str) -> PausedApply | None:
        """Pause ``client``, apply its staged change on every rank, label ``version`` and resume, in one call to the
        server (``pause_route``); None where the server has no such call (nothing was done: the caller pauses and
        applies call by call). Not ``resumed``: the caller reloads fully, pausing the server again (it may be)."""
        try:
            answer = client.apply_in_pause(mode, str(version))
        except VllmUnreachable:
            raise
        except VllmError as exc:  # (e.g. a 500: the server may be paused)
            answer = {"results": [], "resumed": False, "error": str(exc)}
        if answer is None:
            return None
        timed = answer.get("seconds")
        seconds = {str(k): float(v) for k, v in timed.items()} if isinstance(timed, dict) else {}
        if answer.get("resumed") is True:
            return PausedApply(True, None, seconds)
        log.warning("version %d: the in-place apply in one call failed on %s (%s; %s); reloading it fully on every "
                    "rank", version, client.url, answer.get("error") or "no reason given",
                    step_seconds(seconds) or "no step timed")
        return PausedApply(False, "apply_failed", seconds)

    def apply_paused(self, client: VllmControl, version: int) -> str | None:
        """Inside the pause: every rank writes its staged change; None, or the fallback reason (the caller
        then reloads the version fully on every rank)."""
        try:
            results = client.apply_change()
        except VllmUnreachable:
            raise
        except VllmError as exc:
            results = [{"error": str(exc)}]
        errors = [str(r.get("error")) for r in results if not isinstance(r, dict) or r.get("error")]
        if errors:
            log.warning("version %d: the in-place apply failed on %s (%s); reloading it fully on every rank",
                        version, client.url, errors[0])
            return "apply_failed"
        return None

    def revert_paused(self, client: VllmControl, version: int) -> None:
        """Inside the pause, after an apply that failed on some rank: every rank writes back the old values
        of what it applied (the served version is cached nowhere to reload). VllmError where a rank cannot."""
        results = client.revert_change()
        errors = [str(r.get("error")) for r in results if not isinstance(r, dict) or r.get("error")]
        if errors:
            raise VllmError(f"{client.url}: version {version} applied on some ranks could not be written back "
                            f"({errors[0]})")
        log.warning("version %d: the ranks that applied it wrote the old values back", version)

    def verify_due(self, client: VllmControl) -> bool:
        self._count[client.url] += 1
        every = self.config.verify_apply
        return every is not None and self._count[client.url] % max(1, every) == 0

    def verify(self, client: VllmControl, version: int, path: Path) -> bool:
        """Compare the patched model with a full reload of the same version (which then serves): the hash of
        every runtime parameter, and what the model computes (``CANARY_PROMPTS``' greedy tokens and their
        logprobs, each prompt sent alone). A copy derived from a parameter after loading (dequantized,
        reordered, packed) that a write in place misses shows only in the outputs. A difference, or a check
        that could not be made, turns in-place updates off on that server, loudly. Whether they were equal."""
        try:
            patched, computed = client.parameter_hashes(), client.canary()
            client.pause(self.config.pause_mode)
            try:
                client.reload_weights(str(path))
                client.reset_prefix_cache()
            finally:
                client.resume()
            reloaded, recomputed = client.parameter_hashes(), client.canary()
            # Requests batched beside a canary can move its logprobs on some kernels: a reloaded model that
            # answers differently twice cannot be compared (the parameters still are).
            reproducible = recomputed == computed or client.canary() == recomputed
        except VllmUnreachable:
            raise
        except VllmError as exc:
            return self.turn_off(client, f"the in-place update of version {version} on {client.url} "
                                                 f"could not be verified: {exc}")
        differing = sorted({name for p, r in zip(patched, reloaded) for name in set(p) | set(r)
                            if p.get(name) != r.get(name)})
        if differing:
            return self.turn_off(client, f"version {version} applied in place on {client.url} differed "
                                                 f"from a full reload in {len(differing)} parameter(s), e.g. "
                                                 f"{differing[0]}")
        if not reproducible:
            log.warning("version %d on %s: the canary prompts' outputs changed between two asks of the same "
                        "weights (other requests batched beside them); the parameters alone were compared",
                        version, client.url)
        elif recomputed != computed:
            prompt = next(i for i, (a, b) in enumerate(zip(computed, recomputed)) if a != b)
            what = "tokens" if computed[prompt]["token_ids"] != recomputed[prompt]["token_ids"] else "logprobs"
            return self.turn_off(client, f"version {version} applied in place on {client.url} computed "
                                                 f"other {what} than a full reload (canary prompt {prompt}) with "
                                                 f"equal parameters: a copy derived from them after loading was "
                                                 f"left stale")
        compared = ("" if not reproducible else ", and the canary prompts' tokens and logprobs"
                    if all(answer["logprobs"] is not None for answer in computed)
                    else ", and the canary prompts' tokens (the server gave no logprobs)")
        log.info("version %d on %s: the in-place update equals a full reload, every parameter bit for bit%s",
                 version, client.url, compared)
        self.prepare([client], path)  # (the reload stopped a trace that may not have ended)
        return True

    def turn_off(self, client: VllmControl, why: str) -> bool:
        """Turn in-place updates off on ``client`` (full reloads from now on), saying why; False."""
        self.off[client.url] = why
        log.error("%s: in-place updates are off on %s from now on (full reloads)", why, client.url)
        return False

    def explain(self, reason: str, detail: str) -> None:
        """Say once why updates are reloaded fully."""
        if detail not in self._explained:
            self._explained.add(detail)
            log.warning("full reload instead of in place (%s): %s", reason, detail)
