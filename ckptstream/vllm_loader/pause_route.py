"""One route inside vLLM's API server that applies a staged change in a single call: pause (which resets the prefix
cache), every rank's apply, label, resume.

Over vLLM's own routes that sequence is five HTTP round trips to the API server while the engine is paused (and
a check that it paused), and vLLM's ``/pause`` route adds a 20 ms sleep of its own after pausing
(``AsyncLLM.pause_generation``: "not required for correctness"). Here each step is a call to the engine core from
inside the API server, and the pause is what the apply needs. vLLM adds the route with
``--middleware ckptstream.vllm_loader.pause_route.PauseRoute`` (``serve`` passes it): a plain ASGI middleware, so
that every other request (a stream of tokens too) passes through it untouched. The follower asks for it, and where a
server answers 404 it takes vLLM's routes one by one (``VllmClient.apply_in_pause``).

It answers only where vLLM serves its dev-mode routes (``VLLM_SERVER_DEV_MODE=1``, which the follower needs anyway:
else 404), and, where the server has an API key (``--api-key``, ``VLLM_API_KEY``), only a request bearing it: vLLM's
own dev routes (``/pause``, ``/collective_rpc``) lie outside its key's ``/v1`` prefix. One engine per server: of a
data-parallel engine, vLLM's ``collective_rpc`` answers the first engine's ranks only (as its ``/collective_rpc``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import time
from typing import Any, Awaitable, Callable

from .worker import APPLY_METHOD, SET_LABEL_METHOD

APPLY_IN_PAUSE_PATH = "/ckptstream/apply_in_pause"
"""POST ``{"mode": vLLM's pause mode, "label": the version it serves after, "native_label": whether vLLM keeps
the label (else the worker extension does), "within_s": seconds the caller waits for the answer}``; answers
``{"results": one per rank (``ckptstream_apply``'s), "resumed": bool, "seconds": {step: seconds}}``, and ``"error"``
naming the step that failed. Not resumed: an apply failed on some rank, a step failed, or the apply ended after
``within_s`` (the caller, given up, reloads the version fully in a pause of its own): the server is left paused
for the caller's full reload."""
MIDDLEWARE = "ckptstream.vllm_loader.pause_route.PauseRoute"
"""What ``serve`` passes vLLM as ``--middleware``."""
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"

Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


class PauseRoute:
    """vLLM's ASGI middleware (``--middleware``): answers ``APPLY_IN_PAUSE_PATH``, passes every other request on."""

    def __init__(self, app: Callable[[dict, Receive, Send], Awaitable[None]]):
        self.app = app

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != APPLY_IN_PAUSE_PATH or os.environ.get(DEV_MODE_ENV) != "1":
            await self.app(scope, receive, send)
            return
        state = scope["app"].state
        if not _authorized(scope, getattr(state, "args", None)):
            await _answer(send, 401, {"error": "Unauthorized"})
        elif scope["method"] != "POST":
            await _answer(send, 405, {"error": f"{APPLY_IN_PAUSE_PATH} takes POST"})
        else:
            body = await _body(receive)
            try:
                asked = json.loads(body)
                mode, label, within_s = str(asked["mode"]), str(asked["label"]), float(asked["within_s"])
                native = asked["native_label"]
                if not isinstance(native, bool):
                    raise TypeError(f"native_label is {native!r}, not true or false")
            except (ValueError, KeyError, TypeError) as exc:
                await _answer(send, 400, {"error": f"{APPLY_IN_PAUSE_PATH} needs a JSON body with mode, label, "
                                                   f"native_label and within_s ({type(exc).__name__}: {exc})"})
                return
            await _answer(send, 200, await apply_in_pause(state.engine_client, mode, label, native, within_s))


async def apply_in_pause(engine: Any, mode: str, label: str, native_label: bool,
                         within_s: float = float("inf")) -> dict[str, Any]:
    """Pause ``engine`` (vLLM's ``EngineClient``), have every rank apply its staged change, then, where every rank
    applied it within ``within_s`` of the call, label the version and resume (``APPLY_IN_PAUSE_PATH``'s answer)."""
    started = last = time.perf_counter()
    seconds: dict[str, float] = {}

    def lap(step: str) -> None:
        nonlocal last
        now = time.perf_counter()
        seconds[step], last = now - last, now

    results: list[Any] = []
    step = "pause"
    try:
        # ``pause_generation``'s steps without its sleep after: the multimodal cache of this API server first (the
        # engine core drops its own: each must forget what the other does), then the engine core's pause. Once idle,
        # that resets the prefix cache (the requests kept running too: recomputed after the resume, with the new
        # weights) and computes nothing until the resume: a reset after the apply would find nothing more to drop,
        # and cost an engine of many KV blocks 20-30 ms of the pause (MLA on an H100).
        renderer = getattr(engine, "renderer", None)
        if renderer is not None:
            await renderer.clear_mm_cache_async()
        await engine.engine_core.pause_scheduler_async(mode=mode, clear_cache=True)
        lap(step)
        step = "apply"
        results = list(await engine.collective_rpc(APPLY_METHOD))
        lap(step)
        failed = [r for r in results if not isinstance(r, dict) or r.get("error")]
        if failed or time.perf_counter() - started > within_s:
            why = (f"a rank did not apply it: {failed[0]}" if failed else
                   f"applied after {time.perf_counter() - started:.1f} s, when the caller had given up")
            return {"results": results, "resumed": False, "seconds": seconds, "error": why}
        step = "label"
        if native_label:
            await engine.update_weight_version(label)
        else:
            await engine.collective_rpc(SET_LABEL_METHOD, kwargs={"label": label})
        lap(step)
        step = "resume"
        await engine.resume_generation()
        lap(step)
    except Exception as exc:  # noqa: BLE001 - answered: the caller reloads fully inside the pause, then resumes
        return {"results": results, "resumed": False, "seconds": seconds,
                "error": f"{step} failed: {type(exc).__name__}: {exc}"}
    return {"results": results, "resumed": True, "seconds": seconds}


def _authorized(scope: dict, args: Any) -> bool:
    """Whether the request bears one of the server's API keys (``--api-key``, else ``VLLM_API_KEY``), where it has
    any."""
    keys = [key for key in (getattr(args, "api_key", None) or [os.environ.get("VLLM_API_KEY")]) if key]  # (a list)
    if not keys:
        return True
    headers = dict(scope.get("headers") or [])
    scheme, _, given = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
    digest = hashlib.sha256(given.encode()).digest()
    return scheme.lower() == "bearer" and any(hmac.compare_digest(digest, hashlib.sha256(key.encode()).digest())
                                              for key in keys)


async def _body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def _answer(send: Send, status: int, answer: dict[str, Any]) -> None:
    body = json.dumps(answer, default=str).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
