"""The trainer side of the ckptstream weight-transfer backend: a ``TrainerWeightTransferEngine`` that
publishes each round's weights as a version of a stream and tells the servers to serve it.

A trainer written against vLLM's trainer API switches from NCCL to shared storage by its init info::

    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from ckptstream.weight_transfer.client import HttpWeightSyncClient
    from ckptstream.weight_transfer.trainer import CkptstreamTrainerInitInfo

    engine = WeightTransferTrainerFactory.trainer_init(
        CkptstreamTrainerInitInfo(url="s3://bucket/run1", rank=dist_rank),
        client=HttpWeightSyncClient(["http://10.0.0.1:8000", "http://10.0.0.2:8000"]),
        source=ModuleSource(model))
    for step in ...:
        train_step()
        engine.send_weights()      # publish a version, then every server updates to it

Every trainer rank calls ``trainer_init`` and ``send_weights`` (iterating the source can be a collective,
e.g. FSDP's ``full_tensor``); rank 0 alone publishes and drives the servers.

A model sharded with DTensors (FSDP2's ``fully_shard``) need not be gathered: with
``source=ShardedModuleSource(model)`` every rank publishes its own shards as pieces of each parameter
(``DistributedPublisher.publish_sharded``, FORMAT.md "Tensors in pieces") and rank 0 drives the servers once
the version is committed::

    engine = WeightTransferTrainerFactory.trainer_init(
        CkptstreamTrainerInitInfo(url="s3://bucket/run1", rank=dist_rank),
        client=HttpWeightSyncClient(["http://10.0.0.1:8000"]), source=ShardedModuleSource(model))

CUDA tensors are encoded on
their device (the publisher's device encoder). The servers read the stream with their own credentials:
the trainer's ``storage_options`` stay in the trainer; ``server_storage_options`` (no credentials) travel.
Importing this module registers the backend with ``WeightTransferTrainerFactory``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterator

import torch
from vllm.distributed.weight_transfer.base import (ModuleSource, ParamMeta, TrainerInitInfo,
                                                   TrainerWeightTransferEngine, WeightSource)

from ..writer import DistributedPublisher, Publisher
from . import BACKEND, refuse_credentials, register


class ShardedModuleSource(WeightSource):
    """The parameters of a model sharded with DTensors (FSDP2) as a ``WeightSource`` that the ckptstream
    engine publishes without a gather: :meth:`shards` gives every rank's own DTensors, and each rank writes
    its shards. Iterating it gathers each parameter (``full_tensor()``) as ``ModuleSource`` does, so other
    backends can take it too."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def metadata(self) -> list[ParamMeta]:
        return ModuleSource(self.module).metadata()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(ModuleSource(self.module))

    def shards(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, parameter) of every parameter as this rank holds it: DTensors are not gathered."""
        return ((name, param.detach()) for name, param in self.module.named_parameters())


@dataclass
class CkptstreamTrainerInitInfo(TrainerInitInfo):
    """What the trainer-side engine needs.

    Attributes:
        url: the stream, as the trainer writes it.
        server_url: the stream as the servers read it, where it differs (another mount point, a mirror,
            the relay); default ``url``.
        storage_options: the trainer's storage options (may hold credentials: they never leave it).
        server_storage_options: the servers' (endpoint, region, ...; no credentials: refused).
        cache_dir: the servers' host cache root (default theirs).
        publisher_options: fields of :class:`ckptstream.writer.PublisherConfig` (``keyframe_every``,
            ``assets``: the model's config and tokenizer files, for a stream servers can also materialize).
        rank: this trainer process's rank (rank 0 publishes and drives the servers).
    """

    backend: ClassVar[str] = BACKEND

    url: str = ""
    server_url: str | None = None
    storage_options: dict[str, Any] = field(default_factory=dict)
    server_storage_options: dict[str, Any] = field(default_factory=dict)
    cache_dir: str | None = None
    publisher_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.url:
            raise ValueError("CkptstreamTrainerInitInfo.url must name the stream")
        # the trainer's own storage_options stay here; what the servers are sent must hold no credential
        refuse_credentials(self.server_init_info(), "the init_info sent to the servers (server_url or url, "
                                                    "server_storage_options; storage_options stay in the trainer)")

    def server_init_info(self) -> dict[str, Any]:
        """The ``init_info`` sent to every server (``engine.CkptstreamInitInfo``)."""
        info: dict[str, Any] = {"url": self.server_url or self.url, "storage_options": self.server_storage_options}
        if self.cache_dir is not None:
            info["cache_dir"] = self.cache_dir
        return info


class CkptstreamTrainerWeightTransferEngine(TrainerWeightTransferEngine[CkptstreamTrainerInitInfo]):
    """Publishes the source's weights as a version each round, then has every server update to it."""

    init_info_cls = CkptstreamTrainerInitInfo

    def __init__(self, *, client: Any, source: Any = None, is_sender: bool = True,
                 init_info: CkptstreamTrainerInitInfo | None = None) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.init_info = init_info
        self.publisher: Publisher | DistributedPublisher | None = None
        self.last_version: int | None = None
        self._servers_ready = False  # their engines initialized on the stream

    @classmethod
    def trainer_init(cls, init_info: CkptstreamTrainerInitInfo, *, client: Any,
                     source: Any = None) -> CkptstreamTrainerWeightTransferEngine:
        """Open the stream for publishing (rank 0) and initialize every server's engine on it (on a new
        stream: after its first version, which creates it)."""
        if source is None:
            raise ValueError("the ckptstream trainer engine publishes a WeightSource each round: pass source=")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, init_info=init_info)
        if isinstance(source, ShardedModuleSource):  # every rank publishes (a collective: on every rank)
            publisher = DistributedPublisher(init_info.url, storage_options=init_info.storage_options,
                                             **init_info.publisher_options)
            engine.publisher = publisher
            # The ranks number versions alike: from rank 0's look at the stream.
            latest = publisher.all_gather(publisher.stream.latest() if engine.is_sender else None)[0]
            engine.last_version = latest
            if engine.is_sender and latest is not None:
                engine._init_servers()
        elif engine.is_sender:
            engine.publisher = Publisher(init_info.url, storage_options=init_info.storage_options,
                                         **init_info.publisher_options)
            if engine.publisher.stream.exists():
                engine._init_servers()
        return engine

    def send_weights(self, *, step: int | None = None, metadata: dict[str, Any] | None = None) -> int | None:
        """Publish this round's weights (every rank iterates the source; rank 0 keeps them) and, on rank 0,
        update every server to the new version; returns it (None on other ranks). A server's failure
        raises (``VllmError`` with its reason) after the version was committed: it stays in the stream,
        and the servers that failed keep serving their last good version. With a ``ShardedModuleSource``
        every rank publishes its own shards, nothing gathered, and rank 0 updates the servers once the
        version is committed."""
        if isinstance(self.publisher, DistributedPublisher):
            number = 0 if self.last_version is None else self.last_version + 1
            assert isinstance(self.source, ShardedModuleSource)
            version = self.publisher.publish_sharded(dict(self.source.shards()), number, step=step,
                                                     metadata=metadata).result().version
            self.last_version = version
            return self._update_servers(version) if self.is_sender else None
        tensors = {}
        for name, tensor in self.source:  # on every rank: iterating may be a collective
            if self.is_sender:
                tensors[name] = tensor
        if not self.is_sender:
            return None
        assert self.publisher is not None
        version = self.publisher.publish(tensors, step=step, metadata=metadata).result().version
        self.last_version = version
        return self._update_servers(version)

    def _update_servers(self, version: int) -> int:
        """Rank 0: every server to ``version`` (initialized on the stream first, if it was new)."""
        if not self._servers_ready:  # a new stream exists from its first version on
            self._init_servers()
        self.client.start_weight_update()
        self.client.update_weights({"version": version})
        self.client.finish_weight_update(str(version))
        return version

    def _init_servers(self) -> None:
        assert self.init_info is not None
        self.client.init_weight_transfer_engine(self.init_info.server_init_info())
        self._servers_ready = True

    def shutdown(self) -> None:
        """Finish the publisher's pending work (the servers keep serving)."""
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None


register()
