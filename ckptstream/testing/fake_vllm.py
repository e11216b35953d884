"""A fake vLLM server control (``VllmControl``) for fast tests of follower choreography.

``FakeVllmClient`` keeps the state a real server would (weight version label, loaded directory, paused),
records every call, and can be told to fail: the paths a real failing reload cannot safely produce
(a reload that fails half-way, a server that goes away) run in milliseconds. Tests that prove the
behaviour end to end use real vLLM servers beside these.

Example::

    server = FakeVllmClient()
    follower = Follower(url, [server], cache_dir=tmp)
    server.fail("reload_weights", VllmError("boom"))      # the next reload fails
    follower.step()
    assert server.calls_of("reload_weights") == [...]

An engine spanning nodes is a ``FakeVllmClient`` with ``nodes``: each ``FakeNode`` sees the paths under
the head's cache root in a directory of its own (its "local disk"), answers ``cache_report`` and
``hold_served`` with the real worker extension's code (its model path repointed by each reload, as vLLM's),
and a reload fails (half-way, as in vLLM) when any node lacks the path. With ``in_place``, its nodes also
hold the tensors they loaded and stage and apply change files (``change.py``) read on their own node, as the
worker extension does: every old value checked before anything is written on that node.
"""

from __future__ import annotations

import collections
import json
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

from ..errors import AdapterRefused, VllmError, VllmUnreachable
from ..format import MARKER_FILE
from ..vllm_loader.worker import WorkerExtension, staged_hold


@dataclass
class FakeNode:
    """One node of a fake multi-node engine: paths under ``shared`` are read under ``local`` instead
    (the same absolute path, another machine's disk); ``shared=None`` reads every path as it is (the head)."""

    node_rank: int
    host: str
    shared: str | None = None
    local: str | None = None
    loaded_version: int | None = None  # None also after a reload that failed half-way on this node
    model: str | None = None  # where its workers last loaded the model from, as this node sees it
    worker: WorkerExtension = field(init=False, repr=False)  # its workers' extension (one rank)
    weights: dict[str, Any] = field(default_factory=dict, repr=False)  # with ``in_place``: what it serves
    staged: Any = field(default=None, repr=False)  # with ``in_place``: (version, [(name, positions, old, new)])
    applied: Any = field(default=None, repr=False)  # with ``in_place``: (version before, what the last apply wrote)

    def __post_init__(self) -> None:
        self.worker = _NodeWorker(self)

    def sees(self, path: str) -> str:
        """Where this node reads ``path``."""
        if self.shared is None or self.local is None:
            return path
        shared = str(Path(self.shared).absolute())
        absolute = str(Path(path).absolute())
        if absolute == shared or absolute.startswith(shared + "/"):
            return self.local + absolute[len(shared):]
        return path


class _NodeWorker(WorkerExtension):
    """The worker extension as vLLM mixes it into a worker of a fake node: its model path is the node's."""

    def __init__(self, node: FakeNode):
        self._node = node

    @property
    def vllm_config(self) -> Any:
        return SimpleNamespace(model_config=SimpleNamespace(model=self._node.model),
                               parallel_config=SimpleNamespace(node_rank=self._node.node_rank))


@dataclass
class FakeVllmClient:
    """A ``VllmControl`` with no server behind it.

    Attributes:
        url: a unique fake URL (the key of takeover locks).
        weight_version_label: what ``/weight_info`` would answer (``"default"`` at start, like vLLM).
        loaded: the directory of the last successful reload (None: the model it was started with).
        loaded_version: the version named by that directory's marker file.
        root: what ``/v1/models`` would report as the model's root.
        calls: the last ``max_calls`` calls, in order, as ``(method, argument or None)``.
        reloaded: the versions of the last ``max_calls`` successful reloads, in order.
        up: False makes every call raise ``VllmUnreachable`` (a dead server).
        nodes: the nodes of an engine spanning several (empty: one node, no worker extension).
        on_call: called with ``(method, argument)`` as each call arrives (a test's step at an exact point).
        in_place: its nodes stage and apply changes (``FakeNode.weights``) instead of refusing them.
        pause_route: it answers ``apply_in_pause`` (vLLM started with ckptstream's ``--middleware``), else None.
    """

    url: str = field(default_factory=lambda: f"http://fake-{uuid.uuid4().hex[:8]}:1")
    weight_version_label: str = "default"
    loaded: str | None = None
    loaded_version: int | None = None
    root: str | None = None
    paused: bool = False
    up: bool = True
    nodes: list[FakeNode] = field(default_factory=list)
    on_call: Callable[[str, Any], None] | None = None
    in_place: bool = False
    pause_route: bool = False
    max_calls: int = 10_000
    calls: collections.deque[tuple[str, Any]] = field(init=False)
    reloaded: collections.deque[int] = field(init=False)
    _failures: dict[str, list[Exception]] = field(default_factory=dict, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        self.calls = collections.deque(maxlen=self.max_calls)
        self.reloaded = collections.deque(maxlen=self.max_calls)

    def fail(self, method: str, error: Exception, times: int = 1) -> None:
        """Make the next ``times`` calls of ``method`` raise ``error`` (after recording the call)."""
        self._failures.setdefault(method, []).extend([error] * times)

    def calls_of(self, method: str) -> list[Any]:
        """The arguments of every recorded call of ``method``."""
        return [argument for name, argument in self.calls if name == method]

    def _call(self, method: str, argument: Any = None) -> None:
        with self._lock:
            self.calls.append((method, argument))
            pending = self._failures.get(method)
            error = pending.pop(0) if pending else None
        if self.on_call is not None:
            self.on_call(method, argument)
        if not self.up:
            raise VllmUnreachable(f"{self.url} does not answer (fake server down)")
        if error is not None:
            raise error

    # ------------------------------------------------------------------------------------------ state

    def wait_ready(self, timeout: float = 600.0, interval: float = 0.5,
                   abort: threading.Event | None = None) -> None:
        self._call("wait_ready")

    def model_root(self) -> str | None:
        self._call("model_root")
        return self.root

    def weight_version(self) -> str:
        self._call("weight_version")
        return self.weight_version_label

    def probe(self) -> None:
        self._call("probe")

    # ---------------------------------------------------------------------------------------- control

    def pause(self, mode: str = "keep") -> None:
        self._call("pause", mode)
        self.paused = True

    def resume(self, check: bool = True) -> None:
        self._call("resume")
        self.paused = False

    def check_resumed(self) -> None:
        self._call("check_resumed")
        if self.paused:
            raise VllmError(f"{self.url} is still paused")

    def reload_weights(self, path: str) -> None:
        """Like vLLM: a directory that does not exist is refused; a complete one is loaded."""
        self._call("reload_weights", path)
        missing = [node for node in self.nodes if not (Path(node.sees(path)) / MARKER_FILE).is_file()]
        if self.nodes:
            for node in self.nodes:  # a rank that lacks it fails half-way; the others load it
                node.model = node.sees(path)  # (vLLM repoints the model's path before loading)
                node.loaded_version = None if node in missing else \
                    int(json.loads((Path(node.sees(path)) / MARKER_FILE).read_text())["version"])
                if self.in_place:
                    node.weights = {} if node in missing else _load_tensors(Path(node.sees(path)))
            if missing:
                self.loaded = self.loaded_version = None
                raise VllmError(f"{self.url}/collective_rpc reload_weights answered 500: node "
                                f"{missing[0].node_rank} has no {path}")
        marker = Path(path) / MARKER_FILE
        if not marker.is_file():
            raise VllmError(f"{self.url}: {path} is not a model directory")
        self.loaded = path
        self.loaded_version = int(json.loads(marker.read_text())["version"])
        self.reloaded.append(self.loaded_version)

    def restart(self) -> None:
        """The engine restarts: unlabelled, every rank forgets what it loaded and (its process gone) stops holding
        the version it served."""
        from ..locks import unlock

        self.weight_version_label, self.loaded, self.loaded_version = "default", None, None
        for node in self.nodes:
            node.loaded_version, node.weights, node.staged, node.applied = None, {}, None, None
            held = getattr(node.worker, "_ckptstream_served", None)
            if held is not None:
                unlock(held[1])
            node.worker._ckptstream_served = None
            staged_hold(node.worker, None)

    def reset_prefix_cache(self) -> None:
        self._call("reset_prefix_cache")

    def cache_report(self, versions_dir: str, request: int | None = None) -> list[dict[str, Any]]:
        """One report per node (one rank each), made by the real worker extension's code."""
        self._call("cache_report", versions_dir)
        if not self.nodes:
            raise VllmError(f"{self.url} has no ckptstream worker extension (a fake without nodes)")
        reports = []
        for rank, node in enumerate(self.nodes):
            report = WorkerExtension().ckptstream_cache_report(node.sees(versions_dir), request)
            reports.append({**report, "host": node.host, "node_rank": node.node_rank, "rank": rank})
        return reports

    def hold_served(self, versions_dir: str | None = None, version: int | None = None) -> list[dict[str, Any]]:
        """One answer per node (one rank each), made by the real worker extension's code."""
        self._call("hold_served", version)
        if not self.nodes:
            raise VllmError(f"{self.url} has no ckptstream worker extension (a fake without nodes)")
        return [{**node.worker.ckptstream_hold_served(None if versions_dir is None else node.sees(versions_dir),
                                                      version),
                 "host": node.host, "node_rank": node.node_rank, "rank": rank}
                for rank, node in enumerate(self.nodes)]

    def prepare_in_place(self, path: str) -> list[Any] | None:
        """As an older worker extension answers (``True`` per rank: nothing said of the trace), where ``in_place``."""
        self._call("prepare_in_place", path)
        return [True] * max(1, len(self.nodes)) if self.in_place else None

    def stage_change(self, path: str) -> list[dict[str, Any]]:
        """With ``in_place``: each node reads the change file at ``path`` on its own disk (an error where it
        lacks it), as a worker stages it; else refused."""
        self._call("stage_change", path)
        if not (self.in_place and self.nodes):
            raise VllmError(f"{self.url} holds no parameters to patch (a fake server): it reloads whole versions")
        for node in self.nodes:  # the version it leads to held on each node, as a worker does
            staged_hold(node.worker, node.sees(path))
        return [_stage(node, node.sees(path)) for node in self.nodes]

    def apply_change(self) -> list[dict[str, Any]]:
        """With ``in_place``: each node checks every old value of what it staged against its tensors, then
        writes the new ones (nothing where one differs: ``{"error": ...}``)."""
        self._call("apply_change")
        if not (self.in_place and self.nodes):
            raise VllmError(f"{self.url} has nothing staged (a fake server)")
        return [_apply(node) for node in self.nodes]

    def apply_in_pause(self, mode: str, label: str) -> dict[str, Any] | None:
        """With ``pause_route``: pause, every node's apply (``apply_change``'s), then, where every node applied it,
        label and resume, recorded as one call (``pause_route``'s answer); else None, as a server started without
        ckptstream's ``--middleware`` answers (the follower then takes the calls one by one)."""
        if not self.pause_route:
            return None
        self._call("apply_in_pause", label)
        if not (self.in_place and self.nodes):
            raise VllmError(f"{self.url} has nothing staged (a fake server)")
        self.paused = True
        results = [_apply(node) for node in self.nodes]
        refused = [result for result in results if "error" in result]
        if refused:  # (as the route answers: the server left paused)
            return {"results": results, "resumed": False, "seconds": {},
                    "error": f"a rank did not apply it: {refused[0]}"}
        self.weight_version_label, self.paused = label, False
        return {"results": results, "resumed": True, "seconds": {}}

    def discard_change(self) -> None:
        self._call("discard_change")
        for node in self.nodes:
            node.staged = node.applied = None
            staged_hold(node.worker, None)

    def revert_change(self) -> list[dict[str, Any]]:
        """Each node writes back the old values of what its last apply wrote."""
        self._call("revert_change")
        results = []
        for node in self.nodes:
            before, changed = node.applied or (node.loaded_version, [])
            for name, positions, old, _ in changed:
                node.weights[name].reshape(-1)[positions] = old
            node.applied, node.loaded_version = None, before
            results.append({"reverted": sum(p.numel() for _, p, _, _ in changed)})
        return results

    def parameter_hashes(self) -> list[dict[str, str]]:
        """With ``in_place``: per node, the xxh3-128 of each tensor it holds."""
        self._call("parameter_hashes")
        if not (self.in_place and self.nodes):
            raise VllmError(f"{self.url} holds no parameters (a fake server)")
        import torch

        from ..format import Hasher

        hashes = []
        for node in self.nodes:
            mine = {}
            for name, tensor in node.weights.items():
                hasher = Hasher()
                hasher.update(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
                mine[name] = hasher.digest()
            hashes.append(mine)
        return hashes

    def canary(self) -> list[dict[str, Any]]:
        self._call("canary")
        raise VllmError(f"{self.url} computes nothing (a fake server)")

    def set_weight_version(self, version: str, check: bool = True) -> None:
        self._call("set_weight_version", version)
        self.weight_version_label = version

    def check_weight_version(self, version: str) -> None:
        self._call("check_weight_version", version)
        if self.weight_version_label != version:
            raise VllmError(f"{self.url} shows {self.weight_version_label}, not {version}")


def _load_tensors(directory: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return {name: tensor for file in sorted(directory.glob("*.safetensors"))
            for name, tensor in load_file(file).items()}


def _stage(node: FakeNode, path: str) -> dict[str, Any]:
    """What a worker's ``InPlaceApplier.staged`` answers for the change file ``path`` (read on ``node``)."""
    import torch
    from safetensors import safe_open

    from .. import codec
    from ..vllm_loader.inplace.change import read_change

    node.staged = None
    checks: dict[str, dict[str, Any]] = {}
    try:
        with safe_open(path, framework="pt") as handle:
            version = int((handle.metadata() or {})["version"])
            changed = []
            stepped: dict[str, tuple[torch.Tensor, list[torch.Tensor]]] = {}  # (xor) values so far, positions
            for name, tensor in read_change(handle):
                positions = tensor.positions.clone()
                if tensor.xor is None:
                    changed.append((name, positions, tensor.old.clone(), tensor.new.clone()))
                    continue
                # A change from the deltas alone: the old values are this rank's own (it holds every position),
                # and its check of them is reported, as the worker does; several steps apply in order.
                if name not in stepped:
                    stepped[name] = node.weights[name].reshape(-1).clone(), []
                values, touched = stepped[name]
                old = values[positions].clone()
                ints = codec.INT_OF_SIZE[old.element_size()]
                new = (old.view(ints) ^ tensor.xor.view(ints)).view(old.dtype)
                mixed = f"{codec.check_total(codec.check_positions(positions)):016x}"
                checks[name if tensor.step is None else f"{name}@{tensor.step}"] = {
                    "held": codec.change_check(positions, old, new).to_json(), "held_positions": mixed,
                    "expected": tensor.check.to_json(), "positions": mixed}
                values[positions] = new
                touched.append(positions)
            for name, (values, touched) in stepped.items():
                positions = torch.unique(torch.cat(touched))
                changed.append((name, positions, node.weights[name].reshape(-1)[positions].clone(), values[positions]))
    except Exception as exc:  # noqa: BLE001 - reported per rank, as the worker does
        return {"error": f"{type(exc).__name__}: {exc}"}
    node.staged = (version, changed)
    result = {"unpatchable": {}, "coverage": {name: [p.numel(), p.numel()] for name, p, _, _ in changed},
              "elements": sum(p.numel() for _, p, _, _ in changed)}
    return {**result, "checks": checks} if checks else result


def _apply(node: FakeNode) -> dict[str, Any]:
    from ..codec import bit_pattern

    staged, node.staged, node.applied = node.staged, None, None
    if staged is None:
        return {"error": "nothing staged"}
    version, changed = staged
    for name, positions, old, _ in changed:
        held = node.weights.get(name)
        if held is None or not bool((bit_pattern(held.reshape(-1)[positions]) == bit_pattern(old)).all()):
            return {"error": f"{name}: elements differ from the base version; nothing written"}
    for name, positions, _, new in changed:
        node.weights[name].reshape(-1)[positions] = new
    node.applied, node.loaded_version = (node.loaded_version, changed), version
    return {"applied": sum(p.numel() for _, p, _, _ in changed)}


class FakeLoraServer:
    """A fake vLLM server serving LoRA adapters (an ``AdapterControl``), for fast tests of adapter-follower
    choreography beside the real-server tests: it keeps the adapter names and their directories as vLLM's
    ``/v1/models`` lists them, refuses what vLLM refuses (a name it holds: 400; an unknown name: 404), and can
    be told to refuse the versions in ``refuse`` (a rank above ``--max-lora-rank``, say) or to have no version
    labels (a vLLM before 0.25 without ckptstream's worker extension). ``restart()`` forgets everything."""

    def __init__(self, url: str = "http://fake-lora:8000", *, refuse: set[int] | None = None, labels: bool = True):
        self.url = url
        self.adapters: dict[str, str] = {}
        self.refuse = set(refuse or ())
        self.labels = labels
        self.label: str | None = None
        self.in_use: set[str] = set()  # the adapter names with requests, as vLLM's metrics would say
        self.max_lora_slots: int | None = None  # what max_loras() answers (None: not told)
        self.max_rank: int | None = None  # what max_lora_rank() answers (None: not told)

    def load_lora_adapter(self, name: str, path: str) -> None:
        if name in self.adapters:
            raise AdapterRefused("already loaded", adapter=name, path=path, status=400)
        version = name.rpartition("@")[2]
        if version.isdigit() and int(version) in self.refuse:
            raise AdapterRefused("LoRA rank 64 is greater than max_lora_rank 16", adapter=name, path=path,
                                 status=400)
        self.adapters[name] = str(path)

    def unload_lora_adapter(self, name: str) -> None:
        if name not in self.adapters:
            raise AdapterRefused("not found", adapter=name, path=None, status=404)
        del self.adapters[name]

    def lora_adapters(self) -> dict[str, str]:
        return dict(self.adapters)

    def lora_in_use(self) -> set[str]:
        return set(self.in_use)

    def set_weight_version(self, version: str, check: bool = True) -> None:
        if not self.labels:
            raise VllmError(f"{self.url}/collective_rpc answered 404 (no ckptstream worker extension)")
        self.label = version

    def max_loras(self) -> int | None:
        return self.max_lora_slots

    def max_lora_rank(self) -> int | None:
        return self.max_rank

    def restart(self) -> None:
        self.adapters.clear()
        self.label = None
