"""``python -m ckptstream.fleet.router_launch ARGS``: vllm-router's own launcher (``python -m
vllm_router.launch_router ARGS``), with its ``--api-key`` taken from ``$CKPTSTREAM_ROUTER_API_KEY`` instead of
the command line. vllm-router 0.1.17 reads no environment variable for its key, and a command line is
readable by every user of the host (``ps``, ``/proc/PID/cmdline``); the key is added to this process's
``sys.argv`` list only, which is not what ``/proc`` shows."""

from __future__ import annotations

import os
import runpy
import sys

ROUTER_API_KEY_ENV = "CKPTSTREAM_ROUTER_API_KEY"
"""The environment variable ``Router.start`` passes the router's API key in."""


def main() -> None:
    key = os.environ.pop(ROUTER_API_KEY_ENV, None)  # not inherited by anything the router starts
    if key:
        sys.argv += ["--api-key", key]
    runpy.run_module("vllm_router.launch_router", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
