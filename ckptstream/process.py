"""Helpers for child servers (vLLM, vllm-router): a free port to start one on, and death with the parent."""

from __future__ import annotations

import ctypes
import signal
import socket

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In the child, before exec (``Popen(preexec_fn=...)``): get SIGTERM when the parent dies (orphans
    keep holding ports). Linux sends it when the *thread* that started the child exits: start children
    from a thread that lives as long as they should (not from a pool's worker thread)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (for a server about to start)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
