"""``PublisherConfig``: every option of a publisher in one object, passed whole through the layers that
build one (``Publisher``, ``DistributedPublisher``, ``MegatronPublisher``)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Mapping

from .. import codec
from ..format import DEFAULT_SHARD_BYTES
from .commit import Assets


@dataclass(frozen=True)
class PublisherConfig:
    """How a publisher reaches its stream and encodes its versions.

    Attributes:
        storage_options: passed to the fsspec file system (e.g. ``{"profile": "train"}``).
        assets: the non-weight files that make a materialized directory servable (config.json,
            tokenizer files, generation_config.json), as a mapping of file name to bytes or a Hugging Face
            model directory to take them from. Stored once, when the stream is created.
        keyframe_every: at most this many versions per keyframe chain (1 writes only keyframes).
        delta_max_ratio: a delta larger than this fraction of the full bytes is written as a keyframe.
        shard_bytes: maximum size of one data file.
        chunk_bytes: size of independently compressed chunks (the unit of parallel encode/decode).
        zstd_level: zstd compression level for deltas (1: on a 1 %-changed bf16 delta both smaller and twice
            as fast to compress as 3, whose match finding finds nothing in XOR payloads).
        shuffle: byte-shuffle chunks before compression (groups the bytes of equal significance).
        max_in_flight: versions snapshotted but not yet committed; ``publish`` blocks beyond this.
        workers: encoder threads (default: one per core, at most 8).
        base_cache_dir: a local directory keeping a copy of the last version this publisher wrote, so a
            fresh process (e.g. the CLI) can write a delta without decoding the stream's latest version.
        device_delta: compute deltas on the device the tensors live on (:mod:`ckptstream.writer.device_encode`).
            None (default): for CUDA tensors. It keeps a copy of the last version on the device (1x the
            model's bytes of device memory, ``Publisher.device_memory_bytes``) and a pageable host copy,
            with one pinned block of at most 10 % of the model's bytes (``Publisher.pinned_memory_bytes``: the
            payload's staging and the ring whole tensors leave through); ``publish`` then waits only
            for the change detection on the device. False: the host path (the tensors are copied into pinned
            host buffers, and the delta is computed there). True also for CPU tensors (the reference run).
        freeze_gc: at the first ``publish`` that uses it, collect garbage once and freeze the objects
            alive then (the trainer's model and modules: ``gc.freeze``) until the last publisher closes (close
            it, or use ``with``), so that Python's full collections, which otherwise walk them all (0.1-0.2 s,
            holding the GIL, in whichever thread), stay short enough not to double a ``publish`` they fall
            into (:mod:`ckptstream.writer.heap`; meanwhile an object of then that becomes cyclic garbage is
            reclaimed only after the unfreeze). None (default): when the version goes to the device
            encoder, whose ``publish`` blocks tens of milliseconds. False: the collector is left alone.
    """

    storage_options: Mapping[str, Any] | None = None
    assets: Assets = None
    keyframe_every: int = 10
    delta_max_ratio: float = 0.5
    shard_bytes: int = DEFAULT_SHARD_BYTES
    chunk_bytes: int = codec.DEFAULT_CHUNK_BYTES
    zstd_level: int = 1
    shuffle: bool = True
    max_in_flight: int = 1
    workers: int | None = None
    base_cache_dir: str | os.PathLike[str] | None = None
    device_delta: bool | None = None
    freeze_gc: bool | None = None

    def __post_init__(self) -> None:
        if self.keyframe_every < 1 or self.max_in_flight < 1 or self.shard_bytes < 1 or self.chunk_bytes < 8:
            raise ValueError("keyframe_every, max_in_flight, shard_bytes and chunk_bytes must be positive")

    @classmethod
    def of(cls, config: PublisherConfig | None, options: Mapping[str, Any]) -> PublisherConfig:
        """``config`` (default: the defaults) with ``options`` (keyword arguments of the publishers)
        replacing its fields; TypeError for an unknown option."""
        base = config if config is not None else cls()
        return dataclasses.replace(base, **options) if options else base
