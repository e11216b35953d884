"""Publisher: round trips, chains, version rules, background failures, fresh processes, races."""

from __future__ import annotations

import threading

import pytest
import torch

from ckptstream import (IncompatibleStreamError, IntegrityError, Publisher, Stream, VersionConflictError,
                        VersionOrderError)
from ckptstream.format import DELTA, KEYFRAME
from ckptstream.testing.models import rl_like_step
from tests.helpers import assert_same_tensors, random_state

ALL_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
              torch.bfloat16, torch.float32, torch.float64]


def _all_dtypes_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    state = {}
    for dtype in ALL_DTYPES:
        name = str(dtype).split(".")[-1]
        if dtype == torch.bool:
            state[name] = torch.randint(0, 2, (33, 5), generator=g).bool()
        elif dtype.is_floating_point:
            state[name] = torch.randn(33, 5, generator=g).to(dtype)
        else:
            info = torch.iinfo(dtype)
            state[name] = torch.randint(max(info.min, -1000), min(info.max, 1000), (33, 5), generator=g).to(dtype)
    state["scalar"] = torch.tensor(3.5)
    state["empty"] = torch.zeros(0, 4)
    state["noncontiguous"] = torch.randn(8, 6, generator=g).t()
    return state


def test_every_dtype_round_trips_bit_exact(stream_url):
    versions = []
    with Publisher(stream_url, chunk_bytes=64, delta_max_ratio=2.0) as publisher:  # always a delta
        for seed in range(3):
            state = _all_dtypes_state(seed)
            if seed == 2:  # partly equal to version 1: exercises unchanged tensors and sparse XOR
                state = {**_all_dtypes_state(1), "float32": _all_dtypes_state(2)["float32"]}
            versions.append({k: v.contiguous().clone() for k, v in state.items()})
            publisher.publish(state).result()
    stream = Stream(stream_url)
    assert [stream.manifest(v).kind for v in stream.versions()] == [KEYFRAME, DELTA, DELTA]
    assert stream.manifest(2).tensor("int8").encoding == "unchanged"
    for version, want in enumerate(versions):
        assert_same_tensors(dict(stream.iter_tensors(version)), want)
        stream.verify(version)


def test_chain_of_25_versions_across_keyframes(stream_url):
    state = random_state(0, scale=4)
    history = []
    generator = torch.Generator().manual_seed(0)
    with Publisher(stream_url, keyframe_every=7, chunk_bytes=4096) as publisher:
        for step in range(25):
            if step:
                rl_like_step(state, fraction=0.02, generator=generator)
            history.append({k: v.clone() for k, v in state.items()})
            publisher.publish(state, step=step)  # futures not awaited: the publisher pipelines them
        publisher.wait()
    stream = Stream(stream_url)
    assert stream.versions() == list(range(25))
    kinds = [stream.manifest(v).kind for v in range(25)]
    assert [v for v, k in enumerate(kinds) if k == KEYFRAME] == [0, 7, 14, 21]
    assert [m.version for m in stream.chain(20)] == list(range(14, 21))
    for v in (0, 6, 13, 20, 24):
        assert_same_tensors(dict(stream.iter_tensors(v)), history[v])
        assert stream.manifest(v).step == v
    delta = stream.manifest(24)
    assert delta.stored_bytes < 0.15 * delta.full_bytes


def test_multi_shard_keyframes_and_deltas(stream_url):
    state = random_state(1, scale=8)
    with Publisher(stream_url, shard_bytes=20_000, chunk_bytes=4096) as publisher:
        publisher.publish(state).result()
        rl_like_step(state, fraction=0.5)
        manifest = publisher.publish(state).result()
    stream = Stream(stream_url)
    assert len(stream.manifest(0).files) > 2
    assert manifest.kind == DELTA and len(manifest.files) > 1
    assert_same_tensors(dict(stream.iter_tensors(1)), state)


def test_keyframe_shards_are_plain_safetensors(local_url, tiny_model):
    from safetensors.torch import load_file

    from ckptstream.hf import iter_hf_weights

    original = dict(iter_hf_weights(tiny_model))
    with Publisher(local_url, shard_bytes=200_000) as publisher:
        manifest = publisher.publish(original).result()
    loaded = {}
    for f in manifest.files:
        loaded.update(load_file(f"{local_url}/versions/000000000000/{f.name}"))
    assert_same_tensors(loaded, original)


def test_version_numbers_strictly_increase(stream_url):
    state = random_state()
    with Publisher(stream_url) as publisher:
        assert publisher.publish(state).result().version == 0
        assert publisher.publish(state, version=10).result().version == 10
        assert publisher.publish(state).result().version == 11
        with pytest.raises(VersionOrderError, match="not newer than the latest version 11"):
            publisher.publish(state, version=5)
    with Publisher(stream_url) as fresh, pytest.raises(VersionOrderError):
        fresh.publish(state, version=11)


def test_publish_returns_after_snapshot(local_url):
    state = random_state()
    want = {k: v.clone() for k, v in state.items()}
    with Publisher(local_url) as publisher:
        future = publisher.publish(state)
        for tensor in state.values():  # the trainer moves on at once
            tensor.zero_()
        future.result()
    assert_same_tensors(dict(Stream(local_url).iter_tensors(0)), want)


def test_background_failure_surfaces_at_next_call(local_url):
    publisher = Publisher(local_url)
    publisher.publish(random_state()).result()
    publisher.storage.put_if_absent("manifests/000000000001.json", b"squatted by someone else")
    future = publisher.publish(random_state())
    with pytest.raises(VersionConflictError):
        future.result()
    with pytest.raises(VersionConflictError, match="version 1"):
        publisher.publish(random_state())
    # After surfacing, the publisher starts over from the stream and works again.
    with pytest.raises(IntegrityError):  # the squatter's bytes are no manifest of ours
        Stream(local_url).manifest(1)
    assert publisher.publish(random_state()).result().version == 2
    publisher.close()


def test_delta_too_large_falls_back_to_keyframe(local_url):
    with Publisher(local_url, delta_max_ratio=0.3) as publisher:
        publisher.publish(random_state(0)).result()
        assert publisher.publish(random_state(1)).result().kind == KEYFRAME  # everything changed
        state = random_state(1)
        rl_like_step(state, fraction=0.01)
        assert publisher.publish(state).result().kind == DELTA


def test_fresh_publisher_writes_a_delta_against_the_stream(stream_url, tmp_path):
    state = random_state(0, scale=4)
    with Publisher(stream_url) as publisher:
        publisher.publish(state).result()
    for cache in (None, tmp_path / "cache"):
        rl_like_step(state, fraction=0.01)
        with Publisher(stream_url, base_cache_dir=cache) as fresh:  # a new process: no base in memory
            manifest = fresh.publish(state).result()
        assert manifest.kind == DELTA
        assert manifest.base_version == manifest.version - 1
    if cache is not None:
        assert any(cache.iterdir())
        rl_like_step(state, fraction=0.01)
        with Publisher(stream_url, base_cache_dir=cache) as fresh:
            assert fresh.publish(state).result().kind == DELTA
    stream = Stream(stream_url)
    assert_same_tensors(dict(stream.iter_tensors(stream.latest())), state)


def test_two_publishers_racing_for_one_version(stream_url):
    Publisher(stream_url).close()  # create the stream
    barrier = threading.Barrier(2)
    outcomes = []

    def race(seed: int) -> None:
        with Publisher(stream_url) as publisher:
            barrier.wait()
            future = publisher.publish(random_state(seed), version=3)
            try:
                outcomes.append(("won", seed, future.result()))
            except VersionConflictError as exc:
                outcomes.append(("lost", seed, exc))
                with pytest.raises(VersionConflictError):
                    publisher.wait()  # the failure also surfaces at the next call

    threads = [threading.Thread(target=race, args=(seed,)) for seed in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(o[0] for o in outcomes) == ["lost", "won"]
    winner = next(o for o in outcomes if o[0] == "won")
    assert "another writer committed this version first" in str(next(o for o in outcomes if o[0] == "lost")[2])
    stream = Stream(stream_url)
    assert stream.versions() == [3]
    assert_same_tensors(dict(stream.iter_tensors(3)), random_state(winner[1]))
    stream.verify(3)


def _publish_racing(url: str, seed: int, numbered: threading.Barrier) -> None:
    """One racer's process: number version 3 (the publisher lists the stream), wait until every racer has,
    then publish; exits with the code `ckptstream publish` gives its outcome."""
    import sys

    from ckptstream.errors import EXIT_ERROR, EXIT_OK, CkptStreamError

    publisher = Publisher(url)

    def tensors():
        numbered.wait(120)  # every racer holds a listing without version 3 before any of them commits
        yield from random_state(seed).items()

    try:
        publisher.publish(tensors(), version=3).result()
        code = EXIT_OK
    except CkptStreamError as exc:
        code = exc.exit_code
    except Exception:  # noqa: BLE001 - the exit code says it was not the conflict
        code = EXIT_ERROR
    try:
        publisher.close()
    except CkptStreamError:
        pass  # the same failure once more
    sys.exit(code)


def test_four_publisher_processes_racing_on_s3_one_wins_the_others_conflict(s3_endpoint):
    """Four processes commit version 3 of one stream on the S3 server at once: each loser's conditional PUT
    gets 412 and the manifest it reads back is the winner's (read from the server, not from the listing its
    publisher cached when it numbered the version), so it reports the conflict (exit 5), never exit 1."""
    from ckptstream.errors import EXIT_CONFLICT, EXIT_OK
    from tests.helpers import new_bucket, preloaded_context, preloaded_process

    url = f"s3://{new_bucket(s3_endpoint)}/runs/stream"
    with Publisher(url) as publisher:
        publisher.publish(random_state(0), version=0).result()
    numbered = preloaded_context().Barrier(4)
    racers = [preloaded_process(_publish_racing, url, seed, numbered) for seed in (1, 2, 3, 4)]
    for racer in racers:
        racer.start()
    for racer in racers:
        racer.join(300)
    codes = [racer.exitcode for racer in racers]
    assert sorted(codes) == [EXIT_OK] + [EXIT_CONFLICT] * 3, codes
    stream = Stream(url)
    assert stream.versions() == [0, 3]
    stream.verify(3)
    winner = (1, 2, 3, 4)[codes.index(EXIT_OK)]
    assert_same_tensors(dict(stream.iter_tensors(3)), random_state(winner))


def test_assets_are_fixed_at_stream_creation(local_url, tiny_model):
    with Publisher(local_url, assets=tiny_model):
        pass
    stream = Stream(local_url)
    assert {a.name for a in stream.info().assets} == {"config.json", "generation_config.json",
                                                       "ckptstream_tiny_model.json"}
    with pytest.raises(IncompatibleStreamError, match="config.json"):
        Publisher(local_url, assets={"config.json": b"{\"other\": 1}"})


def test_stage_returns_before_the_snapshot_and_commits_in_order(local_url):
    """``stage`` keeps the snapshot future apart from the commit future: the trainer may go on at once and
    waits on ``staged`` only before it changes the tensors."""
    release = threading.Event()
    state = random_state(0)

    def slow_tensors():
        release.wait(30)  # the snapshot cannot finish before the test lets it
        yield from state.items()

    with Publisher(local_url) as publisher:
        first = publisher.stage(slow_tensors(), step=0)
        second = publisher.stage(state, step=1)
        assert (first.version, second.version) == (0, 1)
        assert not first.staged.done() and not first.committed.done()
        release.set()
        first.staged.result(timeout=30)
        assert first.committed.result(timeout=30).version == 0
        assert second.committed.result(timeout=30).version == 1
    assert Stream(local_url).versions() == [0, 1]


def test_a_failed_staged_snapshot_raises_on_both_futures(local_url):
    with Publisher(local_url) as publisher:
        publisher.publish(random_state(0)).result()
        bad = publisher.stage({"__metadata__": torch.zeros(2)})
        with pytest.raises(ValueError, match="reserved"):
            bad.staged.result(timeout=30)
        with pytest.raises(ValueError, match="reserved"):
            bad.committed.result(timeout=30)
        assert publisher.publish(random_state(1)).result().version == 1  # the failed number is free again


def test_stage_and_publish_mixed_commit_in_version_order(local_url):
    """A ``publish`` after a ``stage`` whose snapshot is still running waits for it: versions are committed
    in the order they were numbered, so every delta's base is older than itself."""
    release = threading.Event()
    state = random_state(0)

    def slow_tensors():
        release.wait(30)
        yield from state.items()

    with Publisher(local_url, max_in_flight=2) as publisher:
        staged = publisher.stage(slow_tensors())
        threading.Timer(0.5, release.set).start()
        published = publisher.publish(rl_like_step_copy(state))
        assert staged.committed.result(timeout=30).version == 0
        assert published.result(timeout=30).base_version in (None, 0)
    stream = Stream(local_url)
    assert [stream.verify(v).version for v in stream.versions()] == [0, 1]


def rl_like_step_copy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    changed = {name: tensor.clone() for name, tensor in state.items()}
    rl_like_step(changed, fraction=0.05, generator=torch.Generator().manual_seed(3))
    return changed
