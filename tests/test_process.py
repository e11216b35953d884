"""Helpers for the child processes ckptstream starts: free ports, the vLLM plugin its processes load, and
evaluation commands run together."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

from ckptstream.process import LOWEST_PICKED_PORT, _lowest_ephemeral_port, free_port, run_together


def test_free_ports_lie_below_the_ephemeral_range_and_can_be_bound():
    """Outgoing connections take their source ports from the ephemeral range: a port picked there could be
    gone before the server binds it."""
    low = _lowest_ephemeral_port()
    ports = {free_port() for _ in range(20)}
    assert all(LOWEST_PICKED_PORT <= port < low for port in ports)
    assert len(ports) > 1  # picked at random: two servers started at once do not race for one port
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))


def test_vllm_runs_the_amx_plugin_in_its_processes():
    """vLLM calls its general plugins in every process it starts (its spawned workers too): ckptstream's asks
    for the AMX state there, without which vLLM's CPU attention dies of SIGILL on an AMX host."""
    pytest.importorskip("vllm")  # (what the plugin runs in; `make test` installs it)
    plugins = {ep.name: ep for ep in entry_points(group="vllm.general_plugins")}
    assert plugins["ckptstream_amx"].value == "ckptstream.vllm_plugin:request_amx"
    plugins["ckptstream_amx"].load()()  # (on this CPU platform: asks where torch reports AMX tiles)


def test_commands_run_together_give_their_codes_and_outputs():
    runs = run_together([([sys.executable, "-c", "print('a'); raise SystemExit(3)"], os.environ),
                         ([sys.executable, "-c", "import sys; sys.stderr.write('b' * 200000)"], os.environ)],
                        capture=True)
    assert [(code, output) for code, _, output in runs] == [(3, "a\n"), (0, "b" * 200000)]  # (a full pipe read)
    assert all(seconds > 0 for _, seconds, _ in runs)


CTRL_C_ON_ANOTHER_THREAD = """
import signal, sys, threading, time
from ckptstream.process import run_together

signal.signal(signal.SIGINT, signal.default_int_handler)  # (a suite run as a background job inherits it ignored)

def interrupt():  # the kernel may hand a Ctrl-C to any thread: here, to this one
    time.sleep(0.5)
    signal.pthread_kill(threading.get_ident(), signal.SIGINT)

threading.Thread(target=interrupt).start()
run_together([([sys.executable, "-c", "import time; time.sleep(600)"], {})], capture=False)
"""


def test_a_ctrl_c_delivered_to_another_thread_ends_the_commands():
    done = subprocess.run([sys.executable, "-c", CTRL_C_ON_ANOTHER_THREAD], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0 and "KeyboardInterrupt" in done.stderr, done.stderr
