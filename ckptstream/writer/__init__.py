"""Publishing versions (generic tensors and Hugging Face directories) and collecting old ones."""

from .gc import GcReport, collect_garbage
from .publisher import Publisher, open_or_create_stream

__all__ = ["GcReport", "Publisher", "collect_garbage", "open_or_create_stream"]
