"""The base model hash (FORMAT.md, "Base model hash"): of a directory's tensors, not of how they are split into
files; a change at a tensor's middle changes it; a directory without weights or with a damaged file is refused."""

from __future__ import annotations

import pytest

from ckptstream.basehash import base_model_hash
from ckptstream.errors import IntegrityError, SourceNotFoundError
from ckptstream.format import HASH_PREFIX
from ckptstream.testing.models import TinyModelSpec, tiny_state_dict, write_tiny_model


def test_the_base_model_hash_is_of_the_tensors_not_of_their_files(tmp_path):
    state = tiny_state_dict(TinyModelSpec(arch="llama"))
    one = base_model_hash(write_tiny_model(tmp_path / "one", state=state))
    assert one.startswith(HASH_PREFIX) and one == base_model_hash(tmp_path / "one")
    assert base_model_hash(write_tiny_model(tmp_path / "sharded", state=state, shard_bytes=100_000)) == one
    middle = state["model.layers.1.self_attn.q_proj.weight"].view(-1)
    middle[middle.numel() // 2] += 1
    assert base_model_hash(write_tiny_model(tmp_path / "tuned", state=state)) != one
    with pytest.raises(SourceNotFoundError, match="no \\*.safetensors files"):
        base_model_hash(tmp_path)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(IntegrityError, match="not a readable safetensors file") as exc:
        base_model_hash(tmp_path / "broken")
    assert exc.value.file.endswith("model.safetensors")
