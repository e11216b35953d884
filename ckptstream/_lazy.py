"""Lazy package faces (PEP 562): a package's public names are imported from their submodules on first
use, so ``import ckptstream`` (and the command line's ``--help``) does not import torch."""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable, Mapping


def lazy_face(package: str, names: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level ``__getattr__`` and ``__dir__`` of ``package``.

    Args:
        package: the package's ``__name__``.
        names: each public name -> the module that defines it, relative to the package (``".stream"``,
            ``"..format"``).
    """

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            # AttributeError (not KeyError) keeps `from package import submodule` working.
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module, package), name)

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(names))

    return __getattr__, __dir__
