"""The stable name of an adapter stream inside vLLM: a LoRA resolver in vLLM's API server that answers, for a
name vLLM does not hold, the adapter directory an alias file names (``ResidentAdapters`` keeps that file).

Why a resolver: vLLM 0.32 cannot repoint a name at another adapter without a gap or a mix.

- ``load_inplace`` keeps the name's engine id (``entrypoints/openai/models/serving.py:179-190``), so requests
  already running on the name go on with the new weights, and every request for the name then carries
  ``load_inplace`` into each engine step, where the worker reads the adapter directory from disk again
  (``lora/worker_manager.py:296-304``; the batch keeps the request's own LoRARequest,
  ``v1/worker/gpu_input_batch.py:482-489``): a running request on the old directory loads the old weights
  back over the new ones, and a directory deleted under it fails the engine step.
- Unloading the name and loading it again gives the new version its own engine id (running requests finish
  on the old weights), but in between vLLM refuses requests for the name (404) unless a resolver resolves
  it: vLLM asks its resolvers for a name it does not hold (``entrypoints/serve/engine/serving.py:62-68``,
  with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``), under the per-name lock of the load
  (``entrypoints/openai/models/serving.py:173, 312-315``), and gives what a resolver found an id of its own
  (``:317-331``).

So the name is moved by: write the alias, unload the name, load it from the new directory; a request in
between is resolved to the new directory. (vLLM's own filesystem resolver cannot serve here: it needs the
directory under its cache directory with the served model's path as ``base_model_name_or_path``.)

The alias file is JSON ``{name: adapter directory}``, replaced atomically; vLLM learns its path from its
environment (``ALIASES_ENV``). The resolver is registered by the ``vllm.general_plugins`` entry point
``ckptstream_lora_aliases`` (``PLUGIN_NAME``), which vLLM runs in each of its processes: it imports vLLM's
resolver module only where ``ALIASES_ENV`` is set, and nothing of ckptstream's beyond this module.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

ALIASES_ENV = "CKPTSTREAM_LORA_ALIASES"
"""The environment variable naming vLLM's alias file (set by ``serve`` for an adapter stream)."""
PLUGIN_NAME = "ckptstream_lora_aliases"
"""The name of the ``vllm.general_plugins`` entry point that registers the resolver."""
RESOLVER_NAME = "ckptstream aliases"
"""The resolver's name in vLLM's ``LoRAResolverRegistry``."""

log = logging.getLogger("ckptstream.lora_aliases")


def read_aliases(path: str | os.PathLike[str]) -> dict[str, str]:
    """The aliases of the file ``path`` (none where it does not exist yet)."""
    try:
        aliases = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return {}
    if not isinstance(aliases, dict) or not all(isinstance(v, str) for v in aliases.values()):
        raise ValueError(f"{path} is not a JSON object of adapter name -> directory")
    return aliases


def write_alias(path: str | os.PathLike[str], name: str, directory: str | os.PathLike[str]) -> None:
    """Point ``name`` at ``directory`` in the alias file ``path`` (one replace: a reader sees the old file or
    the new one)."""
    path = Path(path)
    aliases = read_aliases(path)
    aliases[name] = str(directory)
    temporary = path.with_name(f"{path.name}.{os.getpid()}-{threading.get_ident()}")
    with open(temporary, "w", encoding="utf-8") as out:
        json.dump(aliases, out)
        out.flush()
        os.fsync(out.fileno())
    os.replace(temporary, path)


def register_resolver() -> None:
    """The entry point: in a vLLM process whose environment names an alias file, register a resolver answering
    the names it aliases (read at each resolution: vLLM asks only for names it does not hold). Never raises:
    a plugin's failure must not stop vLLM."""
    aliases = os.environ.get(ALIASES_ENV)
    if not aliases:
        return
    try:
        from vllm.lora.request import LoRARequest
        from vllm.lora.resolver import LoRAResolver, LoRAResolverRegistry
    except ImportError as exc:
        log.warning("%s is set but this vLLM has no LoRA resolvers (%s): the stable adapter name is moved "
                    "with a gap", ALIASES_ENV, exc)
        return

    class AliasResolver(LoRAResolver):
        async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
            try:
                directory = read_aliases(aliases).get(lora_name)
            except (OSError, ValueError) as exc:
                log.warning("cannot read the adapter aliases %s: %s", aliases, exc)
                return None
            # lora_int_id: a placeholder; vLLM gives a resolved adapter an id of its own
            return None if directory is None else LoRARequest(lora_name=lora_name, lora_int_id=1,
                                                              lora_path=directory)

    LoRAResolverRegistry.register_resolver(RESOLVER_NAME, AliasResolver())
