"""Client (and optionally owner) of a vLLM router (``pip install vllm-router``): its worker list, changed by
URL and checked after every change.

What vllm-router 0.1.17 does, found by experiment (``GET /workers``, ``POST /workers``, ``DELETE
/workers/{url}``; ``/list_workers``, ``/add_worker?url=``, ``/remove_worker?url=`` are older spellings):

- ``DELETE /workers/{url}`` removes a worker only when ``{url}`` is the worker's URL, percent-encoded
  whole (``/`` and ``:`` too). Anything else it does not know (a worker id, an unknown URL) also answers
  200 "removed successfully" and removes nothing; the URL left unencoded is not a router route at all and
  is proxied to a worker. So every change is followed by reading the worker list.
- ``POST /workers`` waits until the worker answers ``/health`` (up to the router's
  ``--worker-startup-timeout-secs``, checking every ``--worker-startup-check-interval`` seconds); a
  request abandoned meanwhile adds nothing. A URL differing only by a trailing ``/`` is another worker:
  URLs are compared without it.
- The router forwards a client's ``Authorization`` header to the workers; its own ``--api-key`` is for
  data-parallel routing only, and its control routes take no key.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
import urllib.error
import urllib.parse
from pathlib import Path
from typing import Any

from ..errors import RouterError
from ..httpjson import request_json
from ..process import die_with_parent, free_port, stop_process
from .router_launch import ROUTER_API_KEY_ENV

logger = logging.getLogger("ckptstream.router")

START_TIMEOUT = 30.0
"""Seconds ``Router.start`` waits for its router to answer ``/health``."""
CHECK_INTERVAL = 0.1
"""Seconds between reads of the worker list while a change takes effect."""
STARTUP_CHECK_INTERVAL = 1
"""``--worker-startup-check-interval`` of a router that ``Router.start`` starts (vllm-router's default, 30 s,
would make an add wait 30 s after a single failed health check)."""


def normalize(url: str) -> str:
    """A worker URL as the router's list is compared: without a trailing ``/``."""
    return url.rstrip("/")


class Router:
    """A vLLM router: list, add and remove its workers (vLLM servers), each change checked in its list.

    Args:
        url: the router's base URL, e.g. ``http://127.0.0.1:30000``.
        api_key: sent as ``Authorization: Bearer`` (for a router behind an authenticating proxy).
        timeout: seconds per HTTP request, and for a change to show in the worker list.

    Example::

        router = Router.start()                   # or Router("http://127.0.0.1:30000")
        router.add("http://127.0.0.1:8000")       # listed, or RouterError
        router.remove("http://127.0.0.1:8000")    # gone, or RouterError
        router.close()
    """

    def __init__(self, url: str, *, api_key: str | None = None, timeout: float = 10.0):
        self.url = normalize(url)
        self.api_key = api_key
        self.timeout = timeout
        self._process: subprocess.Popen[bytes] | None = None
        self._log: Path | None = None

    @classmethod
    def start(cls, *, host: str = "127.0.0.1", port: int | None = None, policy: str = "round_robin",
              api_key: str | None = None, log: str | os.PathLike[str] | None = None,
              args: list[str] | None = None, timeout: float = 10.0) -> Router:
        """Start ``vllm-router`` (no workers) as a child process that dies with this one; ``close()`` stops it.
        It also dies when the thread that called ``start`` exits (``process.die_with_parent``).

        Args:
            host, port: where it listens (``port`` None: a free one).
            policy: its load-balancing policy (``round_robin``, ``cache_aware``, ``power_of_two``, ...).
            api_key: its ``--api-key`` (sent to the workers; clients' keys are forwarded anyway), passed in its
                environment (``$CKPTSTREAM_ROUTER_API_KEY``), not on its command line.
            log: file for its output (None: discarded).
            args: further ``vllm-router`` options.
            timeout: as for ``Router(...)``.

        Raises:
            RouterError: it exited or did not answer within ``START_TIMEOUT`` seconds.
        """
        port = port or free_port(host)
        # vllm-router's launcher, but the API key in its environment: on its command line every user of the
        # host could read it (router_launch.py)
        command = [sys.executable, "-m", "ckptstream.fleet.router_launch", "--host", host, "--port", str(port),
                   "--policy", policy,
                   # Its metrics port defaults to 29000: a second router on the host would fail to start.
                   "--prometheus-host", host, "--prometheus-port", str(free_port(host)),
                   "--worker-startup-check-interval", str(STARTUP_CHECK_INTERVAL), *(args or [])]
        env = {**os.environ, ROUTER_API_KEY_ENV: api_key} if api_key else None
        router = cls(f"http://{host}:{port}", timeout=timeout)
        out = open(log, "ab") if log is not None else subprocess.DEVNULL
        try:
            router._process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
        finally:
            if log is not None:
                out.close()  # type: ignore[union-attr]
        router._log = Path(log) if log is not None else None
        try:
            router._wait_started()
        except BaseException:
            router.close()
            raise
        log_text = f" (log {router._log})" if router._log else ""
        logger.info("vllm-router started at %s%s", router.url, log_text)
        return router

    def _wait_started(self) -> None:
        assert self._process is not None
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if self._process.poll() is not None:
                raise RouterError(f"vllm-router exited with code {self._process.returncode} while starting",
                                  router=self.url, hint=self._log_hint())
            try:
                self._request("GET", "/health")
                return
            except RouterError:
                if time.monotonic() > deadline:
                    raise RouterError(f"vllm-router does not answer /health after {START_TIMEOUT:.0f} s",
                                      router=self.url, hint=self._log_hint()) from None
                time.sleep(0.2)

    def _log_hint(self) -> str:
        return f"See its output in {self._log}" if self._log else "Start it with log=PATH to see its output"

    def close(self) -> None:
        """Stop the router if ``start`` started it (a router given by URL is left running)."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        stop_process(process, timeout=10)

    def __enter__(self) -> Router:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------- API

    def workers(self) -> list[str]:
        """The URLs in the router's own worker list (as the router spells them)."""
        answer = self._request("GET", "/workers")
        try:
            return [str(w["url"]) for w in answer["workers"]]
        except (TypeError, KeyError):
            raise RouterError(f"GET /workers answered {str(answer)[:300]}", router=self.url,
                              hint="Is this a vllm-router (pip install vllm-router)?") from None

    def add(self, worker_url: str) -> None:
        """Register a vLLM server (it must answer ``/health``); returns once the worker list shows it.
        A server listed already is left as it is.

        Raises:
            RouterError: the router refused it, or does not list it after ``timeout`` seconds.
        """
        worker = normalize(worker_url)
        if self._listed(worker):
            return
        try:
            self._request("POST", "/workers", {"url": worker})
        except RouterError as exc:
            if not self._listed(worker):  # a 400 "already exists" from a concurrent add is success
                raise RouterError(f"could not add it: {exc}", router=self.url, worker=worker,
                                  hint="Does the server answer /health from the router's host?") from None
        self._until(lambda: self._listed(worker), worker, "still does not list it after POST /workers")
        logger.info("router %s: added %s", self.url, worker)

    def remove(self, worker_url: str) -> None:
        """Deregister a vLLM server by its URL; returns once the worker list no longer shows it (at once if
        it never did). Requests it is serving finish; it gets no new ones.

        Raises:
            RouterError: the router does not answer, or still lists it after ``timeout`` seconds.
        """
        worker = normalize(worker_url)
        for listed in self._matching(worker):
            # Encoded whole: "/" and ":" unencoded make a path the router proxies to a worker instead.
            self._request("DELETE", "/workers/" + urllib.parse.quote(listed, safe=""))
        self._until(lambda: not self._listed(worker), worker, "still lists it after DELETE /workers/{url}")
        logger.info("router %s: removed %s", self.url, worker)

    # ------------------------------------------------------------------------------------------ HTTP

    def _matching(self, worker: str) -> list[str]:
        return [w for w in self.workers() if normalize(w) == worker]

    def _listed(self, worker: str) -> bool:
        return bool(self._matching(worker))

    def _until(self, done: Any, worker: str, failure: str) -> None:
        deadline = time.monotonic() + self.timeout
        while not done():
            if time.monotonic() > deadline:
                raise RouterError(f"answered, but {failure} ({self.timeout:.0f} s); it lists "
                                  f"{self.workers() or 'no worker'}", router=self.url, worker=worker,
                                  hint="Check the router's log; is another process changing its workers?")
            time.sleep(CHECK_INTERVAL)

    def _request(self, method: str, path: str, body: Any = None) -> Any:
        try:
            return request_json(self.url + path, method, body, api_key=self.api_key, timeout=self.timeout)
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:300].decode("utf-8", "replace")
            raise RouterError(f"{method} {path} answered {exc.code}: {detail}", router=self.url) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise RouterError(f"{method} {path} failed: {reason}", router=self.url,
                              hint="Is the router running there? Start one with `vllm-router --port PORT` "
                                   "or Router.start()") from None
