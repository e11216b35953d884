"""What a publisher of an adapter stream publishes (FORMAT.md, "Adapter streams"): an ``AdapterSource``, made
from a live ``peft.PeftModel`` in a trainer (``peft_model_source``) or from a directory that
``PeftModel.save_pretrained`` wrote (``peft_dir_source``). A source gives the stream's adapter block
(``format.AdapterInfo``), its one asset (``adapter_config.json``, as PEFT writes it) and, at each publish, the
adapter's tensors only, under the names of PEFT's ``adapter_model.safetensors`` (which vLLM loads).

The adapter configuration is stored in one canonical form — PEFT's (``json.dumps(indent=2, sort_keys=True)``),
with its module sets as sorted lists, which PEFT writes in whatever order the set had — so that every
process publishing one adapter writes the same asset bytes. peft is imported only when a live model's
tensors are taken.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

from ..errors import IncompatibleStreamError, IntegrityError, SourceNotFoundError
from ..basehash import base_model_hash
from ..format import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, AdapterInfo
from .snapshot import NamedTensors

_MODULE_SETS = ("target_modules", "exclude_modules")
"""Fields of a LoRA configuration that PEFT holds as sets (and writes as lists in the set's order)."""
_LORA_SUFFIXES = (".lora_A.weight", ".lora_B.weight", ".lora_embedding_A", ".lora_embedding_B")


@dataclass(frozen=True)
class AdapterSource:
    """An adapter to publish: the stream's adapter block, its ``adapter_config.json`` bytes, and ``read``,
    which returns the adapter's tensors as they are now (called at each publish)."""

    info: AdapterInfo
    config: bytes
    read: Callable[[], NamedTensors]

    @property
    def assets(self) -> dict[str, bytes]:
        """The assets of the adapter's stream: its configuration only."""
        return {ADAPTER_CONFIG_FILE: self.config}


def adapter_source(adapter: Any) -> AdapterSource:
    """``adapter`` as a source: an ``AdapterSource`` as it is, a ``peft.PeftModel`` through
    ``peft_model_source`` (TypeError for anything else)."""
    if isinstance(adapter, AdapterSource):
        return adapter
    if hasattr(adapter, "peft_config") and hasattr(adapter, "get_base_model"):
        return peft_model_source(adapter)
    raise TypeError(f"adapter_of takes a peft.PeftModel or an AdapterSource, not {type(adapter).__name__}")


def peft_model_source(model: Any, *, adapter_name: str | None = None, base_dir: str | os.PathLike[str] | None = None,
                      base_hash: str | None = None) -> AdapterSource:
    """The adapter ``adapter_name`` of a live ``peft.PeftModel``: its configuration as ``save_pretrained``
    writes it, its tensors from ``peft.get_peft_model_state_dict`` (only the adapter's) at each publish.

    Args:
        adapter_name: default the model's only adapter, else its one active adapter.
        base_dir, base_hash: the base model's identity, as for ``adapter_info``.
    """
    name = adapter_name or _default_adapter(model)
    if name not in model.peft_config:
        raise ValueError(f"the model has no adapter {name!r} (it has {', '.join(model.peft_config)})")
    body = dict(model.peft_config[name].to_dict())
    base_model = model.get_base_model()
    # What save_pretrained writes: the base's name where the config lacks it, inference mode, and (for a
    # model without a task type) the base model's class.
    body["base_model_name_or_path"] = body.get("base_model_name_or_path") or getattr(base_model, "name_or_path", None)
    body["inference_mode"] = True
    if body.get("task_type") is None:
        body["auto_mapping"] = {"base_model_class": type(base_model).__name__,
                                "parent_library": type(base_model).__module__}

    def read() -> dict[str, Any]:
        from peft import get_peft_model_state_dict

        return get_peft_model_state_dict(model, adapter_name=name)

    names = list(read())
    return AdapterSource(adapter_info(body, names, base_dir=base_dir, base_hash=base_hash), canonical_config(body),
                         read)


def peft_dir_source(directory: str | os.PathLike[str], *, base_dir: str | os.PathLike[str] | None = None,
                    base_hash: str | None = None) -> AdapterSource:
    """The adapter of a directory ``PeftModel.save_pretrained`` wrote (``adapter_config.json`` and
    ``adapter_model.safetensors``; anything else there, e.g. PEFT's README.md, is left out).

    Raises:
        SourceNotFoundError: a file is missing (or the weights are not safetensors).
        IntegrityError: the configuration is not a JSON object.
    """
    from safetensors import safe_open

    root = Path(directory)
    config_path, weights_path = root / ADAPTER_CONFIG_FILE, root / ADAPTER_WEIGHTS_FILE
    if not config_path.is_file():
        raise SourceNotFoundError(f"{root} has no {ADAPTER_CONFIG_FILE}",
                                  hint="Give a directory written by PeftModel.save_pretrained; nothing was published")
    if not weights_path.is_file():
        raise SourceNotFoundError(f"{root} has no {ADAPTER_WEIGHTS_FILE}",
                                  hint="Save the adapter with safe_serialization=True (the default); "
                                       "nothing was published")
    try:
        body = json.loads(config_path.read_bytes())
    except ValueError as exc:
        body = exc
    if not isinstance(body, dict):
        raise IntegrityError(f"not a JSON object ({body})", file=str(config_path),
                             hint="Give a directory written by PeftModel.save_pretrained")
    with safe_open(str(weights_path), framework="pt") as f:
        names = list(f.keys())

    def read() -> Iterator[tuple[str, Any]]:
        with safe_open(str(weights_path), framework="pt") as f:
            for tensor in f.keys():
                yield tensor, f.get_tensor(tensor)

    return AdapterSource(adapter_info(body, names, base_dir=base_dir, base_hash=base_hash), canonical_config(body),
                         read)


def adapter_info(config: Mapping[str, Any], tensor_names: Iterable[str], *,
                 base_dir: str | os.PathLike[str] | None = None, base_hash: str | None = None) -> AdapterInfo:
    """The stream's adapter block for a LoRA configuration (a parsed ``adapter_config.json``).

    The rank is the largest of ``r`` and the ranks of ``rank_pattern`` (what vLLM's ``--max-lora-rank``
    must reach); the target modules are the configuration's list, or, where it gives a pattern (a regular
    expression, ``all-linear``), the modules the adapter's tensors (``tensor_names``) adapt. The base is
    ``base_model_name_or_path``, its hash ``base_hash``, else ``base_model_hash`` of ``base_dir``, else of the
    base's name where that is a local directory of safetensors files, else unknown.

    Raises:
        IncompatibleStreamError: not a LoRA configuration, or one without a base model name.
    """
    if config.get("peft_type") != "LORA":
        raise IncompatibleStreamError(f"the adapter is of PEFT type {config.get('peft_type')!r}, not LORA",
                                      file=ADAPTER_CONFIG_FILE, hint="Adapter streams hold LoRA adapters")
    base_name = config.get("base_model_name_or_path")
    if not isinstance(base_name, str) or not base_name:
        raise IncompatibleStreamError("the adapter configuration names no base model (base_model_name_or_path)",
                                      file=ADAPTER_CONFIG_FILE,
                                      hint="Load the base model by name or path before wrapping it with PEFT")
    ranks = [config.get("r"), *(config.get("rank_pattern") or {}).values()]
    if not all(isinstance(r, int) and not isinstance(r, bool) and r > 0 for r in ranks):
        raise IncompatibleStreamError(f"the adapter's ranks {ranks} are not positive integers",
                                      file=ADAPTER_CONFIG_FILE)
    targets = config.get("target_modules")
    if isinstance(targets, (list, tuple, set, frozenset)):
        modules = tuple(sorted(set(targets)))
    else:
        modules = tuple(sorted({_adapted_module(n) for n in tensor_names if n.endswith(_LORA_SUFFIXES)}))
    if base_hash is None and base_dir is not None:
        base_hash = base_model_hash(base_dir)
    elif base_hash is None and _has_safetensors(base_name):
        base_hash = base_model_hash(base_name)
    info = AdapterInfo(base_name=base_name, base_hash=base_hash, rank=max(ranks), target_modules=modules)
    problem = info.problem()
    if problem is not None:
        raise IncompatibleStreamError(f"the adapter cannot be published: {problem}", file=ADAPTER_CONFIG_FILE)
    return info


def canonical_config(config: Mapping[str, Any]) -> bytes:
    """The bytes of ``adapter_config.json`` for ``config``: PEFT's layout (``indent=2``, keys sorted), its
    module sets as sorted lists."""
    body = {key: sorted(value) if _is_module_set(key, value) else value for key, value in config.items()}
    return json.dumps(body, indent=2, sort_keys=True).encode()


def _is_module_set(key: str, value: Any) -> bool:
    return isinstance(value, (set, frozenset)) or (key in _MODULE_SETS and isinstance(value, list))


def _adapted_module(tensor_name: str) -> str:
    """The last name of the module a LoRA tensor adapts (``...self_attn.q_proj.lora_A.weight``: ``q_proj``)."""
    module = next(tensor_name[:-len(s)] for s in _LORA_SUFFIXES if tensor_name.endswith(s))
    return module.rsplit(".", 1)[-1]


def _default_adapter(model: Any) -> str:
    names = list(model.peft_config)
    if len(names) == 1:
        return names[0]
    active = list(getattr(model, "active_adapters", []) or [])
    if len(active) == 1:
        return active[0]
    raise ValueError(f"the model has adapters {', '.join(names)}: name the one to publish "
                     "(peft_model_source(model, adapter_name=...))")


def _has_safetensors(path: str) -> bool:
    return os.path.isdir(path) and any(n.endswith(".safetensors") for n in os.listdir(path))
