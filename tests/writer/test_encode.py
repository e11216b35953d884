"""Encoders on their own (no storage): what each tensor becomes, and the one keyframe-or-delta decision."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from ckptstream.format import DELTA, KEYFRAME, Manifest
from ckptstream.testing.models import rl_like_step
from ckptstream.writer.encode import BaseVersion, DeltaEncoder, EncodedVersion, KeyframeEncoder, VersionEncoder
from tests.helpers import random_state


def _base(tensors: dict[str, torch.Tensor], chain_length: int = 0) -> BaseVersion:
    manifest = Manifest(version=chain_length, kind=KEYFRAME if chain_length == 0 else DELTA,
                        base_version=None if chain_length == 0 else chain_length - 1, keyframe_version=0,
                        chain_length=chain_length, stream_id="0" * 32, created="2026-12-01T00:00:00.000Z",
                        files=(), tensors=())
    return BaseVersion(manifest, {k: v.clone() for k, v in tensors.items()})


@pytest.fixture
def pool():
    with ThreadPoolExecutor(2) as executor:
        yield executor


def test_keyframe_stores_every_tensor_raw():
    encoded = KeyframeEncoder().encode(list(random_state().items()), None)
    assert encoded.kind == KEYFRAME and encoded.base is None
    assert {t.encoding for t in encoded.tensors} == {"raw"} and all(not t.frames for t in encoded.tensors)


def test_delta_encodings_per_tensor(pool):
    old = random_state(0)
    base = _base(old)
    new = {k: v.clone() for k, v in old.items()}
    rl_like_step(new, fraction=0.05, generator=torch.Generator().manual_seed(1))
    new["layer.0.norm"] = old["layer.0.norm"].clone()  # unchanged
    new["steps"] = torch.arange(9)  # another shape: no XOR possible
    new["added"] = torch.ones(4)  # not in the base
    encoded = DeltaEncoder(pool, chunk_bytes=1024).encode(list(new.items()), base)
    assert encoded is not None and encoded.kind == DELTA and encoded.base is base.manifest
    by_name = {t.name: t for t in encoded.tensors}
    assert by_name["layer.0.norm"].encoding == "unchanged" and by_name["layer.0.norm"].frames == []
    assert by_name["steps"].encoding == "zstd" and by_name["added"].encoding == "zstd"
    assert by_name["embed.weight"].encoding == "xor-zstd" and 0 < by_name["embed.weight"].changed
    assert len(by_name["embed.weight"].frames) == len(by_name["embed.weight"].chunks) > 1


def test_delta_declines_without_base_or_when_it_does_not_pay(pool):
    tensors = list(random_state(1).items())
    assert DeltaEncoder(pool).encode(tensors, None) is None
    assert DeltaEncoder(pool, max_ratio=0.3).encode(tensors, _base(random_state(0))) is None  # all changed


class _CountingEncoder:
    """Another implementation of the Encoder interface (as a device-side encoder would be)."""

    def __init__(self, inner: DeltaEncoder):
        self.inner = inner
        self.calls = 0

    def encode(self, tensors, base, pieces=None) -> EncodedVersion | None:
        self.calls += 1
        return self.inner.encode(tensors, base, pieces)


def test_version_encoder_decides_keyframe_or_delta(pool):
    delta = _CountingEncoder(DeltaEncoder(pool))
    encoder = VersionEncoder(delta, keyframe_every=3)
    state = random_state(0)
    changed = {k: v.clone() for k, v in state.items()}
    rl_like_step(changed, fraction=0.01)
    items = list(changed.items())
    assert encoder.encode(items, None).kind == KEYFRAME  # no base
    assert encoder.encode(items, _base(state), force_keyframe=True).kind == KEYFRAME
    assert delta.calls == 0  # neither asked the delta encoder
    assert encoder.encode(items, _base(state, chain_length=1)).kind == DELTA
    assert encoder.encode(items, _base(state, chain_length=2)).kind == KEYFRAME  # the chain is full
    assert delta.calls == 1
    declined = VersionEncoder(_CountingEncoder(DeltaEncoder(pool, max_ratio=0.0)), keyframe_every=3)
    assert declined.try_delta(items, _base(state)) is None
    assert declined.encode(items, _base(state)).kind == KEYFRAME
    assert declined.keyframe(items).kind == KEYFRAME
