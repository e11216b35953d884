"""Publishing versions (generic tensors, HF directories, many ranks, Megatron) and collecting old ones.

``MegatronPublisher`` is in :mod:`ckptstream.writer.megatron` (it needs megatron-core); the torch_dist
checkpoint reader in :mod:`ckptstream.writer.torch_dist` does not.
"""

from .commit import commit_manifest, open_or_create_stream
from .config import PublisherConfig
from .distributed import DistributedPublisher
from .gc import GcReport, collect_garbage
from .publisher import Publisher

__all__ = ["DistributedPublisher", "GcReport", "Publisher", "PublisherConfig", "collect_garbage", "commit_manifest",
           "open_or_create_stream"]
