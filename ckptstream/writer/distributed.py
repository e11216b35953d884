"""``DistributedPublisher``: one version written by every rank of a ``torch.distributed`` job together.

Each rank snapshots, encodes and writes its own tensors' data files in parallel with the others; the
version becomes visible in a second phase, when rank 0 commits the manifest after every rank has
reported its files durable. A failure on any rank aborts the version on every rank: no manifest is
written, each rank removes its files, and every rank's future raises the same error.
"""

from __future__ import annotations

import datetime as _dt
import logging
import re
from concurrent.futures import Future
from typing import Any, Callable, Mapping

import torch

from ..errors import PublishError, VersionConflictError
from ..format import FileEntry, Manifest, TensorEntry, data_path
from .publisher import NamedTensors, Publisher, _Base, _Job

log = logging.getLogger("ckptstream.publish")

# Coordination messages, one per version in this order on every rank: the keyframe vote (a MAX
# all-reduce of one of these), each rank's report to rank 0, rank 0's outcome to everyone.
_VOTE_DELTA, _VOTE_KEYFRAME, _VOTE_FAILED = 0, 1, 2


class DistributedPublisher(Publisher):
    """Publishes versions whose tensors are spread over the ranks of a ``torch.distributed`` job.

    Every rank of ``group`` calls ``publish`` with the same version and its own tensors (names disjoint
    across ranks; a rank may have none). A version is a delta only if every rank's part can be one
    (``delta_max_ratio`` applies to each rank's part). A new publisher, and one whose last version failed,
    starts with a keyframe: the ranks never decode the stream to find a delta base.

    Args:
        url: the stream, as for :class:`Publisher`; every rank must reach the same storage.
        group: the process group to coordinate over. Default: a new gloo group of the whole world (so
            coordination runs on background threads without touching the trainer's NCCL groups); every
            rank must construct its publisher at the same point of the program.
        timeout: how long a rank waits for the others before the version is failed.
        **options: the other options of :class:`Publisher`.
    """

    def __init__(self, url: str, *, group: Any = None, timeout: _dt.timedelta = _dt.timedelta(minutes=10),
                 **options: Any):
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("DistributedPublisher needs torch.distributed to be initialized on every rank")
        # Collective first, so that a failure below cannot leave other ranks waiting in new_group.
        self._group = group if group is not None else dist.new_group(backend="gloo", timeout=timeout)
        self._rank = dist.get_rank(self._group)
        self._size = dist.get_world_size(self._group)
        self._root = dist.get_global_rank(self._group, 0)
        super().__init__(url, **options)
        self._base_known = True

    def publish(self, named_tensors: NamedTensors, version: int | None = None, *, step: int | None = None,
                metadata: Mapping[str, Any] | None = None, keyframe: bool = False) -> Future[Manifest]:
        """Publish this rank's part of ``version``; call it on every rank with the same version.

        Returns a future resolving to the committed manifest on every rank, or raising the same
        ``PublishError`` on every rank when any rank failed.
        """
        if version is None:
            raise ValueError("DistributedPublisher.publish needs an explicit version, the same on every rank")
        self._check_open()
        self._raise_failure()  # an earlier version's failure: every rank raises it here, no collective pending
        try:
            return super().publish(named_tensors, version, step=step, metadata=metadata, keyframe=keyframe)
        except Exception as exc:
            # This rank cannot take part (a bad tensor, a version not newer than the stream's latest): vote
            # the version down so that the other ranks abort it now rather than at the timeout.
            self._committer.submit(self._vote_down, version, exc)
            raise

    def _vote_down(self, version: int, failure: BaseException) -> None:
        """Take part in a version's coordination as a failed rank (this rank has no job for it)."""
        try:
            self._vote(_VOTE_FAILED)
            self._exchange(f"{type(failure).__name__}: {failure}", [], [], lambda parts: ("failed", _failures(parts)))
        except Exception as exc:  # noqa: BLE001 - the caller already has this rank's error
            log.warning("version %d: could not tell the other ranks that this rank failed: %s", version, exc)

    def _vote(self, vote: int) -> int:
        """Phase one: the highest of every rank's vote (``_VOTE_*``)."""
        import torch.distributed as dist

        votes = torch.tensor([vote])
        dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=self._group)
        return int(votes)

    def _exchange(self, report: str | None, files: list[FileEntry], tensors: list[TensorEntry],
                  decide: Callable[[list[Any]], tuple[str, Any]]) -> tuple[str, Any]:
        """Phase two: every rank's report (its failure or None, its files and tensors) goes to rank 0, where
        ``decide(parts)`` gives the outcome; every rank returns that outcome."""
        import torch.distributed as dist

        parts: list[Any] | None = [None] * self._size if self._rank == 0 else None
        dist.gather_object((report, files, tensors), parts, dst=self._root, group=self._group)
        outcome: list[Any] = [decide(parts) if parts is not None else None]
        dist.broadcast_object_list(outcome, src=self._root, group=self._group)
        return outcome[0]

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (picklable), in rank order: a collective over the group."""
        import torch.distributed as dist

        values: list[Any] = [None] * self._size
        dist.all_gather_object(values, value, group=self._group)
        return values

    def agree(self, failure: BaseException | None) -> None:
        """Raise on every rank if ``failure`` is set on any (a collective over the group): for checks that
        may fail on some ranks only, so that no rank goes on to wait for the others."""
        reports = self.all_gather(None if failure is None else f"{type(failure).__name__}: {failure}")
        if failure is not None:
            raise failure
        failed = [f"rank {rank}: {report}" for rank, report in enumerate(reports) if report]
        if failed:
            raise PublishError(f"another rank failed ({'; '.join(failed)})")

    def _current_base(self, version: int) -> _Base | None:
        return self._base

    def _write(self, job: _Job) -> Manifest:
        base = self._base
        hashes = self._hash_async(job)
        failure: BaseException | None = None
        delta = None
        try:
            delta = self._try_delta(job, base)
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            failure = exc
        vote = self._vote(_VOTE_FAILED if failure else _VOTE_KEYFRAME if delta is None else _VOTE_DELTA)
        files: list[FileEntry] = []
        tensors: list[TensorEntry] = []
        if vote == _VOTE_KEYFRAME:
            delta = None
        if vote != _VOTE_FAILED:
            try:
                files, tensors = self._write_data(job, delta, hashes)
            except Exception as exc:  # noqa: BLE001
                failure = exc
        report = None if failure is None else f"{type(failure).__name__}: {failure}"
        status, payload = self._exchange(report, files, tensors, lambda parts: self._commit_parts(
            job, base if delta is not None else None, parts))
        if status == "committed":
            return Manifest.from_bytes(payload, version=job.version, stream_id=self.info.stream_id)
        self._remove_files(job.version, files)
        error_type = VersionConflictError if status == "conflict" else PublishError
        raise error_type(f"not committed: {payload}", version=job.version)

    def _commit_parts(self, job: _Job, base: _Base | None, parts: list[Any]) -> tuple[str, Any]:
        """Rank 0: commit the manifest of every rank's files, or say why not."""
        failures = _failures(parts)
        if failures:
            return "failed", failures
        owner: dict[str, int] = {}
        for rank, (_, _, tensors) in enumerate(parts):
            for entry in tensors:
                if entry.name in owner:
                    return "failed", f"tensor {entry.name} was published by ranks {owner[entry.name]} and {rank}"
                owner[entry.name] = rank
        files = [f for _, rank_files, _ in parts for f in rank_files]
        tensors = sorted((t for _, _, rank_tensors in parts for t in rank_tensors), key=lambda t: _natural(t.name))
        try:
            manifest = self._version_manifest(job, base, files, tensors)
            self._commit(manifest)
        except VersionConflictError as exc:
            return "conflict", str(exc)
        except Exception as exc:  # noqa: BLE001 - every rank must hear the outcome, whatever it is
            return "failed", f"rank 0 could not commit ({type(exc).__name__}: {exc})"
        return "committed", manifest.to_bytes()

    def _remove_files(self, version: int, files: list[FileEntry]) -> None:
        for entry in files:
            try:
                self.storage.delete(data_path(version, entry.name))
            except OSError as exc:
                log.warning("version %d: cannot remove %s (left for `ckptstream gc`): %s", version, entry.name, exc)


def _failures(parts: list[Any]) -> str:
    """What the ranks' reports say failed ("" if nothing)."""
    return "; ".join(f"rank {rank} failed ({report})" for rank, (report, _, _) in enumerate(parts) if report)


def _natural(name: str) -> list[Any]:
    """Sort key that orders ``layers.10`` after ``layers.9``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]
