"""An older copy of one of ckptstream's modules (``git show REV:path > old.py``), loaded beside the current one so
that a benchmark times both in one run."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType


def load_baseline(path: str, name: str) -> ModuleType:
    """The module at ``path``, named ``name``: a name inside ckptstream's package where its own relative imports
    resolve (e.g. ``ckptstream.vllm_loader.inplace._baseline_apply``), and registered in ``sys.modules`` (its
    dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{path} is not a Python module")
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
