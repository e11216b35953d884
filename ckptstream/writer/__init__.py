"""Publishing versions (generic tensors, HF directories, many ranks, Megatron) and collecting old ones.

``MegatronPublisher`` is in :mod:`ckptstream.writer.megatron` (it needs megatron-core); the torch_dist
checkpoint reader in :mod:`ckptstream.writer.torch_dist` does not. Names are imported on first use:
importing this package does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_face

_LAZY_NAMES = {
    **dict.fromkeys(("AdapterSource", "peft_dir_source", "peft_model_source"), ".adapter"),
    **dict.fromkeys(("commit_manifest", "open_or_create_stream", "write_latest_hint"), ".commit"),
    "PublisherConfig": ".config",
    "DistributedPublisher": ".distributed",
    **dict.fromkeys(("GcReport", "collect_garbage"), ".gc"),
    **dict.fromkeys(("Publication", "Publisher"), ".publisher"),
}

if TYPE_CHECKING:
    from .adapter import AdapterSource, peft_dir_source, peft_model_source
    from .commit import commit_manifest, open_or_create_stream, write_latest_hint
    from .config import PublisherConfig
    from .distributed import DistributedPublisher
    from .gc import GcReport, collect_garbage
    from .publisher import Publication, Publisher

__getattr__, __dir__ = lazy_face(__name__, _LAZY_NAMES)

__all__ = ["AdapterSource", "DistributedPublisher", "GcReport", "Publication", "Publisher", "PublisherConfig",
           "collect_garbage", "commit_manifest", "open_or_create_stream", "peft_dir_source", "peft_model_source",
           "write_latest_hint"]
