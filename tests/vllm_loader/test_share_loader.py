"""vLLM's load format ``ckptstream`` (``share_loader.ShareModelLoader``) in this process, without an engine: a bad
file refused, vLLM's own loading where the directory is not for it; and which engines ``serve`` starts with it.
(An engine starting with it, over two nodes: test_multinode.py.)"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from ckptstream.errors import IntegrityError
from ckptstream.vllm_loader.load_format import LOAD_FORMAT, PLUGIN, PLUGIN_GROUP, PLUGIN_TARGET
from ckptstream.vllm_loader.serve import default_vllm_settings


@pytest.fixture(scope="module")
def loader():
    """vLLM's loader of the format, as vLLM finds it once ckptstream's plugin ran in this process."""
    pytest.importorskip("vllm")
    from vllm.config import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    from ckptstream.vllm_plugin import register_model_loader

    register_model_loader()
    return get_model_loader(LoadConfig(load_format=LOAD_FORMAT))


def weights_of(loader, directory, world_size: int) -> list[tuple[str, torch.Tensor]]:
    """What ``loader`` hands a model's ``load_weights`` for ``directory`` on an engine of ``world_size`` ranks."""
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config

    config = VllmConfig(parallel_config=ParallelConfig(tensor_parallel_size=world_size))
    model_config = SimpleNamespace(model=str(directory), revision=None, multimodal_config=None)
    with set_current_vllm_config(config):
        return [(name, tensor.clone()) for name, tensor in loader.get_all_weights(model_config, torch.nn.Module())]


def test_a_corrupt_file_stops_the_load_naming_it(loader, tmp_path):
    """What a start on a corrupt cache directory ends with (vLLM's start fails with this error in its log)."""
    save_file({"a": torch.ones(4, 4)}, tmp_path / "model-00001-of-00002.safetensors")
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"\x08" + bytes(7) + b"not json")
    with pytest.raises(IntegrityError, match="model-00002-of-00002.safetensors.*no JSON"):
        weights_of(loader, tmp_path, world_size=2)


def test_vllms_own_loading_runs_where_the_share_is_not_read_and_says_why(loader, tmp_path, caplog):
    tensors = {"b": torch.arange(6.0).reshape(2, 3), "a": torch.ones(3)}
    save_file(tensors, tmp_path / "model.safetensors")
    with caplog.at_level(logging.INFO, logger="ckptstream.share_loader"):
        shared = weights_of(loader, tmp_path, world_size=2)
    assert "each rank reads its share" in caplog.text
    assert [name for name, _ in shared] == ["a", "b"]
    assert all(torch.equal(tensor, tensors[name]) for name, tensor in shared)

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ckptstream.share_loader"):
        whole = weights_of(loader, tmp_path, world_size=1)
    assert "an engine of one rank" in caplog.text and "vLLM's own loader reads" in caplog.text
    assert sorted(name for name, _ in whole) == ["a", "b"]

    bins = tmp_path / "bin"
    bins.mkdir()
    torch.save(tensors, bins / "pytorch_model.bin")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ckptstream.share_loader"):
        loaded = dict(weights_of(loader, bins, world_size=2))
    assert "no local directory of safetensors files" in caplog.text
    assert all(torch.equal(loaded[name], tensor) for name, tensor in tensors.items())


@pytest.fixture
def plugin_installed(tmp_path, monkeypatch):
    """ckptstream's plugin entry point as an installed distribution shows it (here one of its own, found on the
    path: the editable install of the machine may predate the entry point)."""
    info = tmp_path / "site" / "ckptstream_loader_plugin-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ckptstream-loader-plugin\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[{PLUGIN_GROUP}]\n{PLUGIN} = {PLUGIN_TARGET}\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))


def test_serve_asks_for_the_format_for_engines_of_several_ranks_only(plugin_installed, tmp_path, caplog):
    def asked(args: list[str], environ: dict[str, str] | None = None) -> str | None:
        given, _, said = default_vllm_settings(args, environ or {}, tmp_path, cpu=False)
        formats = [given[i + 1] for i, arg in enumerate(given[:-1]) if arg == "--load-format"]
        assert (f"--load-format {LOAD_FORMAT}" in said) == (formats == [LOAD_FORMAT] and LOAD_FORMAT not in args)
        return formats[-1] if formats else None

    for ranks in (["--tensor-parallel-size", "2"], ["-tp=4"], ["--pipeline-parallel-size", "2"],
                  ["-tp", "2", "-pp", "2"]):
        assert asked(ranks) == LOAD_FORMAT, ranks
    for ranks in ([], ["--tensor-parallel-size", "1"], ["--data-parallel-size", "2"]):
        assert asked(ranks) is None, ranks
    # the user's load format is kept; a VLLM_PLUGINS that leaves the plugin out gets none
    assert asked(["-tp", "2", "--load-format", "safetensors"]) == "safetensors"
    for given in (["-tp", "2", "--load-format=dummy"], ["--tensor_parallel_size", "2", "--load_format", "dummy"]):
        assert default_vllm_settings(given, {}, tmp_path, cpu=False)[0][:len(given)] == given  # (vLLM's "_" too)
        assert "--load-format" not in default_vllm_settings(given, {}, tmp_path, cpu=False)[0][len(given):]
    assert asked(["--tensor_parallel_size=2"]) == LOAD_FORMAT
    with caplog.at_level(logging.WARNING, logger="ckptstream.serve"):
        assert asked(["-tp", "2"], {"VLLM_PLUGINS": "ckptstream_amx"}) is None
    assert f"vLLM plugin {PLUGIN} not installed" in caplog.text
    assert asked(["-tp", "2"], {"VLLM_PLUGINS": f"x,{PLUGIN}"}) == LOAD_FORMAT
