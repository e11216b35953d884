"""The follower side: keep running vLLM servers on the newest good version of a stream.

Imports nothing of vLLM: servers are controlled over HTTP (``VLLM_SERVER_DEV_MODE=1`` routes).

This face imports its submodules eagerly (and so torch), unlike ``ckptstream``, ``ckptstream.reader`` and
``ckptstream.writer``: ``replay`` and ``serve`` name both a submodule and a function, and a lazy face would
hand out the submodule to whoever asks after that submodule was imported.
"""

from ..reader.selection import select_versions
from .follow.cache import VersionCache, default_cache_dir
from .client import VllmClient, VllmControl, VllmError, VllmUnreachable
from .follow.config import FollowerConfig
from .follow.follower import Follower
from .observe import FollowerObserver, JsonLines, OnUpdate, UpdateRecord
from .replay import ReplayResult, replay
from .serve import CPU_VLLM_ARGS, BackgroundServe, free_port, serve, vllm_command, vllm_platform_is_cpu
from .follow.takeover import Takeover

__all__ = ["CPU_VLLM_ARGS", "BackgroundServe", "Follower", "FollowerConfig", "FollowerObserver", "JsonLines",
           "OnUpdate", "ReplayResult", "Takeover", "UpdateRecord", "VersionCache", "VllmClient", "VllmControl",
           "VllmError", "VllmUnreachable", "default_cache_dir", "free_port", "replay", "select_versions", "serve",
           "vllm_command", "vllm_platform_is_cpu"]
