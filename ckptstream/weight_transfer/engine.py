"""The inference side of the ckptstream weight-transfer backend: one engine per vLLM worker (every rank).

vLLM makes it in each worker when the server was started with ``--weight-transfer-config
'{"backend": "ckptstream"}'``; its HTTP routes call it on every rank at once:

- ``/init_weight_transfer_engine`` ``{"init_info": {"url": ..., "storage_options": {...}, "cache_dir": ...,
  "prefetch": true}}``: open the stream. Storage credentials never travel in the request (vLLM logs
  requests and RPC arguments): the server's environment gives them, as to any fsspec/AWS client, and
  ``$CKPTSTREAM_HTTP_TOKEN`` to an HTTP stream; a URL's userinfo, a credential-like option or header at
  any depth is refused (``refuse_credentials``). With ``prefetch`` (the default) each worker watches the
  stream and, while the server keeps generating, decodes every new version into the host's shared cache
  and stages its change, so that the update itself is only the apply;
- ``/update_weights`` ``{"update_info": {"version": 17}}`` (or ``"latest"``): the version is decoded and
  checked (every tensor's hash) into the host's cache, shared by the ranks of the host (one decodes, the
  others wait for it), the change from the served version is applied in place on every rank where every
  rank can (``vllm_loader/apply.py``), else the version is reloaded on every rank. The ranks agree at
  each step (a gather over vLLM's CPU process group): a version one rank cannot read is refused on every
  rank before any weight is touched; an apply refused by one rank is replaced by a full reload on all;
  a reload that fails on one rank takes every rank back to the served version's files. The request then
  fails with the reason, and the server serves the last good version;
- ``/finish_weight_update`` with ``weight_version``: vLLM labels the version (the trainer side passes it).

The lifecycle methods run inside vLLM's engine loop, which generates nothing meanwhile: the update is the
pause. Leases (held while a version is decoded) keep gc off what is being read.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch
from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)

from ..credentials import redact
from ..errors import WeightTransferError
from ..format import MARKER_FILE, STREAM_KIND_WEIGHTS
from ..reader import Stream
from ..vllm_loader.inplace.apply import InPlaceApplier
from ..vllm_loader.inplace.checks import staging_problem
from ..vllm_loader.follow.cache import VersionCache, default_cache_dir, safe_owner
from ..vllm_loader.inplace.change import (KEPT_DELTAS_BYTES, MAX_CHANGE_FRACTION, WHOLE, ChangeSummary,
                                          build_change, build_change_from_stored, with_old_values)
from . import refuse_credentials

log = logging.getLogger("ckptstream.weight_transfer")

DEFAULT_POLL_INTERVAL = 0.5
"""Seconds between two looks at the stream's newest version while prefetching."""

T = TypeVar("T")


@dataclass
class CkptstreamInitInfo(WeightTransferInitInfo):
    """``init_info`` of ``/init_weight_transfer_engine``.

    Attributes:
        url: the stream (a path on the server's hosts, ``s3://...``, any URL ckptstream reads).
        storage_options: fsspec/AWS-style options (endpoint, region, ...); credentials come from the
            server's environment, never from here.
        cache_dir: the host's shared cache root (default ``/dev/shm/ckptstream-<uid>`` where it has room).
        prefetch: decode and stage each new version in the background, before it is asked for.
        apply_in_place: write only the changed elements where every rank can (else full reloads).
        poll_interval: seconds between two looks at the stream while prefetching.
    """

    url: str
    storage_options: dict[str, Any] = field(default_factory=dict)
    cache_dir: str | None = None
    prefetch: bool = True
    apply_in_place: bool = True
    poll_interval: float = DEFAULT_POLL_INTERVAL

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url:
            raise ValueError("init_info.url must name the stream (a path or URL)")
        if not isinstance(self.storage_options, dict):
            raise ValueError("init_info.storage_options must be an object")
        refuse_credentials({f.name: getattr(self, f.name) for f in fields(self)}, "init_info")
        if not isinstance(self.poll_interval, (int, float)) or not 0 < self.poll_interval <= 3600:
            raise ValueError("init_info.poll_interval must be a number of seconds in (0, 3600]")


@dataclass
class CkptstreamUpdateInfo(WeightTransferUpdateInfo):
    """``update_info`` of ``/update_weights``: the version to serve (a number or ``"latest"``)."""

    version: int | str = "latest"


@dataclass
class _Prepared:
    """A version ready to be applied on this rank: its cached directory, and the change from ``base``
    staged on this rank (None: a full reload)."""

    version: int
    path: Path
    base: int | None
    change: Path | None
    reason: str | None  # why there is no change
    prefetched: bool  # prepared in the background, before it was asked for


class CkptstreamWeightTransferEngine(WeightTransferEngine[CkptstreamInitInfo, CkptstreamUpdateInfo]):
    """Reads versions of a ckptstream stream into this worker's model (see the module docstring)."""

    init_info_cls = CkptstreamInitInfo
    update_info_cls = CkptstreamUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.stream: Stream | None = None
        self.cache: VersionCache | None = None
        self.served: int | None = None
        self.served_path = Path(str(self.model_config.model))
        self.last_update: dict[str, Any] = {}
        self._info: CkptstreamInitInfo | None = None
        self._applier = InPlaceApplier(model, device)
        self._prepared: _Prepared | None = None
        # Why the ranks cannot check a change from the deltas alone (a runtime dtype narrower than the
        # checkpoint's, a tensor held unevenly): its changes are staged with old values from then on.
        self._old_values: str | None = None
        self._lock = threading.Lock()  # the stream, the cache and the applier: the prefetcher or an update
        self._stop = threading.Event()
        self._prefetcher: threading.Thread | None = None

    # ------------------------------------------------------------------------------------ lifecycle

    def init_transfer_engine(self, init_info: CkptstreamInitInfo) -> None:
        """Open the stream and the host's cache; adopt the version the server was started from where its
        model directory is a materialized version of this stream (its marker says so)."""
        self.shutdown()
        try:
            stream = Stream(init_info.url, storage_options=init_info.storage_options)
            stream.require_kind(STREAM_KIND_WEIGHTS)  # adapters are loaded as LoRA adapters, not into the model
            stream_id = stream.info().stream_id
        except Exception as exc:  # noqa: BLE001 - vLLM logs the traceback and answers its text: redacted, unchained
            raise WeightTransferError(f"cannot open the stream {redact(init_info.url)}: {type(exc).__name__}: "
                                      f"{redact(exc)}") from None
        root = init_info.cache_dir or default_cache_dir(_model_bytes(self.model))
        owner = safe_owner(f"{socket.gethostname()}-{os.getpid()}-wt")
        with self._lock:
            self.stream, self._info = stream, init_info
            self.cache = VersionCache(root, stream_id, owner=owner)
            self.served = _marked_version(self.served_path, stream_id)
            self._prepared = None
        log.info("weight transfer from %s (stream %s) on rank %d; serving %s", redact(init_info.url), stream_id,
                 _rank(), "an outside model" if self.served is None else f"version {self.served}")
        if init_info.prefetch:
            self._stop = threading.Event()
            self._prefetcher = threading.Thread(target=self._prefetch_loop, args=(self._stop,),
                                                name="ckptstream-prefetch", daemon=True)
            self._prefetcher.start()

    def start_weight_update(self) -> None:
        """Nothing to prepare: the version is named by ``update_weights``."""
        self._stream()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """``/update_weights`` on this rank: parse, then ``receive_weights`` (vLLM's default also synchronizes
        an accelerator, which a CPU worker has none of; the in-place apply synchronizes its own writes)."""
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: CkptstreamUpdateInfo) -> None:
        """Serve ``update_info.version`` on every rank, or raise with every rank on its last good version."""
        stream = self._stream()
        with self._lock:
            # "latest" may move between two ranks' looks: rank 0's answer is every rank's
            version = self._agree(lambda: stream.resolve(update_info.version),
                                  f"cannot update to {update_info.version!r}")[0]
            if version == self.served:
                self.last_update = {"version": version, "mode": "unchanged"}
                return
            started = time.perf_counter()
            prepared = self._agree(lambda: self._prepare(version), f"version {version} could not be read")[_rank()]
            mode, reason = self._apply(prepared)
            self.served, self.served_path, self._prepared = version, prepared.path, None
            assert self.cache is not None
            self.cache.prune({version})
            self.last_update = {"version": version, "mode": mode, "fallback": reason,
                                "prefetched": prepared.prefetched,
                                "seconds": round(time.perf_counter() - started, 4)}
            log.info("version %d served (%s%s) in %.3f s", version, mode, f": {reason}" if reason else "",
                     self.last_update["seconds"])

    def finish_weight_update(self) -> None:
        """Nothing to finalize: ``update_weights`` left the model complete (vLLM labels the version)."""

    def shutdown(self) -> None:
        """Stop prefetching and release the cached versions this rank held."""
        self._stop.set()
        if self._prefetcher is not None:
            self._prefetcher.join()
            self._prefetcher = None
        with self._lock:
            self._applier.discard()
            if self.cache is not None:
                self.cache.close()
            self.stream, self.cache, self._prepared = None, None, None

    # -------------------------------------------------------------------------------------- private

    def _stream(self) -> Stream:
        if self.stream is None:
            raise WeightTransferError("the ckptstream weight transfer is not initialized",
                                      hint="POST /init_weight_transfer_engine with the stream's url first")
        return self.stream

    def _prepare(self, version: int, prefetching: bool = False) -> _Prepared:
        """``version`` decoded in the cache and its change staged here (reused from the prefetcher)."""
        prepared = self._prepared
        if prepared is not None and (prepared.version, prepared.base) == (version, self.served):
            return prepared
        assert self.stream is not None and self.cache is not None and self._info is not None
        keep = {self.served} - {None}
        # The deltas the decode reads are kept for the change built from them next: each is read once.
        keeping = (self.stream.keeping_reads(KEPT_DELTAS_BYTES) if self._info.apply_in_place
                   else contextlib.nullcontext())
        try:
            with keeping:
                path = self.cache.acquire(self.stream, version, keep=keep,
                                          holder=f"weight transfer {self.cache.owner} rank {_rank()}")[0]
            change, reason = self._change(version, path) if self._info.apply_in_place else (None, "disabled")
            if change is not None and self._old_values is not None:
                change = self._with_old_values(change) or change
        finally:
            self.stream.drop_kept_reads()
        if change is not None:
            self._applier.stage(str(change))
        self._prepared = _Prepared(version, path, self.served, change, reason, prefetching)
        return self._prepared

    def _change(self, version: int, path: Path) -> tuple[Path | None, str | None]:
        """The change from the served version to ``version`` (from the deltas between them where they
        connect: from them alone where they carry change checks; else by comparing the two decoded versions),
        or why there is none."""
        base, base_dir = self.served, self.served_path
        if base is None or not (base_dir / MARKER_FILE).is_file():
            return None, "first_version"
        assert self.stream is not None and self.cache is not None
        stream, stream_id = self.stream, self.stream.info().stream_id
        built: list[ChangeSummary] = []

        def build(out: Path) -> None:
            summary = build_change_from_stored(stream, out, base=base, version=version, base_dir=base_dir,
                                               max_fraction=MAX_CHANGE_FRACTION)
            if summary.problem == WHOLE:  # a keyframe between them: compare the decoded versions
                summary = build_change(base_dir, path, out, stream_id=stream_id, base=base, version=version,
                                       max_fraction=MAX_CHANGE_FRACTION)
            built.append(summary)

        try:
            change = self.cache.change(base, version, build)
        except Exception as exc:  # noqa: BLE001 - e.g. a full disk: the version is reloaded instead
            log.warning("version %d on %d: building the change failed (%s); reloading it fully", version, base,
                        redact(exc))
            return None, "no_change"
        if change is None:
            return None, "large_change" if built and built[0].changed else "no_change"
        return change, None

    def _apply(self, prepared: _Prepared) -> tuple[str, str | None]:
        """Write ``prepared`` on every rank: in place where every rank staged its change, else a full
        reload; (how: ``in_place`` or ``reload``, the fallback reason)."""
        reason = self._gather(lambda: prepared.reason)
        fallback = next((r for r in reason if r is not None), None)
        if fallback is None:
            staged = self._gather(lambda: self._applier.staged(wait=True) or {})
            problem = staging_problem(staged)
            if problem is not None and problem[0] == "unverifiable":
                problem = self._restage_with_old_values(prepared, problem)
            if problem is None:
                applied = self._gather(self._applier.apply)
                if all("applied" in a for a in applied):
                    return "in_place", None
                fallback = "apply_failed"  # a rank wrote nothing: every rank reloads the version
                log.warning("version %d: the in-place apply failed on a rank (%s); reloading it on every rank",
                            prepared.version, next(a["error"] for a in applied if "error" in a))
            else:
                fallback = problem[0]
                log.info("version %d: reloaded fully (%s)", prepared.version, problem[1])
        self._applier.discard()
        self._reload(prepared)
        return "reload", fallback

    def _restage_with_old_values(self, prepared: _Prepared, problem: tuple[str, str]) -> tuple[str, str] | None:
        """Where the ranks cannot check ``prepared``'s change from the deltas alone (``problem``: unverifiable),
        stage the change with old values (built from the served version's cached copy) on every rank instead,
        and from then on: ``staging_problem`` of that, or ``problem`` where a rank could not build it."""

        def restage() -> bool:
            assert prepared.change is not None
            packed = self._with_old_values(prepared.change)
            if packed is None:
                return False
            if packed != prepared.change:
                self._applier.stage(str(packed))
                prepared.change = packed
            return True

        if not all(self._gather(restage)):
            return problem
        if self._old_values is None:
            log.warning("%s; changes are staged with their old values (from the served version's cached copy) "
                        "from now on", problem[1])
        self._old_values = problem[1]
        return staging_problem(self._gather(lambda: self._applier.staged(wait=True) or {}))

    def _with_old_values(self, change: Path) -> Path | None:
        """``change.with_old_values`` of ``change`` on the served version's copy, or None (said why)."""
        assert self.stream is not None
        try:
            return with_old_values(self.stream, self.served_path, change)
        except Exception as exc:  # noqa: BLE001 - e.g. a full disk: the version is reloaded instead
            log.warning("building the change %s with old values failed: %s", change.name, redact(exc))
            return None

    def _reload(self, prepared: _Prepared) -> None:
        """Reload ``prepared`` on every rank; where a rank fails, every rank reloads the served files."""
        from ..vllm_loader.share_reload import reload_model_share

        def reload(path: Path) -> None:  # (each rank reads its share of the files)
            reload_model_share(self.vllm_config, self.model, str(path))

        try:
            self._agree(lambda: reload(prepared.path), f"version {prepared.version} could not be reloaded")
        except WeightTransferError:
            self._agree(lambda: reload(self.served_path),
                        f"the served weights ({self.served_path}) could not be reloaded after a failed update "
                        f"either: restart the server")
            raise

    def _agree(self, step: Callable[[], T], failure: str) -> list[T]:
        """Run ``step`` on this rank; if it failed on any rank, raise on every rank (naming each failure);
        else every rank's result, in rank order."""
        outcome: tuple[bool, Any]
        try:
            outcome = (True, step())
        except Exception as exc:  # noqa: BLE001 - reported on every rank
            outcome = (False, f"rank {_rank()}: {type(exc).__name__}: {redact(exc)}")
        outcomes = self._gather(lambda: outcome)
        failures = [detail for ok, detail in outcomes if not ok]
        if failures:
            serving = "the model it started with" if self.served is None else f"version {self.served}"
            raise WeightTransferError(f"{failure}; every rank serves {serving}: {'; '.join(failures)}")
        return [detail for _, detail in outcomes]

    def _gather(self, value: Callable[[], T]) -> list[T]:
        """``value()`` of every rank of this engine, in rank order."""
        mine = value()
        group = _world_cpu_group()
        if group is None:
            return [mine]
        gathered: list[Any] = [None] * torch.distributed.get_world_size(group)
        torch.distributed.all_gather_object(gathered, mine, group=group)
        return gathered

    def _prefetch_loop(self, stop: threading.Event) -> None:
        """Decode each new version and stage its change while the server generates (one at a time; an
        update waits for the one under way). Failures are logged; the update itself reports them."""
        assert self._info is not None
        interval = self._info.poll_interval
        tried: int | None = None
        while not stop.wait(interval):
            try:
                stream = self.stream
                newest = stream.latest() if stream is not None else None
                if newest is None or newest in (self.served, tried):
                    continue
                tried = newest
                with self._lock:
                    if not stop.is_set() and self.stream is stream and newest != self.served:
                        self._prepare(newest, prefetching=True)
            except Exception as exc:  # noqa: BLE001 - a prefetch is only a head start
                log.warning("prefetching version %s failed: %s", tried, redact(exc))


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _world_cpu_group() -> Any:
    """The CPU (gloo) process group of every rank of this engine, or None for a single rank."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return None
    from vllm.distributed.parallel_state import get_world_group

    return get_world_group().cpu_group


def _marked_version(directory: Path, stream_id: str) -> int | None:
    """The version a materialized directory holds, where its marker names this stream."""
    try:
        marker = json.loads((directory / MARKER_FILE).read_bytes())
    except (OSError, ValueError):
        return None
    if isinstance(marker, dict) and marker.get("stream_id") == stream_id and isinstance(marker.get("version"), int):
        return marker["version"]
    return None


def _model_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())
