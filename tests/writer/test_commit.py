"""Stream creation and the commit of a manifest: lost commit responses (a real proxy in front of the S3
server), one's own link on POSIX, reserved asset and tensor names, strict metadata, and a first publish
that fails before its tensors were taken leaving nothing behind."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import pytest
import torch

from ckptstream import IncompatibleStreamError, Publisher, PublishError, Stream, VersionConflictError
from ckptstream.cli import main
from ckptstream.format import MAX_ASSET_BYTES, MAX_JSON_DEPTH, STREAM_FILE, FileEntry, StreamInfo, content_hash
from ckptstream.storage import PosixStorage, open_storage
from ckptstream.writer import PublisherConfig, open_or_create_stream
from ckptstream.writer.commit import commit_manifest
from tests.helpers import assert_same_tensors, random_state, s3_refusing_every_put
from ckptstream.testing.lossy_proxy import LossyProxy

MANIFEST_KEY = r"/manifests/[0-9]{12}\.json$"


# ------------------------------------------------------------------------------- lost commit responses

@pytest.mark.parametrize("mode", ["500", "reset"])
def test_lost_response_to_the_commit_put_is_not_a_conflict(s3_endpoint, mode):
    """The server stores the manifest but its answer is lost; botocore retries the PUT, the retry gets
    412 (the object exists): the publisher must recognise its own commit instead of reporting a conflict."""
    from tests.helpers import new_bucket

    url = f"s3://{new_bucket(s3_endpoint)}/run"
    state = random_state(0)
    with LossyProxy(s3_endpoint, MANIFEST_KEY, mode=mode) as proxy:
        with Publisher(url, storage_options={"endpoint_url": proxy.url}) as publisher:
            manifest = publisher.publish(state).result()
            rl_state = random_state(0)
            rl_state["steps"] += 1
            assert publisher.publish(rl_state).result().version == 1  # the publisher goes on normally
    assert manifest.version == 0
    puts = [status for method, path, status in proxy.seen if method == "PUT" and re.search(MANIFEST_KEY, path)]
    assert puts[:2] == [None if mode == "reset" else 500, 412]  # the retry found the stored manifest
    stream = Stream(url)  # straight to the server, not through the proxy
    assert stream.versions() == [0, 1]
    assert stream.manifest(0).writer["id"] == manifest.writer["id"]
    assert_same_tensors(dict(stream.iter_tensors(0)), state)
    stream.verify(1)


@pytest.mark.parametrize("mode", ["500", "reset"])
def test_cli_publish_whose_commit_answer_is_lost_exits_0(s3_endpoint, tiny_model, mode, capsys):
    """`ckptstream publish` onto an existing stream through a proxy that forwards the manifest PUT and then
    answers 500 or closes the connection: botocore's retry gets 412, the read-back finds this writer's bytes
    (not the listing the publisher cached when it numbered the version), so the version is committed and
    the command exits 0. Another writer of that version, whose answer is lost too, gets a real conflict, and
    publishing that version again exits 5."""
    from tests.helpers import new_bucket

    url = f"s3://{new_bucket(s3_endpoint)}/run"
    publish = ["publish", url, "--from-hf", str(tiny_model), "--cache-dir", ""]
    assert main(publish) == 0  # version 0, straight to the server
    with LossyProxy(s3_endpoint, MANIFEST_KEY, mode=mode) as proxy:
        assert main([*publish, "--keyframe", "-o", f"endpoint_url={proxy.url}"]) == 0
    stream = Stream(url)  # straight to the server, not through the proxy
    assert stream.versions() == [0, 1]
    stream.verify(1)
    ours = stream.manifest(1)
    other = dataclasses.replace(ours, writer={**ours.writer, "id": "0123456789ab"})
    with LossyProxy(s3_endpoint, MANIFEST_KEY, mode=mode) as other_proxy:
        storage = open_storage(url, {"endpoint_url": other_proxy.url})
        storage.list("manifests")  # as the publisher numbering version 1 did: no cached listing may answer
        with pytest.raises(VersionConflictError, match="another writer committed this version first"):
            commit_manifest(storage, other)
    lost = None if mode == "reset" else 500
    for seen in (proxy.seen, other_proxy.seen):  # the retry of each lost PUT met the stored manifest
        assert [status for method, path, status in seen if method == "PUT" and re.search(MANIFEST_KEY, path)] == [
            lost, 412]
    capsys.readouterr()
    assert main([*publish, "--version", "1"]) == 5
    assert "version 1 is not newer than the latest version 1" in capsys.readouterr().err
    assert Stream(url).manifest(1).to_bytes() == ours.to_bytes()


def test_commit_put_failing_after_the_server_stored_it_is_a_commit(s3_endpoint):
    """Every answer to the commit PUT is lost and the retries run out: the PUT fails, but the manifest read
    back is this writer's, so the version is committed."""
    from tests.helpers import new_bucket

    url = f"s3://{new_bucket(s3_endpoint)}/run"
    with LossyProxy(s3_endpoint, MANIFEST_KEY, losses=100) as proxy:
        options = {"endpoint_url": proxy.url, "config_kwargs": {"retries": {"max_attempts": 1}}}
        with Publisher(url, storage_options=options) as publisher:
            assert publisher.publish(random_state(0)).result().version == 0
    assert len(proxy.lost) >= 1
    Stream(url).verify(0)


def test_commit_put_that_never_reached_the_server_fails(s3_endpoint):
    from tests.helpers import new_bucket

    url = f"s3://{new_bucket(s3_endpoint)}/run"
    with LossyProxy(s3_endpoint, MANIFEST_KEY, losses=100, forward=False) as proxy:
        options = {"endpoint_url": proxy.url, "config_kwargs": {"retries": {"max_attempts": 1}}}
        publisher = Publisher(url, storage_options=options)
        with pytest.raises(PublishError, match="version 0"):
            publisher.publish(random_state(0)).result()
        with pytest.raises(PublishError):
            publisher.close()
    assert Stream(url).versions() == []


class _LinkAnsweredTwice(PosixStorage):
    """A mock of a fault that cannot be caused on a local disk: NFS answers a retransmitted LINK request
    whose first reply was lost with EEXIST, although the link is the caller's own."""

    def put_if_absent(self, path: str, data: bytes) -> None:
        super().put_if_absent(path, data)
        raise FileExistsError(17, "File exists", path)


def test_link_eexist_for_ones_own_link_is_a_commit(local_url):
    with Publisher(local_url) as publisher:
        manifest = publisher.publish(random_state(0)).result()
    storage = _LinkAnsweredTwice(local_url)
    ours = dataclasses.replace(manifest, version=1, keyframe_version=1, created="2026-12-01T00:00:00.000Z")
    commit_manifest(storage, ours)  # no error: the manifest read back is ours
    assert Stream(local_url).manifest(1).to_bytes() == ours.to_bytes()


def test_someone_elses_manifest_is_a_conflict(local_url):
    with Publisher(local_url) as publisher:
        manifest = publisher.publish(random_state(0)).result()
    other = dataclasses.replace(manifest, writer={"id": "0123456789ab"})
    with pytest.raises(VersionConflictError, match="another writer committed this version first"):
        commit_manifest(open_storage(local_url), other)
    assert Stream(local_url).manifest(0).to_bytes() == manifest.to_bytes()


def test_commit_manifest_commits_a_version_with_its_own_stream_id(local_url, tmp_path):
    """What mirror and import do: commit a version whose stream_id and data files already exist."""
    with Publisher(local_url) as publisher:
        manifest = publisher.publish(random_state(0)).result()
    copy = tmp_path / "copy"
    storage = open_storage(str(copy))
    info = open_or_create_stream(storage, {}, stream_id=manifest.stream_id)
    assert info.stream_id == manifest.stream_id
    for entry in manifest.files:
        path = f"versions/000000000000/{entry.name}"
        storage.put(path, open_storage(local_url).read(path))
    commit_manifest(storage, manifest)
    Stream(str(copy)).verify(0)
    with pytest.raises(IncompatibleStreamError, match="stream_id"):
        open_or_create_stream(storage, {}, stream_id="f" * 32)


# ------------------------------------------------------------------------------------- names and metadata

@pytest.mark.parametrize("name", ["model.safetensors", "model-00001-of-00002.safetensors", "pytorch_model.bin",
                                  "model.safetensors.index.json", "ckptstream.json", "Model.SafeTensors"])
def test_an_asset_cannot_replace_the_weights(local_url, name):
    assets = {"config.json": b"{}", name: b"not weights"}
    with pytest.raises(IncompatibleStreamError, match=re.escape(name)):
        open_or_create_stream(open_storage(local_url), assets)
    with pytest.raises(IncompatibleStreamError, match=re.escape(name)):
        Publisher(local_url, assets=assets)
    assert not Path(local_url).exists()  # nothing was created


def test_an_asset_over_the_limit_is_refused_before_anything_is_written(local_url):
    """Readers hold an asset whole, so the format bounds it (MAX_ASSET_BYTES): refused at the publisher,
    and a stream.json listing one is refused by readers."""
    assets = {"config.json": b"{}", "huge.dat": bytes(MAX_ASSET_BYTES + 1)}
    with pytest.raises(IncompatibleStreamError, match="huge.dat.* over the"):
        Publisher(local_url, assets=assets)
    assert not Path(local_url).exists()
    info = StreamInfo("s", "2026-01-01T00:00:00Z", (FileEntry("huge.dat", MAX_ASSET_BYTES + 1, content_hash(b"")),))
    with pytest.raises(ValueError, match="limit of an asset"):
        info.to_bytes()


@pytest.mark.parametrize("name", ["__metadata__", "bad\x00name", "tab\tname", "x" * 1025, ""])
def test_invalid_tensor_names_are_refused_at_publish(stream_url, name):
    with Publisher(stream_url) as publisher:
        with pytest.raises(ValueError, match="tensor name"):
            publisher.publish({"good.weight": torch.ones(3), name: torch.ones(2)})
        assert publisher.publish({"good.weight": torch.ones(3)}).result().version == 0
    stream = Stream(stream_url)
    assert stream.versions() == [0]
    stream.verify(0)


def _deep(depth: int) -> dict:
    value: dict = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


@pytest.mark.parametrize("metadata", [{"loss": math.nan}, {"loss": math.inf}, {"x": [-math.inf]},
                                      _deep(MAX_JSON_DEPTH + 1)], ids=["nan", "inf", "-inf", "deep"])
def test_metadata_must_be_strict_json(local_url, metadata):
    with Publisher(local_url) as publisher:
        with pytest.raises(ValueError, match="metadata"):
            publisher.publish(random_state(), metadata=metadata)
        publisher.publish(random_state(), metadata=_deep(MAX_JSON_DEPTH - 1)).result()  # the deepest allowed
    stream = Stream(local_url)
    assert stream.versions() == [0]
    assert stream.manifest(0).metadata == _deep(MAX_JSON_DEPTH - 1)


# --------------------------------------------------------------------------------- failed first publish

def _no_weights_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "no-weights"
    directory.mkdir()
    (directory / "config.json").write_text('{"model_type": "qwen2"}')
    (directory / "tokenizer.json").write_text("{}")
    return directory


def test_failed_first_publish_creates_no_stream_api(stream_url, tmp_path):
    from ckptstream.hf import iter_hf_weights

    directory = _no_weights_dir(tmp_path)
    with Publisher(stream_url, assets=directory) as publisher:
        with pytest.raises(FileNotFoundError, match="safetensors"):
            publisher.publish(iter_hf_weights(directory))
        with pytest.raises(ValueError, match="tensor name"):  # fails part-way through the tensors
            publisher.publish(iter([("a.weight", torch.ones(2)), ("__metadata__", torch.ones(2))]))
        with pytest.raises(PublishError, match="at least one tensor"):
            publisher.publish({}).result()
        with pytest.raises(PublishError):
            publisher.wait()  # the failure surfaces once more at the next call
    storage = open_storage(stream_url)
    assert not storage.exists(STREAM_FILE) and storage.list("assets") == [] and storage.list("manifests") == []
    with pytest.raises(Exception, match="no stream"):
        Stream(stream_url).info()


def test_failed_first_publish_creates_no_stream_cli(tmp_path, tiny_model, capsys):
    url = str(tmp_path / "stream")
    assert main(["publish", url, "--from-hf", str(_no_weights_dir(tmp_path)), "--cache-dir", ""]) == 4
    err = capsys.readouterr().err
    assert err.startswith("Error: ") and "no *.safetensors files" in err and "nothing was published" in err
    assert not Path(url).exists()
    assert main(["publish", url, "--from-hf", str(tiny_model), "--cache-dir", ""]) == 0
    out = Stream(url).materialize(0, tmp_path / "out")
    assert (out / "config.json").read_bytes() == (tiny_model / "config.json").read_bytes()
    assert (out / "model.safetensors").exists()


def test_a_publisher_closed_unused_creates_the_stream(local_url, tiny_model):
    Publisher(local_url, assets=tiny_model).close()
    assert {a.name for a in Stream(local_url).info().assets} >= {"config.json"}


# ------------------------------------------------------------------------------------------- config

def test_one_config_object_or_keyword_arguments(local_url):
    config = PublisherConfig(keyframe_every=2, chunk_bytes=4096)
    state = random_state(0)
    with Publisher(local_url, config) as publisher:
        kinds = [publisher.publish(state).result().kind for _ in range(3)]
    assert kinds == ["keyframe", "delta", "keyframe"]
    with Publisher(local_url, config, keyframe_every=1) as publisher:  # keywords override the config
        assert publisher.config.keyframe_every == 1 and publisher.config.chunk_bytes == 4096
        assert publisher.publish(state).result().kind == "keyframe"
    with pytest.raises(ValueError, match="keyframe_every"):
        PublisherConfig(keyframe_every=0)
    with pytest.raises(TypeError):
        Publisher(local_url, keyframes=3)


@pytest.mark.parametrize("step", [True, "3", 2.0])
def test_step_must_be_an_int(local_url, step):
    """A bool step would be written as JSON ``true``, which no reader takes for a step."""
    with Publisher(local_url) as publisher:
        with pytest.raises(TypeError, match="step"):
            publisher.publish(random_state(), step=step)
        assert publisher.publish(random_state(), step=3).result().step == 3
    assert Stream(local_url).manifest(0).step == 3


def test_commit_whose_outcome_cannot_be_read_back_is_unknown(local_url):
    """A put that fails with the storage unreachable for the read-back too (no server listens on the
    endpoint: a real refused connection) is neither a commit nor a conflict: the writer must keep its data
    files, since the manifest may have been stored."""
    from ckptstream.errors import CommitOutcomeUnknownError
    from ckptstream.storage import open_storage
    from ckptstream.vllm_loader.serve import free_port
    from ckptstream.writer import commit_manifest

    with Publisher(local_url) as publisher:
        manifest = publisher.publish(random_state(0)).result()
    nowhere = f"http://127.0.0.1:{free_port()}"
    storage = open_storage("s3://bucket/run", {"endpoint_url": nowhere, "retries": 1, "key": "k", "secret": "s",
                                               "config_kwargs": {"retries": {"max_attempts": 1}}})
    with pytest.raises(CommitOutcomeUnknownError, match="unknown"):
        commit_manifest(storage, manifest)


def test_commit_refused_as_existing_but_unreadable_is_of_unknown_outcome(local_url):
    """The put says the manifest exists, the read-back finds none (removed since, or a store whose reads
    lag): it may have been this writer's, stored by a retry, so the outcome is unknown, not a failure whose
    data files could go."""
    from ckptstream.errors import CommitOutcomeUnknownError

    with Publisher(local_url) as publisher:
        manifest = publisher.publish(random_state(0)).result()
    with s3_refusing_every_put() as endpoint:
        storage = open_storage("s3://bucket/stream", {"endpoint_url": endpoint, "key": "k", "secret": "s"})
        with pytest.raises(CommitOutcomeUnknownError, match="version 0.*exists, yet none can be read back"):
            commit_manifest(storage, manifest)


def test_a_manifest_readers_would_refuse_is_never_committed(local_url):
    """A writer MUST NOT commit what every reader refuses: here a delta whose base is newer than itself."""
    import dataclasses

    from ckptstream.format import DELTA, manifest_path
    from ckptstream.writer import commit_manifest

    with Publisher(local_url) as publisher:
        keyframe = publisher.publish(random_state(0)).result()
    broken = dataclasses.replace(keyframe, version=1, kind=DELTA, base_version=2, chain_length=1)
    with pytest.raises(PublishError, match="refused by readers"):
        commit_manifest(publisher.storage, broken)
    assert not publisher.storage.exists(manifest_path(1))


# ------------------------------------------------------------------------------- the latest-version hint

def test_latest_version_hint_only_moves_forward_and_never_fails_a_commit(stream_url, caplog):
    from ckptstream.format import LATEST_HINT_FILE, parse_latest_hint
    from ckptstream.storage import ReadOnlyStorage
    from ckptstream.writer import write_latest_hint

    storage = open_storage(stream_url)
    with Publisher(stream_url) as publisher:
        publisher.publish(random_state(0)).result()
        publisher.publish(random_state(1)).result()
    assert parse_latest_hint(storage.read(LATEST_HINT_FILE)) == 1
    write_latest_hint(storage, 0)  # an older version copied late (a resumed mirror) leaves it alone
    assert parse_latest_hint(storage.read(LATEST_HINT_FILE)) == 1
    write_latest_hint(storage, 7)
    assert parse_latest_hint(storage.read(LATEST_HINT_FILE)) == 7
    storage.put(LATEST_HINT_FILE, b"garbage")  # a damaged hint is replaced
    write_latest_hint(storage, 2)
    assert parse_latest_hint(storage.read(LATEST_HINT_FILE)) == 2
    write_latest_hint(ReadOnlyStorage(storage), 9)  # cannot be written: logged, not raised
    assert "latest-version hint was not updated" in caplog.text
    assert parse_latest_hint(storage.read(LATEST_HINT_FILE)) == 2
