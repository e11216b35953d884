"""Publishing versions (generic tensors, HF directories, many ranks, Megatron) and collecting old ones.

``MegatronPublisher`` is in :mod:`ckptstream.writer.megatron` (it needs megatron-core); the torch_dist
checkpoint reader in :mod:`ckptstream.writer.torch_dist` does not.
"""

from .distributed import DistributedPublisher
from .gc import GcReport, collect_garbage
from .publisher import Publisher, open_or_create_stream

__all__ = ["DistributedPublisher", "GcReport", "Publisher", "collect_garbage", "open_or_create_stream"]
