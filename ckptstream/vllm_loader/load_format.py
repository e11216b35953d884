"""The vLLM load format ``ckptstream`` (``share_loader``): which engines ``serve`` starts with it.

An engine of several ranks (tensor or pipeline parallel) started with ``--load-format ckptstream`` loads its
weights as vLLM's own loader does, but each rank reads only the pages of the files holding its share of the
model (as ``share_reload`` reloads it). vLLM finds the format where ckptstream's vLLM plugin registered it in
each of its processes (entry point ``PLUGIN``), so ``serve`` passes it only where that plugin is installed and
``VLLM_PLUGINS`` does not leave it out. Imports nothing of vLLM or torch.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Mapping

LOAD_FORMAT = "ckptstream"
"""The load format's name (vLLM's ``--load-format``)."""
PLUGIN = "ckptstream_model_loader"
"""The name of the vLLM general plugin (entry point of ``vllm.general_plugins``) that registers it."""
PLUGIN_TARGET = "ckptstream.vllm_plugin:register_model_loader"
PLUGIN_GROUP = "vllm.general_plugins"


def loader_installed(environ: Mapping[str, str]) -> bool:
    """Whether vLLM, started with ``environ``, registers the load format in its processes: ckptstream's
    plugin is installed (an editable install made before the plugin existed lacks it: ``pip install -e``
    again) and ``VLLM_PLUGINS`` (vLLM's list of plugins to load, every one when unset) names it."""
    allowed = environ.get("VLLM_PLUGINS")
    if allowed is not None and PLUGIN not in allowed.split(","):
        return False
    return any(entry.name == PLUGIN and entry.value == PLUGIN_TARGET
               for entry in importlib.metadata.entry_points(group=PLUGIN_GROUP))
