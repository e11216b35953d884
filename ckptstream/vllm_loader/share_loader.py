"""vLLM's model loader of the load format ``ckptstream``: a start or restart in which each rank reads only its
share of the checkpoint (runs inside a vLLM worker).

vLLM's own loader (``DefaultModelLoader``) hands every tensor of every file to the model's weight loaders on
every rank, which keep the rank's slice: a rank reads what the kernel reads around each page fault of
safetensors' maps (every file, on every rank, with a large read-ahead window) or every file whole up front
(vLLM's prefetch on NFS and Lustre). ``ShareModelLoader`` is that loader with another weights iterator: the
tensors of the model's directory as views of private, random-access memory maps (``share_reload.mapped_weights``:
every file's header checked first, a rank's slice read when its loader ``narrow``s to it, nothing around it).
Everything else is vLLM's own loading (the model made, ``load_weights``, the check that every parameter was
loaded, the processing after loading), so the parameters are those of vLLM's own loading of the directory.

Where the directory is not a local directory of safetensors files (a hub name, ``.bin`` files), the engine has
one rank, or the model reads other files too (``share_reload.unmapped_reason``), vLLM's own loading runs, and
the worker's log says why (a warning). A file that is no readable safetensors file stops the start with
``IntegrityError`` naming it (vLLM's own loading would stop too, with safetensors' error).

``register`` puts it into vLLM's registry of loaders (``register_model_loader``, vLLM 0.24 and later):
ckptstream's vLLM plugin calls it in every vLLM process. This module imports vLLM and torch.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Generator
from typing import Any

import torch
from vllm.config import get_current_vllm_config_or_none
from vllm.model_executor.model_loader import DefaultModelLoader, register_model_loader

from .load_format import LOAD_FORMAT
from .share_reload import mapped_weights, unmapped_reason

log = logging.getLogger("ckptstream.share_loader")


class ShareModelLoader(DefaultModelLoader):
    """vLLM's ``DefaultModelLoader`` whose weights (``get_all_weights``, what its ``load_weights`` and vLLM's
    reload from a path read) are ``mapped_weights`` of the model's directory where that directory allows it."""

    def __init__(self, load_config: Any):
        # vLLM's own loading, where it runs, reads the directory as load format "auto" does (the default loader
        # refuses a format it does not know).
        super().__init__(dataclasses.replace(load_config, load_format="auto"))

    def get_all_weights(self, model_config: Any, model: torch.nn.Module
                        ) -> Generator[tuple[str, torch.Tensor], None, None]:
        config = get_current_vllm_config_or_none()
        world_size = getattr(getattr(config, "parallel_config", None), "world_size", 1)
        path = str(model_config.model)
        reason = unmapped_reason(world_size, self.load_config, model, path)
        if reason is None and getattr(getattr(model_config, "multimodal_config", None), "mm_encoder_only", False):
            reason = "--mm-encoder-only (vLLM reads the encoder's files only)"
        if reason is not None:
            log.warning("load format %s: %s; vLLM's own loader reads %s (every file it loads, on every rank)",
                        LOAD_FORMAT, reason, path)
            yield from super().get_all_weights(model_config, model)
            return
        if self.counter_before_loading_weights == 0.0:  # (what vLLM's "Loading weights took" log counts from)
            self.counter_before_loading_weights = time.perf_counter()
        log.info("load format %s: each rank reads its share of %s", LOAD_FORMAT, path)
        with mapped_weights(path) as weights:
            yield from weights


def register() -> None:
    """Register ``ShareModelLoader`` as vLLM's load format ``LOAD_FORMAT`` in this process."""
    register_model_loader(LOAD_FORMAT)(ShareModelLoader)
