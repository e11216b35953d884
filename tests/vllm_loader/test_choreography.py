"""Follower choreography against fake servers (``ckptstream.testing.fake_vllm``), in milliseconds.

What real vLLM servers prove end to end (test_follower.py, test_serve_replay.py), these check for the
paths a real server cannot safely produce (a reload failing half-way), for the cache's ownership rules
and the takeover protocol between processes, and for memory over thousands of versions.
"""

from __future__ import annotations

import gc
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

from ckptstream import Publisher
from ckptstream.errors import VllmError
from ckptstream.format import MARKER_FILE, Manifest
from ckptstream.reader.stream import MANIFEST_CACHE_SIZE
from ckptstream.testing.fake_vllm import FakeVllmClient
from ckptstream.vllm_loader import Follower, FollowerConfig, Takeover, VersionCache, replay
from ckptstream.reader.replicas import REFUSED_KEPT
from ckptstream.vllm_loader.serve import default_vllm_settings, vllm_platform_is_cpu
from ckptstream.vllm_loader.vllm_child import last_error_line
from ckptstream.vllm_loader.follow.takeover import lock_path
from tests.helpers import preloaded_context, preloaded_process


def _state(step: int = 0) -> dict[str, torch.Tensor]:
    weight = torch.zeros(16, dtype=torch.bfloat16)
    weight[step % 16] = float(step)
    return {"w": weight, "b": torch.full((4,), float(step))}


@pytest.fixture
def stream(tmp_path: Path):
    """A local stream of three versions (0 a keyframe, 1 and 2 deltas) and its publisher."""
    url = str(tmp_path / "stream")
    publisher = Publisher(url, keyframe_every=1000)
    for step in range(3):
        publisher.publish(_state(step)).result()
    yield url, publisher
    publisher.close()


def test_follower_takes_fake_clients_and_a_config(stream, tmp_path):
    url, _ = stream
    server = FakeVllmClient()
    config = FollowerConfig(cache_dir=tmp_path / "cache", poll_interval=0.01)
    with Follower(url, [server], config, replica_id="fake") as follower:
        assert follower.config.replica_id == "fake" and follower.poll_interval == 0.01
        update = follower.step()
    assert update is not None and update.version == 2
    assert server.weight_version_label == "2" and server.loaded_version == 2
    # The lag's parts: committed before the follower looked; the server's pause, then its checks.
    assert 0 < update.found_s < update.lag_s and 0 < update.pause_s < update.servers_s < update.lag_s
    assert [c for c, _ in server.calls][-9:] == ["pause", "reload_weights", "reset_prefix_cache", "set_weight_version",
                                                 "resume", "check_resumed", "check_weight_version", "probe",
                                                 "prepare_in_place"]
    with pytest.raises(TypeError, match="unknown follower option"):
        Follower(url, [server], cache_dir=tmp_path / "cache", polling=3)


def test_the_change_is_offered_to_the_servers_unless_reload_only(stream, tmp_path):
    url, publisher = stream
    offered, reloading = FakeVllmClient(), FakeVllmClient()
    with Follower(url, [offered], cache_dir=tmp_path / "a", replica_id="offered") as follower, \
            Follower(url, [reloading], cache_dir=tmp_path / "b", replica_id="reloading", apply_in_place=False) as other:
        assert follower.step().fallbacks == {"first_version": 1} and other.step().fallbacks == {"disabled": 1}
        state = _state(2)
        state["w"][0] = 7.0  # one element of 20
        publisher.publish(state).result()
        update, plain = follower.step(), other.step()
    # The fake has no parameters: it refuses the staging, and the version is reloaded; said once, counted.
    (change,) = offered.calls_of("stage_change")
    assert Path(change).name == "000000000002-000000000003.safetensors"
    assert update.fallbacks == {"no_extension": 1} and update.applied_in_place == 0 and offered.loaded_version == 3
    assert reloading.calls_of("stage_change") == [] and plain.fallbacks == {"disabled": 1}
    assert reloading.loaded_version == 3
    # Its workers are asked to trace their loaders on what they serve after a full reload (the first change then
    # stages without tracing): once here, as it refused (no extension); a server that reloads only is not.
    assert [Path(p).name for p in offered.calls_of("prepare_in_place")] == ["000000000002"]
    assert reloading.calls_of("prepare_in_place") == []
    with Follower(url, [offered], cache_dir=tmp_path / "a", replica_id="offered") as follower:
        follower.adopt(3)
        assert Path(offered.calls_of("prepare_in_place")[-1]).name == "000000000003"  # (a follower restarted)
        publisher.publish(_state(9)).result()  # 7 of 20 elements: more than a patch is worth
        assert follower.step().fallbacks == {"large_change": 1} and len(offered.calls_of("stage_change")) == 1


def test_workers_trace_their_loaders_after_each_full_reload_and_a_restart(stream, tmp_path):
    """A server whose version arrived by a full reload (the first one; a restart brought back) is asked to trace its
    loaders on it while it serves, so that its first change stages without tracing."""
    url, _ = stream
    server = FakeVllmClient(in_place=True)
    with Follower(url, [server], cache_dir=tmp_path / "cache", replica_id="traced") as follower:
        assert follower.step().fallbacks == {"first_version": 1}
        assert [Path(p).name for p in server.calls_of("prepare_in_place")] == ["000000000002"]
        server.restart()
        assert follower.step() is None and server.loaded_version == 2  # (reconciled: the current version again)
        assert [Path(p).name for p in server.calls_of("prepare_in_place")] == ["000000000002"] * 2


def test_each_delta_is_read_once_per_update_and_the_update_reports_what_it_read(stream_url, tmp_path):
    """Two deltas since the served version: the change is built from them (offered to the server, which
    refuses it), then the version is decoded from the same deltas, kept in memory meanwhile; what the update
    reports fetched is what it read from storage, each delta's file once, as a plain reload reads."""
    from ckptstream import Stream
    from ckptstream.format import manifest_path
    from ckptstream.storage import open_storage

    state = {"w": torch.zeros(4096, dtype=torch.bfloat16)}
    with Publisher(stream_url, keyframe_every=1000) as publisher:
        publisher.publish(state).result()
        offered, reloading = FakeVllmClient(), FakeVllmClient()
        with Follower(stream_url, [offered], cache_dir=tmp_path / "a", replica_id="offered") as follower, \
                Follower(stream_url, [reloading], cache_dir=tmp_path / "b", replica_id="reloading",
                         apply_in_place=False) as other:
            follower.step(), other.step()
            for step in (1, 2):
                state["w"][step] = 1.0  # one element of 4096
                publisher.publish(state).result()
            storage, reader = open_storage(stream_url), Stream(stream_url)
            expected = sum(reader.manifest(v).stored_bytes + storage.size(manifest_path(v)) for v in (1, 2))
            update, plain = follower.load(2), other.load(2)
    assert offered.calls_of("stage_change") and update.fallbacks == {"no_extension": 1}
    assert update.bytes_fetched == plain.bytes_fetched == expected
    assert follower.stream._kept.kept_bytes == 0  # nothing kept past the update


def test_failed_reload_on_one_server_reverts_both_and_refuses_the_version(stream, tmp_path):
    """A reload that fails half-way cannot be caused safely on a real server (its engine may die)."""
    url, publisher = stream
    first, second = FakeVllmClient(), FakeVllmClient()
    follower = Follower(url, [first, second], cache_dir=tmp_path / "cache", replica_id="two")
    assert follower.step().version == 2
    publisher.publish(_state(3)).result()
    second.fail("reload_weights", VllmError("reload failed half-way"))
    assert follower.step() is None
    assert "reload failed half-way" in follower.refused[3]
    assert list(first.reloaded)[-2:] == [3, 2]  # took the update, then got the last good version back
    assert second.calls_of("reload_weights")[-2:] == [str(follower.cache.path(3)), str(follower.cache.path(2))]
    assert (first.loaded_version, second.loaded_version) == (2, 2)
    assert first.weight_version_label == second.weight_version_label == "2"
    assert not first.paused and not second.paused
    follower.close()


# ------------------------------------------------------------------------------------ cache ownership


def test_a_follower_and_a_replay_of_one_stream_share_the_cache_without_deleting_each_others(stream, tmp_path):
    """The defect of a shared <root>/<stream id>/ before: followers pruned each other's versions and the
    reader's temporary names (a replay beside serve failed with 'No such file or directory: .../.tmp-...').
    Now the versions are shared, and each follower's holds keep them (adapted from the per-owner layout)."""
    url, publisher = stream
    root = tmp_path / "shared-root"
    serving = Follower(url, [FakeVllmClient()], cache_dir=root, replica_id="serving")
    assert serving.step().version == 2
    kept = serving.cache.path(2)
    foreign_temp = serving.cache.stream_dir / ".tmp-0123456789abcdef-v-reader"  # the reader's: never ours to delete
    foreign_temp.mkdir()
    replaying = Follower(url, [FakeVllmClient()], cache_dir=root, replica_id="replay-1", ephemeral_cache=True)
    decoded = {}
    for version in (0, 1, 2, 0):
        decoded[version] = replaying.load(version).decoded
        assert (kept / MARKER_FILE).is_file(), f"loading {version} elsewhere removed the serving follower's copy"
    assert decoded == {0: True, 1: True, 2: False}  # 2: the serving follower's copy, reused
    assert serving.cache.path(2) == replaying.cache.path(2)
    publisher.publish(_state(3)).result()
    assert serving.step().version == 3
    assert replaying.cache.held() == {0} and serving.cache.held() == {3}
    assert serving.cache.versions() == [0, 3]
    assert foreign_temp.is_dir()
    replaying.close()
    assert serving.cache.versions() == [3]  # ephemeral: what only the replay held is deleted when it closes
    serving.close()
    assert serving.cache.versions() == [3]  # kept for a restarted follower to adopt


def _step_together(follower: Follower, barrier: threading.Barrier, updates: list) -> None:
    barrier.wait()  # all of them prepare the new version at once
    updates.append(follower.step())


def test_four_followers_of_one_stream_decode_each_version_once(stream, tmp_path):
    url, publisher = stream
    servers = [FakeVllmClient() for _ in range(4)]
    followers = [Follower(url, [server], cache_dir=tmp_path / "cache", replica_id=f"f{i}")
                 for i, server in enumerate(servers)]
    decodes: dict[int, int] = {}
    for round_ in range(4):
        if round_:
            publisher.publish(_state(2 + round_)).result()
        barrier = threading.Barrier(len(followers))
        updates: list = []
        threads = [threading.Thread(target=_step_together, args=(f, barrier, updates)) for f in followers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert len(updates) == 4 and {u.version for u in updates} == {2 + round_}
        decodes[2 + round_] = sum(u.decoded for u in updates)
        assert {s.loaded_version for s in servers} == {2 + round_}
        assert len({s.calls_of("reload_weights")[-1] for s in servers}) == 1  # one path for all
    assert decodes == {2: 1, 3: 1, 4: 1, 5: 1}
    assert followers[0].cache.versions() == [5]  # the old ones were deleted once nobody held them
    for follower in followers:
        follower.close()


def _hold_version(root: str, version: int, ready) -> None:
    """In a child: hold ``version`` of a cache (as a follower serving it does), until SIGKILLed."""
    cache = VersionCache(root, "sid", "holder")
    cache.hold(version)
    ready.put(sorted(cache.held()))
    time.sleep(120)  # killed before


def _fake_version(cache: VersionCache, version: int) -> None:
    cache.path(version).mkdir()
    (cache.path(version) / MARKER_FILE).write_text("{}")


def test_a_pruner_never_deletes_a_version_another_process_holds_and_a_killed_holder_blocks_nobody(tmp_path):
    pruner = VersionCache(tmp_path, "sid", "pruner")
    for version in (1, 2, 3):
        _fake_version(pruner, version)
    ready = preloaded_context().Queue()
    holder = preloaded_process(_hold_version, str(tmp_path), 2, ready)
    holder.start()
    try:
        assert ready.get(timeout=60) == [2]
        assert pruner.hold(3)
        pruner.prune({3})
        assert pruner.versions() == [2, 3]  # 1 was nobody's; 2 is the other process's
        pruner.prune(set())
        assert pruner.versions() == [2] and pruner.held() == set()
    finally:
        holder.kill()  # SIGKILL: no cleanup, the kernel drops its locks
        holder.join()
    pruner.prune(set())
    assert pruner.versions() == []
    assert sorted(p.name for p in pruner.stream_dir.iterdir()) == [".locks"]
    assert list((pruner.stream_dir / ".locks").iterdir()) == []  # no lock file left per version
    pruner.close()


def test_followers_of_different_streams_in_one_root_do_not_interfere(tmp_path):
    root = tmp_path / "cache"
    urls, publishers = [str(tmp_path / "a"), str(tmp_path / "b")], []
    for url in urls:
        publishers.append(Publisher(url, keyframe_every=1000))
        publishers[-1].publish(_state(0)).result()
    servers = [FakeVllmClient(), FakeVllmClient()]
    a, b = (Follower(url, [server], cache_dir=root, replica_id=f"r{i}")
            for i, (url, server) in enumerate(zip(urls, servers)))
    assert a.step().decoded and b.step().decoded  # the same version number, each its own stream's
    assert a.cache.path(0) != b.cache.path(0)
    for step in (1, 2):
        publishers[0].publish(_state(step)).result()
        assert a.step().version == step
    assert b.cache.versions() == [0] and a.cache.versions() == [2]
    assert b.step() is None and servers[1].loaded_version == 0
    for follower, publisher in zip((a, b), publishers):
        follower.close()
        publisher.close()


def test_old_per_follower_directories_are_removed_once_their_follower_is_gone(tmp_path):
    stream_dir = tmp_path / "sid"
    for name in ("old-follower", "live-follower"):
        (stream_dir / name / "000000000003").mkdir(parents=True)
        (stream_dir / name / ".lock").touch()
    from ckptstream.locks import try_lock, unlock

    live = try_lock(stream_dir / "live-follower" / ".lock")  # as a follower of the previous release holds it
    try:
        VersionCache(tmp_path, "sid").close()
        assert not (stream_dir / "old-follower").exists() and (stream_dir / "live-follower").is_dir()
    finally:
        unlock(live)


# ------------------------------------------------------------------------------------------ takeover


def test_a_follower_stands_aside_while_its_server_is_taken_over(stream, tmp_path):
    url, publisher = stream
    server = FakeVllmClient()
    follower = Follower(url, [server], cache_dir=tmp_path / "cache", replica_id="serve")
    assert follower.step().version == 2
    taker = Takeover([server.url])
    try:
        server.calls.clear()
        publisher.publish(_state(3)).result()
        assert follower.step() is None
        assert list(server.calls) == []  # not even a look at the server
        server.set_weight_version("0")  # what the taker loads
    finally:
        taker.release()
    update = follower.step()  # reconciled (its version again), then the newer one
    assert update is not None and update.version == 3
    assert list(server.reloaded)[-2:] == [2, 3]
    assert server.weight_version_label == "3"
    follower.close()


def test_a_server_has_one_takeover_lock_whatever_the_spelling_of_its_url():
    same = {lock_path(u) for u in ("http://127.0.0.1:8000", "http://localhost:8000/", "HTTP://LOCALHOST:8000")}
    assert len(same) == 1
    assert lock_path("http://127.0.0.1:8001") not in same
    assert lock_path("http://example:80") == lock_path("http://example")


def test_replay_takes_the_server_over_and_the_follower_brings_it_back(stream, tmp_path):
    url, publisher = stream
    server = FakeVllmClient()
    follower = Follower(url, [server], cache_dir=tmp_path / "cache", replica_id="serve", poll_interval=0.02)
    stop = threading.Event()
    runner = threading.Thread(target=follower.run, args=(stop,))
    runner.start()
    try:
        _wait(lambda: server.weight_version_label == "2")
        server.calls.clear()
        before = len(server.reloaded)
        marker = tmp_path / "replay-started"
        command = [sys.executable, "-c",
                   f"import pathlib, time; pathlib.Path({str(marker)!r}).touch(); time.sleep(0.3)"]
        racing = threading.Thread(target=lambda: (_wait(marker.exists), publisher.publish(_state(3)).result()))
        racing.start()
        results = replay(url, "0:2", [server], command, cache_dir=tmp_path / "cache")
        racing.join()
        assert [(r.version, r.exit_code) for r in results] == [(0, 0), (1, 0), (2, 0)]
        _wait(lambda: server.weight_version_label == "3")  # back, on the version published meanwhile
        paths = server.calls_of("reload_weights")
        assert list(server.reloaded)[before:] == [0, 1, 2, 3]
        # The replay's three, then (only after it ended) the follower's: nobody else reloaded meanwhile.
        # (The cache is shared now: a version has one path whoever loads it; adapted from the replay's own.)
        assert paths == [str(follower.cache.path(v)) for v in (0, 1, 2, 3)]
        _wait(lambda: follower.cache.versions() == [3])  # the replay's versions are gone
    finally:
        stop.set()
        follower.wake.set()
        runner.join(timeout=30)
        follower.close()


def _wait(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


# --------------------------------------------------------------------------------------------- memory


def _held() -> tuple[int, int, int]:
    """Live manifests, live gc-tracked objects, resident set size (bytes)."""
    gc.collect()
    objects = gc.get_objects()
    with open("/proc/self/statm") as statm:
        rss = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return sum(type(o) is Manifest for o in objects), len(objects), rss


def test_a_follower_of_thousands_of_versions_holds_constant_memory(monkeypatch):
    """2 000 versions (tiny tensors, a keyframe every 8, every 13th misshapen and refused: more refusals
    than it remembers); what the follower holds after the first few hundred must not grow with the
    versions it steps through: the same number of manifests and objects, about the same RSS. Nor does
    it list the stream's manifests (O(versions) each) per update: only every ``list_every`` polls."""
    monkeypatch.setattr(logging.getLogger("ckptstream.follow"), "disabled", True)  # pytest keeps every record
    root = Path(tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    try:
        url = str(root / "stream")
        publisher = Publisher(url, keyframe_every=8)
        publisher.publish(_state(0)).result()
        server = FakeVllmClient(max_calls=64)
        follower = Follower(url, [server], cache_dir=root / "cache", replica_id="long", heartbeat_interval=3600)
        listings = []
        listing = follower.stream.versions
        monkeypatch.setattr(follower.stream, "versions", lambda: listings.append(1) or listing())
        for version in range(1, 2000):
            if version == 300:
                start = _held()
            if version % 13 == 0:
                publisher.publish({**_state(version), "b": torch.zeros(5)}, keyframe=True).result()
                assert follower.step() is None and "does not fit the served model" in follower.refused[version]
                continue
            publisher.publish(_state(version)).result()
            update = follower.step()
            assert update is not None and update.version == version
        manifests, objects, rss = _held()
        assert server.weight_version_label == "1999"
        refused = list(range(13, 2000, 13))[-REFUSED_KEPT:]
        assert list(follower.refused) == refused and set(follower.record.refused) == {str(v) for v in refused}
        assert manifests <= max(start[0], MANIFEST_CACHE_SIZE * 2), (start, manifests)
        assert objects - start[1] < 2000, (start, objects)  # one object per version would be 1 700
        assert rss - start[2] < 32 << 20, (start, rss)
        assert len(listings) <= 1999 / follower.list_every + 2, len(listings)  # one poll per version
        follower.close()
        publisher.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


# ------------------------------------------------------------------------------------------ vLLM start


def test_serve_passes_cpu_sized_settings_only_where_the_user_set_none(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    args, env, added = default_vllm_settings([], {}, tmp_path, cpu=True)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert args == ["--gpu-memory-utilization", "0.3", "--skip-tokenizer-init"]
    assert added == ["VLLM_CPU_KVCACHE_SPACE=1", "--gpu-memory-utilization 0.3", "--skip-tokenizer-init"]
    mine = ["--gpu-memory-utilization=0.5", "--kv-cache-memory-bytes", "1000000000"]
    (tmp_path / "tokenizer.json").write_text("{}")
    assert default_vllm_settings(mine, {}, tmp_path, cpu=True) == (mine, {}, [])
    assert default_vllm_settings([], {"VLLM_CPU_KVCACHE_SPACE": "4"}, tmp_path, cpu=True)[1] == \
        {"VLLM_CPU_KVCACHE_SPACE": "4"}
    assert default_vllm_settings(["--dtype", "bfloat16"], {}, tmp_path, cpu=False) == (["--dtype", "bfloat16"], {}, [])
    assert vllm_platform_is_cpu({"VLLM_TARGET_DEVICE": "cpu"})


def test_serve_gives_vllm_the_api_key_in_its_environment_not_its_command_line(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    assert default_vllm_settings(["--dtype", "bfloat16"], {}, tmp_path, cpu=False, api_key="s3cret") == \
        (["--dtype", "bfloat16"], {"VLLM_API_KEY": "s3cret"}, [])


def test_the_last_error_line_is_vllms_root_cause():
    worker = "(VllmWorker-0 pid=13880) ERROR 12-01 09:24:29 [multiproc_executor.py:953] "
    lines = [f"{worker}Traceback (most recent call last):\n", f"{worker}    raise ValueError(\n",
             f"{worker}ValueError: Available memory on node 0 (6.51/8.09 GiB) is less than desired\n",
             "(EngineCore pid=13730) ERROR 12-01 09:24:32 [core.py:1510] Exception: WorkerProc initialization "
             "failed due to an exception in a background process. See stack trace for root cause.\n",
             "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}\n"]
    assert last_error_line(lines) == "ValueError: Available memory on node 0 (6.51/8.09 GiB) is less than desired"
    pydantic = ["pydantic_core._pydantic_core.ValidationError: 1 validation error for CacheConfig\n",
                "gpu_memory_utilization\n", "  Input should be less than or equal to 1 [type=less_than_equal]\n",
                "    For further information visit https://errors.pydantic.dev/2.13/v/less_than_equal\n"]
    assert last_error_line(pydantic) == ("pydantic_core._pydantic_core.ValidationError: 1 validation error for "
                                         "CacheConfig; gpu_memory_utilization; Input should be less than or "
                                         "equal to 1 [type=less_than_equal]")
    assert last_error_line(["INFO starting\n", "Killed\n"]) == "Killed"
    assert last_error_line([]) is None


def _write_then_die(stream_url: str, root: str) -> None:
    """In a child: start decoding version 0 into a cache, and get SIGKILLed in the middle of writing it."""
    import signal

    from ckptstream.reader import materialize
    from ckptstream.reader.stream import Stream

    def die(*args: object, **kwargs: object) -> None:
        os.kill(os.getpid(), signal.SIGKILL)  # the kill is real; the patch only decides when it happens

    materialize._write_weights = die  # type: ignore[assignment]
    stream = Stream(stream_url)
    VersionCache(root, stream.info().stream_id, "killed").materialize(stream, 0, None)


def test_a_preparer_killed_while_writing_leaves_nothing_that_blocks_or_misleads_the_next(tmp_path):
    """What a preparer SIGKILLed in the middle of writing a version leaves is not a version, blocks no
    lock, and is removed by the next preparer of that version (or by a pruner)."""
    url = str(tmp_path / "stream")
    with Publisher(url) as publisher:
        publisher.publish({"w": torch.arange(1000, dtype=torch.float32)}).result()
    child = preloaded_process(_write_then_die, url, str(tmp_path / "c"))
    child.start()
    child.join(120)
    assert child.exitcode == -9
    from ckptstream.reader.stream import Stream

    stream = Stream(url)
    with VersionCache(tmp_path / "c", stream.info().stream_id, "next") as cache:
        assert [p.name for p in cache.stream_dir.iterdir() if p.name.startswith(".incoming-")] != []
        assert cache.versions() == []  # the leftover is not mistaken for a version
        path, decoded = cache.materialize(stream, 0, None)  # its locks were dropped: no waiting
        assert decoded and (path / MARKER_FILE).is_file() and cache.versions() == [0]
        assert sorted(p.name for p in cache.stream_dir.iterdir()) == [".locks", "000000000000"]
        with VersionCache(tmp_path / "c", stream.info().stream_id, "other") as other:
            other.prune(set())
        assert cache.versions() == [0]  # held by the first cache: not pruned
    with VersionCache(tmp_path / "c", stream.info().stream_id, "pruner") as cache:
        cache.prune(set())
        assert sorted(p.name for p in cache.stream_dir.iterdir()) == [".locks"]


def test_a_replica_id_that_cannot_name_a_record_is_refused_at_once(tmp_path):
    url = str(tmp_path / "stream")
    Publisher(url).close()
    with pytest.raises(ValueError, match="replica id"):
        Follower(url, [FakeVllmClient()], cache_dir=str(tmp_path / "c"), replica_id="a b")


def test_the_takeover_directory_must_be_private(tmp_path, monkeypatch):
    from ckptstream.errors import CkptStreamError

    shared = tmp_path / "runtime"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)  # as another local user could have made it
    monkeypatch.setenv("CKPTSTREAM_RUNTIME_DIR", str(shared))
    with pytest.raises(CkptStreamError, match="private"):
        Takeover(["http://127.0.0.1:8000"])


def test_a_follower_standing_aside_does_not_count_as_serving_the_stream(stream, tmp_path):
    """While a replay drives its server, the follower's record says ``aside``: a trainer bounding staleness
    with ``wait_for_version`` must not count a server that serves old versions for someone else."""
    from ckptstream.reader.stream import Stream

    url, _ = stream
    server = FakeVllmClient()
    with Follower(url, [server], cache_dir=tmp_path / "cache", replica_id="serve") as follower:
        assert follower.step().version == 2
        assert [r.replica_id for r in Stream(url).wait_for_version(2, timeout=5)] == ["serve"]
        with Takeover([server.url]):
            assert follower.step() is None
            assert [r.state for r in Stream(url).replicas()] == ["aside"]
            with pytest.raises(TimeoutError):
                Stream(url).wait_for_version(2, timeout=0.3, poll_interval=0.1)
        follower.step()
        assert [(r.state, r.version) for r in Stream(url).replicas()] == [("serving", 2)]
        assert [r.replica_id for r in Stream(url).wait_for_version(2, timeout=5)] == ["serve"]


def test_follower_holds_a_lease_named_by_its_replica_id_while_it_fetches(stream, tmp_path):
    """The follower's pull holds a lease ``follower <replica id>`` with its configured TTL, released after."""
    from ckptstream.reader import read_leases
    from ckptstream.storage import PosixStorage
    from tests.helpers import watch_leases

    url, _ = stream
    watched, seen = watch_leases(url)
    with Follower(watched, [FakeVllmClient()], cache_dir=tmp_path / "cache", replica_id="node7-8000",
                  lease_ttl=30.0) as follower:
        assert follower.step().version == 2
    assert seen and set(seen) == {("follower node7-8000", 2, 30.0)}
    assert read_leases(PosixStorage(url)).records == []


def test_weights_followers_and_engines_refuse_an_adapter_stream(tmp_path):
    from ckptstream.errors import StreamKindError
    from ckptstream.testing.adapters import write_tiny_adapter
    from ckptstream.testing.models import TinyModelSpec, write_tiny_model
    from ckptstream.vllm_loader.follow.agent import NodeAgent
    from ckptstream.writer.adapter import peft_dir_source

    base = write_tiny_model(tmp_path / "base", TinyModelSpec())
    peft_dir = write_tiny_adapter(tmp_path / "adapter", base)
    url = str(tmp_path / "adapters")
    with Publisher(url, adapter_of=peft_dir_source(peft_dir)) as publisher:
        publisher.publish().result()
    with pytest.raises(StreamKindError, match="adapter"):
        Follower(url, [FakeVllmClient()], cache_dir=tmp_path / "cache")
    with pytest.raises(StreamKindError, match="adapter"):
        NodeAgent(url, engine="engine", node_rank=1, nnodes=2, cache_dir=tmp_path / "cache")


def test_following_a_version_asks_the_cache_once_for_it_and_once_to_let_go_of_the_rest(tmp_path):
    """The follower asks the cache for intentions ("a proven copy of version V, held for me", "keep only these"),
    not for the steps behind them (hold, proof, decode, release): per version it follows, one call for the
    version, one to let go of the others, and one for the change where it is applied in place."""
    url = str(tmp_path / "stream")
    weight = torch.zeros(4096, dtype=torch.bfloat16)  # large enough to be stored as a delta
    calls: list[str] = []
    depth = [0]  # calls into the cache under way: what the cache calls itself is not counted
    stateful = ["acquire", "acquire_cached", "hold", "release", "proven", "materialize", "prune", "change",
                "versions"]
    with Publisher(url, keyframe_every=1000) as publisher:
        publisher.publish({"w": weight}).result()
        for apply_in_place in (False, True):
            with Follower(url, [FakeVllmClient()], cache_dir=tmp_path / f"cache-{apply_in_place}",
                          apply_in_place=apply_in_place) as follower:
                follower.step()
                for name in stateful:  # counted where the follower calls them, not where the cache calls itself
                    method = getattr(follower.cache, name)

                    def counted(*args, _method=method, _name=name, **kwargs):
                        if not depth[0]:
                            calls.append(_name)
                        depth[0] += 1
                        try:
                            return _method(*args, **kwargs)
                        finally:
                            depth[0] -= 1

                    setattr(follower.cache, name, counted)
                weight[int(apply_in_place)] = 1.0  # one element changed
                publisher.publish({"w": weight}).result()
                calls.clear()
                update = follower.step()
                assert update is not None and update.version == follower.current
                expected = ["change", "acquire", "prune"] if apply_in_place else ["acquire", "prune"]
                assert calls == expected, apply_in_place
