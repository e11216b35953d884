"""Publishing versions: generic tensors and Hugging Face directories."""

from .hf import hf_assets, iter_hf_weights
from .gc import GcReport, collect_garbage
from .publisher import Publisher, open_or_create_stream

__all__ = ["GcReport", "Publisher", "collect_garbage", "hf_assets", "iter_hf_weights", "open_or_create_stream"]
