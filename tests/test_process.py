"""Helpers for the child servers ckptstream starts: free ports, and the vLLM plugin its processes load."""

from __future__ import annotations

import socket
from importlib.metadata import entry_points

import pytest

from ckptstream.process import LOWEST_PICKED_PORT, _lowest_ephemeral_port, free_port


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
