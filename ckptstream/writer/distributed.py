"""``DistributedPublisher``: one version written by every rank of a ``torch.distributed`` job together.

Each rank snapshots, encodes and writes its own tensors' data files in parallel with the others, through
the same pipeline as a single :class:`~ckptstream.writer.publisher.Publisher`; ``RankCoordinator`` plugs
the two coordination phases into it. Phase one votes on the version's kind (a delta only if every rank's
part can be one); phase two gathers every rank's files and tensors at rank 0, which commits the manifest
after every rank has reported its files durable, and broadcasts the outcome. A failure on any rank
aborts the version on every rank: no manifest is written, each rank removes its files, and every rank's
future raises the same error.
"""

from __future__ import annotations

import datetime as _dt
import logging
import re
from concurrent.futures import Future
from typing import Any, Callable, Mapping

import torch

from ..errors import CommitOutcomeUnknownError, PublishError, VersionConflictError
from ..format import DELTA, ENCODING_PIECES, KEYFRAME, FileEntry, Manifest, TensorEntry
from ..reader import Stream
from ..storage import Storage
from .config import PublisherConfig
from .pieces import owner
from .publisher import CommitFn, Part, Publisher
from .snapshot import NamedTensors

log = logging.getLogger("ckptstream.publish")

# Coordination messages, one per version in this order on every rank: the keyframe vote (a MAX
# all-reduce of one of these), each rank's report to rank 0, rank 0's outcome to everyone.
_VOTE_DELTA, _VOTE_KEYFRAME, _VOTE_FAILED = 0, 1, 2


class RankCoordinator:
    """The two coordination phases of a version over a process group (every rank, in version order).

    Args:
        group: the process group; rank 0 of it commits.
    """

    looks_up_base = False  # a rank cannot cheaply agree with the others on a version decoded from the stream

    def __init__(self, group: Any):
        import torch.distributed as dist

        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.root = dist.get_global_rank(group, 0)
        self.commits = self.rank == 0

    def agree_kind(self, version: int, kind: str, failure: BaseException | None) -> str | None:
        vote = self._vote(_VOTE_FAILED if failure else _VOTE_KEYFRAME if kind == KEYFRAME else _VOTE_DELTA)
        return None if vote == _VOTE_FAILED else KEYFRAME if vote == _VOTE_KEYFRAME else DELTA

    def commit(self, version: int, part: Part, commit: CommitFn, discard: Callable[[], None]) -> Manifest:
        report = None if part.failure is None else f"{type(part.failure).__name__}: {part.failure}"
        status, payload = self._exchange(report, part.files, part.tensors, lambda parts: _commit_parts(parts, commit))
        if status == "committed":
            return Manifest.from_bytes(payload, version=version)
        if status == "unknown":  # the manifest may be stored: its data files must stay
            raise CommitOutcomeUnknownError(f"not known to be committed: {payload}", version=version)
        discard()
        error_type = VersionConflictError if status == "conflict" else PublishError
        raise error_type(f"not committed: {payload}", version=version)

    def abandon(self, version: int | None, failure: BaseException) -> None:
        """Take part in a version's coordination as a failed rank (this rank has no part of it)."""
        try:
            self._vote(_VOTE_FAILED)
            self._exchange(f"{type(failure).__name__}: {failure}", [], [], lambda parts: ("failed", _failures(parts)))
        except Exception as exc:  # noqa: BLE001 - the caller already has this rank's error
            log.warning("version %s: could not tell the other ranks that this rank failed: %s", version, exc)

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (picklable), in rank order: a collective over the group."""
        import torch.distributed as dist

        values: list[Any] = [None] * self.size
        dist.all_gather_object(values, value, group=self.group)
        return values

    def _vote(self, vote: int) -> int:
        """Phase one: the highest of every rank's vote (``_VOTE_*``)."""
        import torch.distributed as dist

        votes = torch.tensor([vote])
        dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=self.group)
        return int(votes)

    def _exchange(self, report: str | None, files: list[FileEntry], tensors: list[TensorEntry],
                  decide: Callable[[list[Any]], tuple[str, Any]]) -> tuple[str, Any]:
        """Phase two: every rank's report (its failure or None, its files and tensors) goes to rank 0, where
        ``decide(parts)`` gives the outcome; every rank returns that outcome."""
        import torch.distributed as dist

        parts: list[Any] | None = [None] * self.size if self.rank == 0 else None
        dist.gather_object((report, files, tensors), parts, dst=self.root, group=self.group)
        outcome: list[Any] = [decide(parts) if parts is not None else None]
        dist.broadcast_object_list(outcome, src=self.root, group=self.group)
        return outcome[0]


class DistributedPublisher:
    """Publishes versions whose tensors are spread over the ranks of a ``torch.distributed`` job.

    Every rank of ``group`` calls ``publish`` with the same version and its own tensors (names disjoint
    across ranks; a rank may have none), or ``publish_sharded`` with the state dict of a model sharded with
    DTensors (FSDP2), of which each rank writes its own shards. A version is a delta only if every rank's
    part can be one (``delta_max_ratio`` applies to each rank's part). A new publisher, and one whose last
    version failed, starts with a keyframe: the ranks never decode the stream to find a delta base
    (``base_cache_dir`` does not apply). Rank 0 creates the stream at its first commit.

    Args:
        url: the stream, as for :class:`Publisher`; every rank must reach the same storage.
        config: the options of :class:`Publisher`, in one object.
        group: the process group to coordinate over. Default: a new gloo group of the whole world (so
            coordination runs on background threads without touching the trainer's NCCL groups); every
            rank must construct its publisher at the same point of the program.
        timeout: how long a rank waits for the others before the version is failed.
        **options: fields of :class:`PublisherConfig`, replacing ``config``'s.
    """

    def __init__(self, url: str, config: PublisherConfig | None = None, *, group: Any = None,
                 timeout: _dt.timedelta = _dt.timedelta(minutes=10), **options: Any):
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("DistributedPublisher needs torch.distributed to be initialized on every rank")
        # Collective first, so that a failure below cannot leave other ranks waiting in new_group.
        self._coordinator = RankCoordinator(group if group is not None else dist.new_group(backend="gloo",
                                                                                            timeout=timeout))
        self._publisher = Publisher(url, config, coordinator=self._coordinator, **options)

    @property
    def storage(self) -> Storage:
        """The stream's storage."""
        return self._publisher.storage

    @property
    def stream(self) -> Stream:
        """The stream, for reading (its latest version, whether it exists)."""
        return self._publisher.stream

    @property
    def config(self) -> PublisherConfig:
        """The options this publisher runs with."""
        return self._publisher.config

    @property
    def device_memory_bytes(self) -> int:
        """Device memory this rank's publisher holds (see :attr:`Publisher.device_memory_bytes`)."""
        return self._publisher.device_memory_bytes

    @property
    def pinned_memory_bytes(self) -> int:
        """Pinned host memory of this rank's device encoder (see :attr:`Publisher.pinned_memory_bytes`)."""
        return self._publisher.pinned_memory_bytes

    @property
    def phase_seconds(self) -> dict[str, float]:
        """Seconds of each background phase of this rank's last version (see :attr:`Publisher.phase_seconds`)."""
        return self._publisher.phase_seconds

    def publish(self, named_tensors: NamedTensors, version: int | None = None, *, step: int | None = None,
                metadata: Mapping[str, Any] | None = None, keyframe: bool = False) -> Future[Manifest]:
        """Publish this rank's part of ``version``; call it on every rank with the same version.

        Returns a future resolving to the committed manifest on every rank, or raising the same
        ``PublishError`` on every rank when any rank failed. A rank whose ``publish`` raises (a bad
        tensor, a version not newer than the stream's latest) makes the version fail on the others at
        once, not at the timeout.
        """
        if version is None:
            raise ValueError("DistributedPublisher.publish needs an explicit version, the same on every rank")
        return self._publisher.publish(named_tensors, version, step=step, metadata=metadata, keyframe=keyframe)

    def publish_sharded(self, state_dict: Mapping[str, torch.Tensor], version: int | None = None, *,
                        step: int | None = None, metadata: Mapping[str, Any] | None = None,
                        keyframe: bool = False) -> Future[Manifest]:
        """Publish a model sharded over the ranks (FSDP2's ``fully_shard``, any DTensor ``Shard(dim)`` /
        ``Replicate`` layout) without gathering it: every rank passes its whole ``model.state_dict()``.

        Each rank writes its own shard of every DTensor as a piece of that tensor (FORMAT.md, "Tensors in
        pieces"); a tensor replicated on several ranks (a ``Replicate`` placement, or a plain tensor, which
        must then be the same on every rank) is written by one of them, chosen by its name. Nothing crosses
        ranks but the version's coordination. A version reads back as whole tensors. Deltas are per piece,
        against the same rank's piece of the last version. Arguments, result and errors as :meth:`publish`.
        """
        rank, size = self._coordinator.rank, self._coordinator.size
        items = state_dict.items() if isinstance(state_dict, Mapping) else state_dict
        return self.publish(((name, tensor) for name, tensor in items
                             if _is_dtensor(tensor) or owner(name, size) == rank),
                            version, step=step, metadata=metadata, keyframe=keyframe)

    def wait(self) -> None:
        """Block until every version published so far is committed (on every rank); raise the first failure."""
        self._publisher.wait()

    def close(self, *, create_stream: bool = True) -> None:
        """Wait for pending versions, then release threads and buffers (see :meth:`Publisher.close`)."""
        self._publisher.close(create_stream=create_stream)

    def __enter__(self) -> DistributedPublisher:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.close(create_stream=exc_type is None)

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (picklable), in rank order: a collective over the group."""
        return self._coordinator.all_gather(value)

    def agree(self, failure: BaseException | None) -> None:
        """Raise on every rank if ``failure`` is set on any (a collective over the group): for checks that
        may fail on some ranks only, so that no rank goes on to wait for the others."""
        reports = self.all_gather(None if failure is None else f"{type(failure).__name__}: {failure}")
        if failure is not None:
            raise failure
        failed = [f"rank {rank}: {report}" for rank, report in enumerate(reports) if report]
        if failed:
            raise PublishError(f"another rank failed ({'; '.join(failed)})")


def _commit_parts(parts: list[Any], commit: CommitFn) -> tuple[str, Any]:
    """Rank 0: commit the manifest of every rank's files, or say why not."""
    failures = _failures(parts)
    if failures:
        return "failed", failures
    owner: dict[str, int] = {}
    for rank, (_, _, tensors) in enumerate(parts):
        for entry in tensors:
            if entry.encoding == ENCODING_PIECES:
                continue  # every rank writes its own pieces of it: joined (and checked) by the commit
            if entry.name in owner:
                return "failed", f"tensor {entry.name} was published by ranks {owner[entry.name]} and {rank}"
            owner[entry.name] = rank
    files = [f for _, rank_files, _ in parts for f in rank_files]
    tensors = sorted((t for _, _, rank_tensors in parts for t in rank_tensors), key=lambda t: _natural(t.name))
    try:
        manifest = commit(files, tensors)
    except VersionConflictError as exc:
        return "conflict", str(exc)
    except CommitOutcomeUnknownError as exc:
        return "unknown", str(exc)
    except Exception as exc:  # noqa: BLE001 - every rank must hear the outcome, whatever it is
        return "failed", f"rank 0 could not commit ({type(exc).__name__}: {exc})"
    return "committed", manifest.to_bytes()


def _failures(parts: list[Any]) -> str:
    """What the ranks' reports say failed ("" if nothing)."""
    return "; ".join(f"rank {rank} failed ({report})" for rank, (report, _, _) in enumerate(parts) if report)


def _is_dtensor(tensor: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _natural(name: str) -> list[Any]:
    """Sort key that orders ``layers.10`` after ``layers.9``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]
