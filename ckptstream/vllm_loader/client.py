"""HTTP control of one vLLM server (``VLLM_SERVER_DEV_MODE=1`` routes), every call checked for its effect.

vLLM routes can answer 200 while ignoring what was asked, so each control call is followed by a check:
``/weight_info`` shows the new version, ``/is_paused`` the new state, a one-token generation succeeds.

What differs between vLLM builds is found out once per client, without side effects: vLLM from 0.25 labels
versions itself (``/update_weight_version``, ``/weight_info``); before, the label is kept by ckptstream's
worker extension on every rank (``worker.WorkerExtension``, through ``/collective_rpc``).
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
from typing import Any, Protocol

from ..errors import AdapterRefused, VllmError, VllmUnreachable
from ..httpjson import request_json
from .pause_route import APPLY_IN_PAUSE_PATH
from .worker import (APPLY_METHOD, DISCARD_METHOD, EXTENSION_CLASS, HASHES_METHOD, HOLD_METHOD, LABEL_METHOD,
                     METHODS_METHOD, PREPARE_METHOD, RELOAD_METHOD, REPORT_METHOD, REVERT_METHOD, SET_LABEL_METHOD,
                     STAGE_METHOD, STAGED_METHOD, TRANSFER_STATUS_METHOD)


CANARY_PROMPTS = ([1, 2, 3, 4, 5, 6, 7, 8], [9, 7, 5, 3], [11] * 12)
"""Token-id prompts whose greedy continuations and logprobs ``--verify-apply`` compares before and after a full
reload (small ids: every vocabulary has them)."""
CANARY_TOKENS = 4
_ABSENT = object()  # (``VllmClient._request``'s answer where the server has no such route)
STAGED_POLL_MAX_S = 0.1
"""At most this long between two asks whether the workers have staged a change: a staging's end is seen this much
later at most (each ask a short RPC that holds the engine loop for a moment; the asks start 20 ms apart)."""


class VllmControl(Protocol):
    """What the follower needs of a vLLM server: ``VllmClient`` over HTTP, or a fake in tests
    (``ckptstream.testing.fake_vllm.FakeVllmClient``). Every call raises ``VllmError`` when the server
    refused it or did not do it, ``VllmUnreachable`` when the server does not answer."""

    url: str
    """The server's base URL (also the key of its takeover lock)."""

    def wait_ready(self, timeout: float = 600.0, interval: float = 0.5,
                   abort: threading.Event | None = None) -> None:
        """Return once the server generates a token; ``VllmUnreachable`` after ``timeout`` or on ``abort``."""

    def model_root(self) -> str | None:
        """The directory the server loaded its model from, if it reports one."""

    def weight_version(self) -> str:
        """The label of the weights it serves (``/weight_info``)."""

    def probe(self) -> None:
        """A real one-token generation: the engine can serve."""

    def pause(self, mode: str = "keep") -> None:
        """Pause generation (``keep``: in-flight requests wait) and check that it is paused."""

    def resume(self, check: bool = True) -> None:
        """Resume generation; ``check=False`` leaves ``check_resumed`` to the caller, outside the pause."""

    def check_resumed(self) -> None:
        """Raise unless the server generates again."""

    def reload_weights(self, path: str) -> None:
        """Reload every weight from the complete materialized directory ``path`` on every worker."""

    def reset_prefix_cache(self) -> None:
        """Drop cached prefixes computed with the previous weights."""

    def set_weight_version(self, version: str, check: bool = True) -> None:
        """Label the served weights; ``check=False`` leaves ``check_weight_version`` to the caller."""

    def check_weight_version(self, version: str) -> None:
        """Raise unless ``weight_version()`` is ``version``."""

    def prepare_in_place(self, path: str) -> list[Any] | None:
        """Have every worker trace the weight loaders of the checkpoint directory ``path`` in the background while
        the engine generates, so that the first change stages without it; per rank ``InPlaceApplier.prepare``'s
        answer (``True`` from an older extension); None where the server has no such call (or no extension)."""

    def stage_change(self, path: str) -> list[dict[str, Any]]:
        """Have every worker map the change file ``path`` onto its parameters while the engine generates;
        per rank: ``unpatchable`` ({tensor: reason}), ``elements`` staged, or ``error``."""

    def apply_change(self) -> list[dict[str, Any]]:
        """Inside the pause: every worker writes its staged change; per rank ``applied`` or ``error``."""

    def apply_in_pause(self, mode: str, label: str) -> dict[str, Any] | None:
        """Pause (``mode``; the prefix cache reset), apply the staged change on every rank, label, resume: one call
        (``pause_route``'s answer; not ``resumed``: the server may be paused), None where the server lacks it."""

    def discard_change(self) -> None:
        """Drop a staged change."""

    def revert_change(self) -> list[dict[str, Any]]:
        """Inside the pause, after an apply that failed on some rank: every worker writes back the old values
        of what it applied; per rank ``reverted`` or ``error``."""

    def parameter_hashes(self) -> list[dict[str, str]]:
        """Per rank: the hash of every runtime parameter."""

    def canary(self) -> list[dict[str, Any]]:
        """What the model computes for ``CANARY_PROMPTS``, each sent alone: per prompt its greedy ``token_ids``
        and their ``logprobs`` (None where the server gives none)."""

    def cache_report(self, versions_dir: str, request: int | None = None) -> list[dict[str, Any]]:
        """Per rank of the engine (every node): host, node rank, rank, the complete versions under
        ``versions_dir`` on that rank's node with their manifest hashes and the change files there
        (``worker.WorkerExtension``); ``request``: a version each node lacking it is asked to prepare."""

    def hold_served(self, versions_dir: str | None = None, version: int | None = None) -> list[dict[str, Any]]:
        """Every rank holds the version it serves on its node: ``version`` of the cache at ``versions_dir``
        (``cache.hold_served_version``), else the cached directory it last reloaded (``cache.hold_served``);
        per rank: host, node rank, rank and that version."""


class AdapterControl(Protocol):
    """What ``adapters.ResidentAdapters`` needs of a vLLM server serving LoRA adapters (``VllmClient``): vLLM's
    runtime adapter routes (``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``, ``--enable-lora``) and its count of
    adapters' requests. Refusals raise ``AdapterRefused``, other failures ``VllmError``."""

    url: str

    def load_lora_adapter(self, name: str, path: str) -> None:
        """Load the PEFT directory ``path`` under the new adapter name ``name``."""

    def unload_lora_adapter(self, name: str) -> None:
        """Forget the adapter name ``name``."""

    def lora_adapters(self) -> dict[str, str]:
        """The adapter names the server holds, each with the directory it loaded."""

    def lora_in_use(self) -> set[str]:
        """The adapter names with requests waiting or running."""

    def set_weight_version(self, version: str, check: bool = True) -> None:
        """Label what the server serves (``/weight_info``): the version the stable adapter name means."""

    def max_loras(self) -> int | None:
        """vLLM's ``--max-loras``, where the server tells it."""

    def max_lora_rank(self) -> int | None:
        """vLLM's ``--max-lora-rank``, where the server tells it."""


class VllmClient:
    """Controls one vLLM server over HTTP (a ``VllmControl`` and an ``AdapterControl``).

    Args:
        url: base URL, e.g. ``http://127.0.0.1:8000``.
        api_key: sent as ``Authorization: Bearer`` (vLLM's ``--api-key``).
        timeout: seconds per HTTP request (reloads of large models get ``reload_timeout``).
    """

    def __init__(self, url: str, *, api_key: str | None = None, timeout: float = 30.0,
                 reload_timeout: float = 1800.0):
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout
        self.reload_timeout = reload_timeout
        self._model: str | None = None
        self._native_labels: bool | None = None
        self._extension: bool | None = None
        self._share_reload: bool | None = None
        self._pause_route: bool | None = None

    def _request(self, method: str, path: str, body: Any = None, timeout: float | None = None,
                 absent: bool = False) -> Any:
        """The server's JSON answer; with ``absent``, ``_ABSENT`` where it has no such route (404)."""
        try:
            return request_json(self.url + path, method, body, api_key=self.api_key, timeout=timeout or self.timeout)
        except urllib.error.HTTPError as exc:
            if absent and exc.code == 404:
                return _ABSENT
            detail = exc.read()[:2000].decode("utf-8", "replace")  # vLLM's answer names the cause
            raise VllmError(f"{method} {self.url}{path} answered {exc.code}: {detail}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
            raise VllmUnreachable(f"{method} {self.url}{path} failed: {exc}",
                                  hint="Is the server running, and started with VLLM_SERVER_DEV_MODE=1?") from None

    # ------------------------------------------------------------------------------------------ state

    def healthy(self) -> bool:
        """Liveness only (``/health``); use ``probe`` to know the engine can generate."""
        try:
            self._request("GET", "/health", timeout=5)
            return True
        except VllmError:
            return False

    def wait_ready(self, timeout: float = 600.0, interval: float = 0.5,
                   abort: threading.Event | None = None) -> None:
        """Wait until the server generates one token (or ``abort`` is set, e.g. when its process died)."""
        self._pause_route = None  # (asked again: a server waited for may have been started with other arguments)
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.probe()
                return
            except VllmError as exc:
                if time.monotonic() > deadline or (abort is not None and abort.is_set()):
                    raise VllmUnreachable(f"{self.url} not ready after {timeout:.0f} s ({exc})"
                                          if abort is None or not abort.is_set() else
                                          f"{self.url} went away while starting ({exc})") from None
                time.sleep(interval)

    def model(self) -> str:
        """The served model name (the first of ``/v1/models``)."""
        if self._model is None:
            models = self._request("GET", "/v1/models")
            try:
                self._model = models["data"][0]["id"]
            except (TypeError, KeyError, IndexError):
                raise VllmError(f"{self.url}/v1/models lists no model: {models!r}") from None
        return self._model

    def model_root(self) -> str | None:
        """The path vLLM loaded the model from (``/v1/models`` root), if it reports one."""
        models = self._request("GET", "/v1/models")
        try:
            return models["data"][0].get("root")
        except (TypeError, KeyError, IndexError, AttributeError):
            return None

    def native_labels(self) -> bool:
        """Whether vLLM labels versions itself (``/update_weight_version``: vLLM 0.25 on), found by a GET
        that route refuses (405) where it exists and a router lacking it answers 404; else the worker
        extension keeps the label."""
        if self._native_labels is None:
            try:
                request_json(self.url + "/update_weight_version", "GET", api_key=self.api_key,
                             timeout=self.timeout)
                self._native_labels = True
            except urllib.error.HTTPError as exc:
                if exc.code not in (404, 405):
                    raise VllmError(f"GET {self.url}/update_weight_version answered {exc.code}") from None
                self._native_labels = exc.code == 405
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
                raise VllmUnreachable(f"GET {self.url}/update_weight_version failed: {exc}") from None
        return self._native_labels

    def weight_version(self) -> str:
        """The served version's label: vLLM's own, else the worker extension's (``UNLABELLED`` after a
        start; ``MIXED_LABELS`` where ranks disagree, which no version equals)."""
        if self.native_labels():
            info = self._request("GET", "/weight_info")
            if not isinstance(info, dict) or "weight_version" not in info:
                raise VllmError(f"{self.url}/weight_info answered {info!r}",
                                hint="Start vLLM with VLLM_SERVER_DEV_MODE=1")
            return str(info["weight_version"])
        labels = set(self._extension_call(LABEL_METHOD, {}))
        return labels.pop() if len(labels) == 1 else MIXED_LABELS

    def is_paused(self) -> bool:
        return bool(self._request("GET", "/is_paused").get("is_paused"))

    def complete(self, prompt: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
        """The first choice of a greedy completion of a token-id prompt (``token_ids``, ``logprobs``, ...)."""
        body = {"model": self.model(), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "return_token_ids": True, **extra}
        answer = self._request("POST", "/v1/completions", body, timeout=max(self.timeout, 120))
        try:
            choice = answer["choices"][0]
            choice["token_ids"] = list(choice["token_ids"])
            return choice
        except (TypeError, KeyError, IndexError):
            raise VllmError(f"{self.url}/v1/completions answered without token ids: {str(answer)[:300]}") from None

    def generate(self, prompt: list[int], max_tokens: int) -> list[int]:
        """Greedy token ids for a token-id prompt."""
        return self.complete(prompt, max_tokens)["token_ids"]

    def probe(self) -> None:
        """A real one-token request: liveness is not health."""
        tokens = self.generate([1, 2, 3], 1)
        if len(tokens) != 1:
            raise VllmError(f"{self.url} generated {len(tokens)} tokens for a one-token probe")

    # ---------------------------------------------------------------------------------------- control

    def pause(self, mode: str = "keep") -> None:
        self._request("POST", f"/pause?mode={mode}")
        if not self.is_paused():
            raise VllmError(f"{self.url}/pause answered but the server is not paused")

    def resume(self, check: bool = True) -> None:
        """Resume generation; ``check=False`` leaves the check to the caller (``check_resumed``), to keep
        it out of the pause."""
        self._request("POST", "/resume")
        if check:
            self.check_resumed()

    def check_resumed(self) -> None:
        if self.is_paused():
            raise VllmError(f"{self.url}/resume answered but the server is still paused")

    def has_extension(self) -> bool:
        """Whether the server's workers have ckptstream's worker extension (``--worker-extension-cls``), found
        once per client by a call that reads an attribute (a server without it refuses the method)."""
        if self._extension is None:
            try:
                self._extension_call(LABEL_METHOD, {})
                self._extension = True
            except VllmUnreachable:
                raise
            except VllmError:
                self._extension = False
        return self._extension

    def _has_method(self, method: str) -> bool:
        """Whether every rank's worker extension has ``method`` (an older ckptstream's lacks the newer ones)."""
        try:
            return all(method in (methods or ()) for methods in self._extension_call(METHODS_METHOD, {}))
        except VllmUnreachable:
            raise
        except VllmError:
            return False

    def reload_weights(self, path: str) -> None:
        """Reload every weight from the complete checkpoint directory ``path`` on every worker: where the server
        has ckptstream's worker extension, each rank reads only its share of the files (``share_reload``), else
        vLLM's own reload runs (``vllm_reload_weights``: every rank reads every file)."""
        if self._share_reload is None:  # (an extension of an older ckptstream lacks the method: probed once)
            self._share_reload = self.has_extension() and self._has_method(RELOAD_METHOD)
        if self._share_reload:
            self._extension_call(RELOAD_METHOD, {"path": str(path)}, timeout=self.reload_timeout)
        else:
            self.vllm_reload_weights(path)

    def vllm_reload_weights(self, path: str) -> None:
        """vLLM's own ``reload_weights`` of a complete checkpoint directory on every worker."""
        answer = self._request("POST", "/collective_rpc",
                               {"method": "reload_weights",
                                "kwargs": {"weights_path": str(path), "is_checkpoint_format": True}},
                               timeout=self.reload_timeout)
        if not isinstance(answer, dict) or "results" not in answer:
            raise VllmError(f"{self.url}/collective_rpc reload_weights answered {answer!r}")

    def reset_prefix_cache(self) -> None:
        self._request("POST", "/reset_prefix_cache")

    # ----------------------------------------------------------------- vLLM's weight-transfer API
    # The four routes of vLLM >= 0.29 (``VLLMWeightSyncClient``'s methods, so a client is one).

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """``/init_weight_transfer_engine``: give the server's weight-transfer backend its ``init_info``."""
        self._request("POST", "/init_weight_transfer_engine", {"init_info": init_info}, timeout=self.reload_timeout)

    def start_weight_update(self) -> None:
        self._request("POST", "/start_weight_update", timeout=self.reload_timeout)

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        """``/update_weights``: every worker receives ``update_info`` (a reload of a large model may take
        ``reload_timeout``)."""
        self._request("POST", "/update_weights", {"update_info": update_info}, timeout=self.reload_timeout)

    def weight_transfer_status(self) -> list[dict[str, Any] | None]:
        """Every rank's last update through ckptstream's weight-transfer backend (``weight_transfer``):
        ``version``, ``mode`` (``in_place``, ``reload``, ``unchanged``), ``fallback``, ``seconds``."""
        return self._extension_call(TRANSFER_STATUS_METHOD, {})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """``/finish_weight_update``, labelling the weights ``weight_version`` where given."""
        self._request("POST", "/finish_weight_update",
                      None if weight_version is None else {"weight_version": weight_version},
                      timeout=self.reload_timeout)

    def cache_report(self, versions_dir: str, request: int | None = None) -> list[dict[str, Any]]:
        """Ask every rank what its node's cache holds (the server must have been started with
        ``--worker-extension-cls ckptstream.vllm_loader.worker.WorkerExtension``)."""
        results = self._extension_call(REPORT_METHOD, {"versions_dir": str(versions_dir),
                                                       **({} if request is None else {"request": int(request)})})
        if not all(isinstance(r, dict) for r in results):
            raise VllmError(f"{self.url}/collective_rpc {REPORT_METHOD} answered {str(results)[:300]}")
        return results

    def hold_served(self, versions_dir: str | None = None, version: int | None = None) -> list[dict[str, Any]]:
        """Have every rank hold the version it serves on its node (the server must have been started with
        ckptstream's worker extension)."""
        named = {} if versions_dir is None or version is None else {"versions_dir": str(versions_dir),
                                                                    "version": int(version)}
        results = self._extension_call(HOLD_METHOD, named)
        if not all(isinstance(r, dict) for r in results):
            raise VllmError(f"{self.url}/collective_rpc {HOLD_METHOD} answered {str(results)[:300]}")
        return results

    def prepare_in_place(self, path: str) -> list[Any] | None:
        # One call, no probe first: each call waits for a step of the engine (the methods are asked only where it
        # failed: an older extension, or none, refuses it, and then there is nothing to prepare).
        try:
            return self._extension_call(PREPARE_METHOD, {"path": str(path)})
        except VllmUnreachable:
            raise
        except VllmError:
            if self._has_method(PREPARE_METHOD):
                raise  # (it failed there: asked again after the next full reload)
            return None

    def stage_change(self, path: str, poll_interval: float = 0.02) -> list[dict[str, Any]]:
        """Stage the change in the background on every rank, then poll (each poll a short RPC, so the engine
        keeps generating between them) until every rank is done."""
        self._extension_call(STAGE_METHOD, {"path": str(path)})
        deadline = time.monotonic() + self.reload_timeout
        while True:
            results = self._extension_call(STAGED_METHOD, {"wait": False})
            if all(isinstance(r, dict) for r in results):
                return results
            if time.monotonic() > deadline:
                raise VllmError(f"{self.url}: staging {path} did not end within {self.reload_timeout:.0f} s")
            time.sleep(poll_interval)
            poll_interval = min(poll_interval * 1.5, STAGED_POLL_MAX_S)

    def apply_change(self) -> list[dict[str, Any]]:
        return self._extension_call(APPLY_METHOD, {}, timeout=self.reload_timeout)

    def apply_in_pause(self, mode: str, label: str) -> dict[str, Any] | None:
        """``APPLY_IN_PAUSE_PATH`` (vLLM's ``--middleware``); after a 404, asked again only after ``wait_ready``."""
        if self._pause_route is False:
            return None
        body = {"mode": mode, "label": label, "native_label": self.native_labels(),
                "within_s": self.reload_timeout / 2}  # (after that, the server stays paused: this call gave up)
        answer = self._request("POST", APPLY_IN_PAUSE_PATH, body, timeout=self.reload_timeout, absent=True)
        self._pause_route = answer is not _ABSENT
        if answer is not _ABSENT and not (isinstance(answer, dict) and isinstance(answer.get("results"), list)):
            raise VllmError(f"{self.url}{APPLY_IN_PAUSE_PATH} answered {str(answer)[:300]}")
        return answer if answer is not _ABSENT else None

    def discard_change(self) -> None:
        self._extension_call(DISCARD_METHOD, {})

    def revert_change(self) -> list[dict[str, Any]]:
        return self._extension_call(REVERT_METHOD, {}, timeout=self.reload_timeout)

    def parameter_hashes(self) -> list[dict[str, str]]:
        return self._extension_call(HASHES_METHOD, {}, timeout=self.reload_timeout)


    def canary(self) -> list[dict[str, Any]]:
        answers = []
        for prompt in CANARY_PROMPTS:
            try:
                # (token ids in the logprobs: a server started with --skip-tokenizer-init has no tokenizer)
                choice = self.complete(prompt, CANARY_TOKENS, logprobs=0, return_tokens_as_token_ids=True)
                logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
            except VllmUnreachable:
                raise
            except VllmError:  # a server that cannot give logprobs (a build without them): the tokens alone
                choice, logprobs = self.complete(prompt, CANARY_TOKENS), None
            answers.append({"token_ids": choice["token_ids"], "logprobs": logprobs})
        return answers

    def _extension_call(self, method: str, kwargs: dict[str, Any], timeout: float | None = None) -> list[Any]:
        """Call a method of ckptstream's worker extension on every rank; its results, one per rank."""
        try:
            answer = self._request("POST", "/collective_rpc", {"method": method, "kwargs": kwargs}, timeout=timeout)
        except VllmUnreachable:
            raise
        except VllmError as exc:
            raise VllmError(f"{exc} (calling ckptstream's worker extension)", hint=_EXTENSION_HINT) from None
        results = answer.get("results") if isinstance(answer, dict) else None
        if not isinstance(results, list) or not results:
            raise VllmError(f"{self.url}/collective_rpc {method} answered {str(answer)[:300]}", hint=_EXTENSION_HINT)
        return results

    def set_weight_version(self, version: str, check: bool = True) -> None:
        """Label the served weights; ``check=False`` leaves the check to the caller (``check_weight_version``)."""
        if self.native_labels():
            self._request("POST", "/update_weight_version", {"new_version": version})
        else:
            self._extension_call(SET_LABEL_METHOD, {"label": version})
        if check:
            self.check_weight_version(version)

    def check_weight_version(self, version: str) -> None:
        served = self.weight_version()
        if served != version:
            raise VllmError(f"{self.url} was labelled {version} but reports {served}")

    # ---------------------------------------------------------------------------------- LoRA adapters

    def load_lora_adapter(self, name: str, path: str) -> None:
        """vLLM's ``/v1/load_lora_adapter``: its engine reads the PEFT directory ``path`` and serves it as the
        model ``name`` (a name it holds is refused: vLLM's ``load_inplace`` is never used, see
        ``ckptstream.lora_aliases``); checked in ``/v1/models``."""
        self._adapter_call("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)}, name, str(path))
        if self.lora_adapters().get(name) != str(path):
            raise VllmError(f"{self.url}/v1/load_lora_adapter answered but /v1/models lists no {name} from {path}")

    def unload_lora_adapter(self, name: str) -> None:
        """vLLM's ``/v1/unload_lora_adapter``: new requests for ``name`` are refused; running ones finish
        (vLLM forgets the name only: its engine keeps the weights in its cache, and reads the directory
        again if a running request needs them after the cache dropped them). Checked in ``/v1/models``."""
        self._adapter_call("/v1/unload_lora_adapter", {"lora_name": name}, name, None)
        if name in self.lora_adapters():
            raise VllmError(f"{self.url}/v1/unload_lora_adapter answered but /v1/models still lists {name}")

    def lora_adapters(self) -> dict[str, str]:
        """The adapters the server holds (the ``/v1/models`` entries with a parent): name -> directory."""
        models = self._request("GET", "/v1/models")
        try:
            return {m["id"]: m["root"] for m in models["data"] if m.get("parent") is not None}
        except (TypeError, KeyError, AttributeError):
            raise VllmError(f"{self.url}/v1/models answered {str(models)[:300]}") from None

    def lora_in_use(self) -> set[str]:
        """The adapter names with requests waiting or running, from vLLM's ``vllm:lora_requests_info`` gauge
        (``lora_names_in_use``). A request counts from the moment vLLM's engine queued it, which is after
        it took its adapter: a request on a name unloaded just before may still start."""
        return lora_names_in_use(self._request("GET", "/metrics"), self.url)

    def max_loras(self) -> int | None:
        """vLLM's ``--max-loras`` (adapters in one batch), from the dev-mode ``/server_info``; None where the
        server does not tell (no ``VLLM_SERVER_DEV_MODE=1``, no ``--enable-lora``, another build)."""
        return self._lora_setting("max_loras")

    def max_lora_rank(self) -> int | None:
        """vLLM's ``--max-lora-rank``, from the dev-mode ``/server_info``; None where the server does not tell."""
        return self._lora_setting("max_lora_rank")

    def _lora_setting(self, key: str) -> int | None:
        """A positive integer of vLLM's LoRA config, from the dev-mode ``/server_info`` (None where not told)."""
        try:
            info = self._request("GET", "/server_info?config_format=json", timeout=max(self.timeout, 120))
        except VllmUnreachable:
            raise
        except VllmError:
            return None
        try:
            value = info["vllm_config"]["lora_config"][key]
        except (TypeError, KeyError):
            return None
        return value if isinstance(value, int) and value > 0 else None

    def _adapter_call(self, path: str, body: dict[str, Any], name: str, directory: str | None) -> None:
        """POST a runtime adapter route; vLLM's refusal becomes ``AdapterRefused`` with vLLM's message."""
        try:
            request_json(self.url + path, "POST", body, api_key=self.api_key, timeout=self.reload_timeout)
        except urllib.error.HTTPError as exc:
            detail = _error_message(exc.read()[:2000].decode("utf-8", "replace"))
            source = f" from {directory}" if directory else ""
            if detail == "Not Found":  # FastAPI's answer for a route that is not there
                raise AdapterRefused(f"{self.url} has no {path}", adapter=name, path=directory, status=exc.code,
                                     hint=_RUNTIME_LORA_HINT) from None
            raise AdapterRefused(f"{self.url} refused adapter {name}{source} ({exc.code}): {detail}",
                                 adapter=name, path=directory, status=exc.code) from None
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
            raise VllmUnreachable(f"POST {self.url}{path} failed: {exc}") from None


def lora_names_in_use(metrics: Any, url: str = "vLLM") -> set[str]:
    """The adapter names with requests waiting or running in vLLM's Prometheus text ``metrics``.

    vLLM (0.32) sets one series of ``vllm:lora_requests_info`` to the current time at each step it reports,
    its labels ``running_lora_adapters`` and ``waiting_lora_adapters`` each naming (comma-separated) every
    adapter with requests waiting or running (``v1/metrics/loggers.py:1224-1235``,
    ``v1/metrics/stats.py:697-700``); earlier label sets stay as older series: the newest series is the
    state now. No series: no adapter request yet."""
    text = metrics if isinstance(metrics, str) else ""
    if f"# TYPE {LORA_REQUESTS_METRIC} gauge" not in text:
        raise VllmError(f"{url}/metrics has no {LORA_REQUESTS_METRIC}: which adapters are in use is unknown",
                        hint="Start vLLM with --enable-lora and without --disable-log-stats")
    newest: tuple[float, set[str]] | None = None
    for line in text.splitlines():
        if not line.startswith(LORA_REQUESTS_METRIC + "{"):
            continue
        labels_text, _, value = line[len(LORA_REQUESTS_METRIC) + 1:].rpartition("}")
        labels = {key: _PROMETHEUS_ESCAPE.sub(lambda m: "\n" if m.group(1) == "n" else m.group(1), raw)
                  for key, raw in _PROMETHEUS_LABEL.findall(labels_text)}
        names = {n for key in ("running_lora_adapters", "waiting_lora_adapters")
                 for n in labels.get(key, "").split(",") if n}
        stamp = float(value.split()[0])
        if newest is None or stamp > newest[0]:
            newest = (stamp, names)
    return set() if newest is None else newest[1]


def _error_message(body: str) -> str:
    """vLLM's error message in an error answer (``{"error": {"message": ...}}``, FastAPI's ``{"detail": ...}``)."""
    try:
        answer = json.loads(body)
        return str(answer["error"]["message"] if "error" in answer else answer["detail"])
    except (ValueError, TypeError, KeyError):
        return body.strip()


LORA_REQUESTS_METRIC = "vllm:lora_requests_info"
_PROMETHEUS_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_PROMETHEUS_ESCAPE = re.compile(r"\\(.)")  # a label value's \\, \" and \n
_RUNTIME_LORA_HINT = ("Start vLLM with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True in its environment "
                      "(ckptstream serve passes both for an adapter stream)")

MIXED_LABELS = "mixed"
"""``weight_version()`` of an engine whose ranks are labelled differently."""
_EXTENSION_HINT = (f"This vLLM has no /update_weight_version (before 0.25): start it with VLLM_SERVER_DEV_MODE=1 "
                   f"and --worker-extension-cls {EXTENSION_CLASS} (ckptstream serve passes both)")
