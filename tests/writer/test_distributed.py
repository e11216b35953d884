"""DistributedPublisher in a real torch.distributed job (two spawned processes, gloo), on a local directory
and on the S3 server: each rank writes its own tensors, rank 0 commits; the keyframe/delta choice is made
jointly; a failure on one rank aborts the version on every rank promptly and leaves nothing visible."""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

import torch

from ckptstream import Stream
from ckptstream.testing.models import rl_like_step
from tests.helpers import assert_same_tensors, run_ranks


def _rank_tensors(rank: int, version: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s part of ``version``: version 2 rewrites every element of rank 1's part."""
    generator = torch.Generator().manual_seed(rank)
    part = {f"rank{rank}.{i}.weight": (torch.randn(64, 256, generator=generator) * 0.02).bfloat16() for i in range(3)}
    changes = torch.Generator().manual_seed(100 + rank)
    for _ in range(min(version, 1)):
        rl_like_step(part, generator=changes)
    if version >= 2 and rank == 1:
        part = {name: torch.randn(t.shape, generator=changes).bfloat16() for name, t in part.items()}
    return part


def _worker(rank: int, world_size: int, port: int, url: str, report: str) -> None:
    import torch.distributed as dist

    from ckptstream.writer.distributed import DistributedPublisher

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=60))
    outcomes = {}
    publisher = DistributedPublisher(url, timeout=datetime.timedelta(seconds=60))
    for version in range(3):
        outcomes[version] = publisher.publish(_rank_tensors(rank, version), version).result().kind

    # The same name on both ranks: refused on both, nothing committed.
    try:
        publisher.publish({"shared.weight": torch.zeros(4)}, 3).result()
        outcomes[3] = "committed"
    except Exception as exc:  # noqa: BLE001 - the outcome is what the test checks
        outcomes[3] = f"{type(exc).__name__}: {exc}"
    _acknowledge(publisher)

    # Rank 1 hands over something that cannot be published: it raises at once, rank 0's version fails.
    bad = {"sparse": torch.eye(3).to_sparse()} if rank == 1 else _rank_tensors(rank, 4)
    try:
        publisher.publish(bad, 4).result()
        outcomes[4] = "committed"
    except Exception as exc:  # noqa: BLE001
        outcomes[4] = f"{type(exc).__name__}: {exc}"
    _acknowledge(publisher)

    # Both ranks go on with the next version.
    outcomes[5] = publisher.publish(_rank_tensors(rank, 2), 5).result().kind
    publisher.close()

    # A restarted job: a version that is not newer is refused on every rank, the next one starts a chain.
    publisher = DistributedPublisher(url, timeout=datetime.timedelta(seconds=60))
    try:
        publisher.publish(_rank_tensors(rank, 2), 5)
        outcomes[6] = "accepted"
    except Exception as exc:  # noqa: BLE001
        outcomes[6] = type(exc).__name__
    outcomes[7] = publisher.publish(_rank_tensors(rank, 2), 7).result().kind
    publisher.close()
    Path(report, f"rank{rank}.json").write_text(json.dumps(outcomes))
    dist.destroy_process_group()


def _acknowledge(publisher) -> None:
    """A failure is raised by its future and once more by the publisher's next call: take it there."""
    try:
        publisher.wait()
    except Exception:  # noqa: BLE001
        pass


def test_ranks_publish_parts_of_one_version(stream_url: str, tmp_path: Path) -> None:
    assert run_ranks(_worker, 2, stream_url, str(tmp_path), timeout=240) == [0, 0]
    outcomes = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for rank_outcomes in outcomes:
        # Version 2 is a keyframe: rank 1's part changed entirely, so neither rank writes a delta. After the
        # failed versions the publishers start over from a keyframe.
        assert [rank_outcomes[str(v)] for v in (0, 1, 2, 5)] == ["keyframe", "delta", "keyframe", "keyframe"]
        assert rank_outcomes["6"] == "VersionOrderError" and rank_outcomes["7"] == "keyframe"
        assert rank_outcomes["3"].startswith("PublishError") and "published by ranks 0 and 1" in rank_outcomes["3"]
    assert outcomes[0]["4"].startswith("PublishError") and "rank 1 failed (TypeError" in outcomes[0]["4"]
    assert outcomes[1]["4"].startswith("TypeError")
    stream = Stream(stream_url)
    assert stream.versions() == [0, 1, 2, 5, 7]
    for version in (0, 1, 2):
        assert_same_tensors(dict(stream.iter_tensors(version)),
                            {**_rank_tensors(0, version), **_rank_tensors(1, version)})
    # The aborted versions left no data behind: every rank removed the files it had written.
    leftovers = [e.path for v in (3, 4) for e in stream.storage.list(f"versions/{v:012d}")]
    assert leftovers == []


def _lazy_worker(rank: int, world_size: int, port: int, url: str, report: str) -> None:
    import torch.distributed as dist

    from ckptstream.writer.distributed import DistributedPublisher

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=60))
    outcomes: dict[str, object] = {}
    publisher = DistributedPublisher(url, timeout=datetime.timedelta(seconds=60), assets={"config.json": b"{}"})
    stream_file = Path(url, "stream.json")
    outcomes["after_init"] = stream_file.exists()
    bad = {"__metadata__": torch.ones(2)} if rank == 1 else _rank_tensors(rank, 0)
    for version, tensors in ((0, bad), (1, {})):  # a reserved name on one rank; no tensor on any rank
        try:
            publisher.publish(tensors, version).result()
            outcomes[str(version)] = "committed"
        except Exception as exc:  # noqa: BLE001 - the outcome is what the test checks
            outcomes[str(version)] = f"{type(exc).__name__}: {exc}"
        _acknowledge(publisher)
        dist.barrier()
        outcomes[f"stream_after_{version}"] = stream_file.exists()
    outcomes["2"] = publisher.publish(_rank_tensors(rank, 0), 2).result().kind
    publisher.close()
    Path(report, f"rank{rank}.json").write_text(json.dumps(outcomes))
    dist.destroy_process_group()


def test_rank_zero_creates_the_stream_at_the_first_commit(tmp_path: Path) -> None:
    url = str(tmp_path / "stream")
    assert run_ranks(_lazy_worker, 2, url, str(tmp_path), timeout=240) == [0, 0]
    outcomes = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for rank_outcomes in outcomes:
        assert [rank_outcomes[k] for k in ("after_init", "stream_after_0", "stream_after_1")] == [False] * 3
        assert "at least one tensor" in rank_outcomes["1"]
        assert rank_outcomes["2"] == "keyframe"
    assert "rank 1 failed (ValueError: tensor name '__metadata__' is reserved" in outcomes[0]["0"]
    assert outcomes[1]["0"].startswith("ValueError")
    stream = Stream(url)
    assert stream.versions() == [2] and [a.name for a in stream.info().assets] == ["config.json"]
    assert_same_tensors(dict(stream.iter_tensors(2)), {**_rank_tensors(0, 0), **_rank_tensors(1, 0)})
