"""What the follower cache trusts: a root private to its user, and cached versions proven against their
manifests before they are reused (cheaply by their proof, else by every tensor's hash)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from ckptstream import Publisher, Stream
from ckptstream.errors import CkptStreamError
from ckptstream.format import MARKER_FILE
from ckptstream.testing.models import rl_like_step
from ckptstream.vllm_loader import VersionCache
from ckptstream.vllm_loader.follow.cache import PROOF_FILE, default_cache_dir
from tests.helpers import random_state

NOBODY = 65534


@pytest.fixture
def stream(tmp_path):
    """Versions 0 (a keyframe) and 1 (a delta)."""
    url = str(tmp_path / "stream")
    state = random_state(0)
    with Publisher(url) as publisher:
        publisher.publish(state).result()
        rl_like_step(state, fraction=0.05, generator=torch.Generator().manual_seed(3))
        publisher.publish(state).result()
    return Stream(url)


class _CountedChecks:
    """Counts the full checks (every tensor's hash) of a stream's cached copies."""

    def __init__(self, stream: Stream):
        self.calls = 0
        check = stream.check_materialized

        def counted(directory, version):
            self.calls += 1
            return check(directory, version)

        stream.check_materialized = counted  # type: ignore[method-assign]


def _prepare(stream: Stream, root: Path, version: int) -> tuple[Path, bool]:
    with VersionCache(root, stream.info().stream_id, "t") as cache:
        path, _, _, decoded = cache.acquire(stream, version, keep=set(), holder="t")
        stream.check_materialized(path, version)  # what it hands to vLLM is the committed version
        return path, decoded


def test_the_default_root_is_the_users_own_and_a_new_root_is_private(tmp_path, stream):
    assert str(os.getuid()) in default_cache_dir().name or default_cache_dir().is_relative_to(Path.home())
    root = tmp_path / "new" / "cache"
    VersionCache(root, stream.info().stream_id).close()
    assert root.stat().st_mode & 0o777 == 0o700


@pytest.mark.skipif(os.getuid() != 0, reason="giving a directory to another user needs root")
def test_a_root_of_another_user_or_that_others_may_write_to_is_refused(tmp_path, stream):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o1777)  # (as /dev/shm itself)
    with pytest.raises(CkptStreamError, match="no other user may write to") as refused:
        VersionCache(shared, stream.info().stream_id)
    assert str(shared) in str(refused.value) and "--cache-dir" in refused.value.hint
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(CkptStreamError, match="owner uid 65534"):
        VersionCache(theirs, stream.info().stream_id)
    assert not list(theirs.iterdir())  # nothing written there


def test_a_planted_version_is_decoded_again_not_reused(tmp_path, stream):
    root = tmp_path / "cache"
    v0, _ = _prepare(stream, root, 0)
    planted = v0.parent / "000000000001"
    shutil.copytree(v0, planted)  # version 0's tensors...
    marker = json.loads((planted / MARKER_FILE).read_text())
    marker.update(version=1, manifest_hash=stream.manifest(1).manifest_hash)  # ...claiming to be version 1
    (planted / MARKER_FILE).write_text(json.dumps(marker))
    path, decoded = _prepare(stream, root, 1)
    assert path == planted and decoded
    # A copy whose marker does not even claim the committed manifest is decoded again too.
    shutil.rmtree(planted)
    shutil.copytree(v0, planted)
    assert _prepare(stream, root, 1)[1]


def test_a_proven_copy_is_reused_after_a_stat_and_a_changed_one_is_checked(tmp_path, stream):
    root = tmp_path / "cache"
    path, decoded = _prepare(stream, root, 1)
    assert decoded and (path / PROOF_FILE).is_file()
    checks = _CountedChecks(stream)
    assert _prepare(stream, root, 1)[1] is False and checks.calls == 1  # (only _prepare's own check)
    weights = path / "model.safetensors"
    os.utime(weights)  # touched, not changed: checked once, proven again
    assert _prepare(stream, root, 1)[1] is False and checks.calls == 3
    assert _prepare(stream, root, 1)[1] is False and checks.calls == 4
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # damaged: checked, refused, decoded again
    weights.write_bytes(bytes(data))
    assert _prepare(stream, root, 1)[1] is True
