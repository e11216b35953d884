"""The ckptstream vLLM worker extension: what each rank of an engine does for the follower.

vLLM mixes the methods of ``--worker-extension-cls ckptstream.vllm_loader.worker.WorkerExtension`` into
every worker of the engine, on every node; ``/collective_rpc`` on the head calls them by name on every rank
and answers ``{"results": [one per rank]}``. They are:

- the cache report: a reload reads ``weights_path`` on each worker's own node, so the head asks this before
  ``reload_weights``: every rank must hold the version, complete, at that path. A collective RPC blocks the
  engine loop while it runs, so the report is cheap: it lists one directory and reads each version's small
  marker file (``ckptstream.json``), never a tensor;
- the cache report also lists the change files of the node's cache (the head stages a change on every rank
  only once each has it), and, asked for a version, leaves a request file for the node's agent where the
  node lacks it (a node that keeps no whole version decodes one on demand: ``cache.py``);
- the served version held: after each update, the head has every rank hold the version it serves, by number,
  on its own node (``cache.hold_served_version``), so that the node's agent keeps it and learns that the
  engine serves it (a failed reload restores it on every rank), without reading or writing the stream; it
  also removes the head's requests there (the load they were for is over);
- the version label, for vLLM builds without ``/update_weight_version`` (before 0.25): kept by the worker, so
  it is gone when the engine restarts, as vLLM's own label is;
- the full reload of a version in which each rank reads only its share of the files (``share_reload``,
  imported on first use: it needs torch and vLLM), where the follower would call vLLM's ``reload_weights``;
- the in-place apply of a change (``apply.py``, imported on first use: it needs torch): stage it in the
  background while the engine generates, poll until staged, apply it inside the pause; and the hash of every
  runtime parameter, to prove a patched model equal to a full reload.

This module imports only the standard library at import time (vLLM imports it in every worker process).
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any

REPORT_METHOD = "ckptstream_cache_report"
"""The name ``/collective_rpc`` calls (``VllmClient.cache_report``)."""
HOLD_METHOD = "ckptstream_hold_served"
"""The name ``/collective_rpc`` calls (``VllmClient.hold_served``)."""
LABEL_METHOD = "ckptstream_label"
SET_LABEL_METHOD = "ckptstream_set_label"
"""The names ``/collective_rpc`` calls for the version label (``VllmClient`` where vLLM has no label routes)."""
TRANSFER_STATUS_METHOD = "ckptstream_weight_transfer_status"
"""The name ``/collective_rpc`` calls for the weight-transfer engine's last update (``weight_transfer``)."""
STAGE_METHOD, STAGED_METHOD, APPLY_METHOD, DISCARD_METHOD, HASHES_METHOD = (
    "ckptstream_stage", "ckptstream_staged", "ckptstream_apply", "ckptstream_discard", "ckptstream_parameter_hashes")
"""The names ``/collective_rpc`` calls for the in-place apply."""
RELOAD_METHOD = "ckptstream_reload_weights"
"""The name ``/collective_rpc`` calls for a full reload reading each rank's share (``VllmClient.reload_weights``)."""
METHODS_METHOD = "ckptstream_methods"
"""The name ``/collective_rpc`` calls for the methods a rank's extension has (an older ckptstream's may lack some)."""
REVERT_METHOD = "ckptstream_revert"
"""The name ``/collective_rpc`` calls to write back what the last apply wrote (``VllmClient.revert_change``)."""
PREPARE_METHOD = "ckptstream_prepare"
"""The name ``/collective_rpc`` calls to trace the loaders before the first change (``VllmClient.prepare_in_place``)."""
EXTENSION_CLASS = "ckptstream.vllm_loader.worker.WorkerExtension"
"""What ``serve`` passes vLLM as ``--worker-extension-cls``."""
UNLABELLED = "default"
"""The label of weights nobody labelled: what vLLM's ``/weight_info`` answers after a start."""


class WorkerExtension:
    """A vLLM worker extension (a mix-in: ``self`` is vLLM's worker)."""

    def ckptstream_set_label(self, label: str) -> str:
        """Label the weights this rank serves (the follower does it after each update, on every rank)."""
        self._ckptstream_label = str(label)
        return self._ckptstream_label

    def ckptstream_label(self) -> str:
        """The label of the weights this rank serves (``UNLABELLED`` since the engine started)."""
        return getattr(self, "_ckptstream_label", UNLABELLED)

    def ckptstream_methods(self) -> list[str]:
        """The ``ckptstream_*`` methods of this extension."""
        return sorted(name for name in dir(type(self)) if name.startswith("ckptstream_"))

    def ckptstream_reload_weights(self, path: str) -> str:
        """vLLM's ``reload_weights`` of the complete checkpoint directory ``path`` on this rank's node, reading
        only this rank's share of its files where this vLLM allows (``"share"``), else every file whole as
        vLLM's own does (``"whole"``)."""
        from .share_reload import reload_share

        applier = getattr(self, "_ckptstream_in_place", None)
        if applier is not None:
            applier.quiesce()  # (no trace of the loaders may run beside vLLM's reload)
        return reload_share(self, path)

    def ckptstream_prepare(self, path: str) -> dict[str, Any]:
        """Start tracing the weight loaders of every tensor of the checkpoint directory ``path`` on this rank's
        node (in a background thread), so that the first change stages without it; once traced, the tensors this
        rank rounds (``InPlaceApplier.prepare``)."""
        return _applier(self).prepare(path)

    def ckptstream_stage(self, path: str) -> bool:
        """Start mapping the change file at ``path`` onto this rank's parameters (in a background thread); hold
        the version it leads to on this node until the update is over (``staged_hold``)."""
        staged_hold(self, path)
        _applier(self).stage(path)
        return True

    def ckptstream_staged(self, wait: bool = False) -> dict[str, Any] | None:
        """The staging's result once done (``unpatchable``, ``elements``, ``error``); None while it runs."""
        return _applier(self).staged(wait)

    def ckptstream_apply(self) -> dict[str, Any]:
        """Write the staged change (``{"applied": n}``), or nothing (``{"error": ...}``)."""
        return _applier(self).apply()

    def ckptstream_revert(self) -> dict[str, Any]:
        """Write back the old values of what the last apply wrote (``{"reverted": n}``, or ``{"error": ...}``)."""
        return _applier(self).revert()

    def ckptstream_discard(self) -> bool:
        staged_hold(self, None)
        _applier(self).discard()
        return True

    def ckptstream_parameter_hashes(self) -> dict[str, str]:
        """xxh3-128 of every runtime parameter of this rank, by name."""
        import torch

        from ..format import Hasher

        hashes = {}
        for name, param in self.model_runner.get_model().named_parameters():
            hasher = Hasher()  # (xxh3-128 of its bytes, on the host)
            data = param.detach().reshape(-1).contiguous().cpu()
            hasher.update(memoryview(data.view(torch.uint8).numpy()) if data.numel() else b"")
            hashes[name] = hasher.digest()
        return hashes

    def ckptstream_weight_transfer_status(self) -> dict[str, Any] | None:
        """The last update of this rank's ckptstream weight-transfer engine (``version``, ``mode``:
        ``in_place``/``reload``/``unchanged``, ``fallback``, ``seconds``), ``{}`` before the first, None
        where the server has no such engine (``--weight-transfer-config`` names another backend or none)."""
        engine = getattr(self, "weight_transfer_engine", None)
        status = getattr(engine, "last_update", None)
        return dict(status) if isinstance(status, dict) else None

    def ckptstream_hold_served(self, versions_dir: str | None = None, version: int | None = None) -> dict[str, Any]:
        """Hold the cached version this rank serves, on its node: ``version`` of the cache at ``versions_dir``
        when given (the head names it: after an update applied in place, the model's path still names the
        version last reloaded; complete on this node or not), else the directory its model was last loaded
        from (vLLM repoints the model's path at every ``reload_weights``); released for the next one held.
        This rank's host, node rank, rank and the version held (null: its model is no cached version)."""
        from ..locks import unlock
        from .follow.cache import hold_served, hold_served_version

        previous = getattr(self, "_ckptstream_served", None)
        if versions_dir is not None and version is not None:
            fd = hold_served_version(versions_dir, int(version))
            self._ckptstream_served = None if fd is None else (int(version), fd)
        else:
            self._ckptstream_served = hold_served(self.vllm_config.model_config.model)
        if previous is not None:
            unlock(previous[1])
        staged_hold(self, None)  # the update is over
        held = self._ckptstream_served
        parallel = getattr(self.vllm_config, "parallel_config", None)
        return {"host": socket.gethostname(), "node_rank": getattr(parallel, "node_rank", None),
                "rank": getattr(self, "rank", None), "version": None if held is None else held[0]}

    def ckptstream_cache_report(self, versions_dir: str, request: int | None = None) -> dict[str, Any]:
        """This rank's host, node rank, rank, the complete versions under ``versions_dir`` (the
        directory holding one ``<12-digit version>/`` directory per cached version, the same path on
        every node) with the manifest hash each one's marker names (null when the marker has none), and the
        change files there (``changes``: their names). With ``request``: a version the head needs complete
        there; where it is not, a request file asks the node's agent for it (``cache.REQUESTS_DIR``)."""
        from ..format import MARKER_FILE, parse_version_name, version_name
        from .follow.cache import CHANGES_DIR, REQUESTS_DIR

        versions: dict[str, str | None] = {}
        try:
            names = os.listdir(versions_dir)
        except OSError:
            names = []
        for name in names:
            version = parse_version_name(name)
            if version is None:
                continue
            try:
                with open(os.path.join(versions_dir, name, MARKER_FILE), "rb") as f:
                    marker = json.loads(f.read(1 << 16))
            except (OSError, ValueError):
                continue  # no marker: incomplete (or being removed)
            if isinstance(marker, dict) and marker.get("version") == version:
                seal = marker.get("manifest_hash")
                versions[str(version)] = seal if isinstance(seal, str) else None
        try:
            changes = sorted(os.listdir(os.path.join(versions_dir, CHANGES_DIR)))
        except OSError:
            changes = []
        if request is not None and str(int(request)) not in versions and os.path.isdir(versions_dir):
            # (a file's name only: the agent checks the version against the stream before decoding it)
            os.makedirs(os.path.join(versions_dir, REQUESTS_DIR), mode=0o700, exist_ok=True)
            with open(os.path.join(versions_dir, REQUESTS_DIR, version_name(int(request))), "ab"):
                pass
        parallel = getattr(getattr(self, "vllm_config", None), "parallel_config", None)
        return {"host": socket.gethostname(), "node_rank": getattr(parallel, "node_rank", None),
                "rank": getattr(self, "rank", None), "local_rank": getattr(self, "local_rank", None),
                "pid": os.getpid(), "versions": versions, "changes": changes}


def staged_hold(worker: Any, change: str | None) -> None:
    """Have ``worker`` hold the version the change file ``change`` leads to on its node (``cache.hold_staged``:
    the node's agent keeps it while the head applies it), or, with None, release what it held so (on a one-node
    server, nobody releases it until the next change: a lock nothing waits on)."""
    from ..locks import unlock
    from .follow.cache import hold_staged

    previous = getattr(worker, "_ckptstream_staged", None)
    worker._ckptstream_staged = None if change is None else hold_staged(change)
    if previous is not None:
        unlock(previous)


def _applier(worker: Any) -> Any:
    """The worker's ``apply.InPlaceApplier``, made on first use (a function, not a method: vLLM offers every
    method of the extension to ``/collective_rpc``)."""
    applier = getattr(worker, "_ckptstream_in_place", None)
    if applier is None:
        from .inplace.apply import InPlaceApplier

        model = worker.model_runner.get_model()
        applier = worker._ckptstream_in_place = InPlaceApplier(model, next(model.parameters()).device)
    return applier


CacheReport = WorkerExtension
"""The extension's name before it labelled versions: command lines naming it keep working."""
