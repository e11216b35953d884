"""The device encoder's CPU reference (the same torch code on CPU tensors) against the host encoder: the
same inputs give versions with the same tensor entries and the same stored chunks, both decode to the
inputs, and the two encoders take over from each other on one stream in either order."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from ckptstream import Publisher, Stream
from ckptstream import codec
from ckptstream.codec import INT_OF_SIZE
from ckptstream.testing.storage import stored_entries
from ckptstream.writer import device_encode
from tests.helpers import assert_same_tensors

CHUNK_BYTES = 256  # 128 bf16 elements per chunk: many chunks, changes on their boundaries


@pytest.fixture(autouse=True)
def triton_kernels(monkeypatch):
    """With ``CKPTSTREAM_TEST_TRITON_KERNELS`` set (tests/writer/test_device_kernels.py runs this module so,
    in Triton's interpreter), every snapshot uses the Triton kernels, in spans of 50 elements."""
    if os.environ.get("CKPTSTREAM_TEST_TRITON_KERNELS"):
        from ckptstream.writer import device_kernels

        monkeypatch.setattr(device_encode, "kernels_for", lambda device: device_kernels.TritonKernels())
        monkeypatch.setattr(device_encode, "MAX_SPAN_ELEMENTS", 50)


def _versions() -> list[dict[str, torch.Tensor]]:
    """States covering sparse, dense and unchanged tensors, dtypes, odd sizes, chunk boundaries, a chunk
    dense inside a sparse tensor, a new tensor, a tensor changing shape and one dropped."""
    g = torch.Generator().manual_seed(0)
    v0 = {
        "embed": torch.randn(257, 33, generator=g).to(torch.bfloat16),  # 8481 elements, odd
        "w32": torch.randn(1000, generator=g),
        "ints": torch.randint(-1000, 1000, (777,), generator=g, dtype=torch.int32),
        "i64": torch.randint(0, 1 << 40, (100,), generator=g, dtype=torch.int64),
        "mask": torch.rand(333, generator=g) > 0.5,
        "u8": torch.randint(0, 255, (129,), generator=g, dtype=torch.uint8),
        "same": torch.randn(64, generator=g).to(torch.bfloat16),
        "dense": torch.randn(50, generator=g),
        "empty": torch.zeros(0, 3),
    }
    v1 = {k: v.clone() for k, v in v0.items()}
    bits = v1["embed"].view(torch.int16).view(-1)
    for i in (0, 127, 128, 255, 256, 4000, 8480):  # chunk boundaries and the last element
        bits[i] ^= 1
    v1["w32"][torch.randint(0, 1000, (9,), generator=g)] += 1.0
    v1["ints"][::100] += 1
    v1["i64"] += 1  # every element: dense chunks
    v1["mask"][::7] = ~v1["mask"][::7]
    v1["u8"][5] ^= 0xFF
    v1["dense"] *= 1.5
    v1["new"] = torch.arange(10, dtype=torch.float32)  # not in the base
    v2 = {k: v.clone() for k, v in v1.items() if k != "u8"}  # u8 dropped
    v2["embed"].view(torch.int16).view(-1)[128 * 3:128 * 4:2] ^= 3  # one chunk half changed: dense
    v2["embed"].view(torch.int16).view(-1)[7000] ^= 5
    v2["w32"] = v1["w32"].reshape(500, 2).clone()  # another shape: no XOR possible
    v3 = {k: v.clone() for k, v in v2.items()}  # nothing changed
    v4 = {k: v.clone() for k, v in v3.items()}
    v4["ints"][3] = 7
    return [v0, v1, v2, v3, v4]


@pytest.fixture(params=[(0, 0.0), (device_encode.WHOLE_BYTES, 0.0), (0, 0.5)], ids=["spans", "whole", "host_compared"])
def small_spans(monkeypatch, request):
    """Spans of change detection smaller than a chunk and not element-aligned in bytes, and no payload
    budget (these versions change most of their bytes); the tensors compared span by span, or (all
    small here) staged whole and compared on the host, or the smallest half of the bytes without a
    resident copy (host-compared, the others in spans)."""
    monkeypatch.setattr(device_encode, "WHOLE_BYTES", request.param[0])
    monkeypatch.setattr(device_encode, "HOST_COMPARED_RATIO", request.param[1])
    monkeypatch.setattr(device_encode, "SPAN_BYTES", 100)
    monkeypatch.setattr(device_encode, "MAX_PAYLOAD_RATIO", 100.0)


def _publish(url: str, versions: list[dict[str, torch.Tensor]], *, device: bool, start: int = 0,
             keyframes: tuple[int, ...] = ()) -> Publisher:
    publisher = Publisher(url, chunk_bytes=CHUNK_BYTES, keyframe_every=100, delta_max_ratio=10.0,
                          device_delta=device, workers=2)
    with publisher:
        for number, state in enumerate(versions, start):
            publisher.publish(state, number, keyframe=number in keyframes).result()
            if device:
                assert publisher._device.landed is not None and publisher._device.landed.version == number
            else:
                assert publisher._device.landed is None
    return publisher


def test_device_encoder_stores_what_the_host_encoder_stores(tmp_path, small_spans):
    versions = _versions()
    _publish(str(tmp_path / "host"), versions, device=False)
    _publish(str(tmp_path / "device"), versions, device=True)
    host, device = Stream(str(tmp_path / "host")), Stream(str(tmp_path / "device"))
    kinds = [device.manifest(v).kind for v in range(len(versions))]
    assert kinds == ["keyframe"] + ["delta"] * (len(versions) - 1)
    for version, state in enumerate(versions):
        assert stored_entries(device, version) == stored_entries(host, version), f"version {version}"
        assert_same_tensors(dict(device.iter_tensors(version)), state)
        assert_same_tensors(dict(host.iter_tensors(version)), state)
    # (each delta entry with its change check: the two encoders' checks are equal, as every field)
    assert all(e.check is not None for v in (1, 2) for e in device.manifest(v).tensors if e.encoding == "xor-zstd")
    layouts = {(e.name, v): [c[2] for c in e.chunks] for v in (1, 2) for e in device.manifest(v).tensors}
    assert "dense" in layouts[("i64", 1)] and "sparse" in layouts[("embed", 1)]
    assert "dense" in layouts[("embed", 2)] and "sparse" in layouts[("embed", 2)]
    encodings = {e.name: e.encoding for e in device.manifest(2).tensors}
    assert encodings["w32"] == "zstd" and encodings["same"] == "unchanged" and "u8" not in encodings
    assert {e.encoding for e in device.manifest(3).tensors} == {"unchanged"}


def test_host_and_device_encoders_take_over_from_each_other(tmp_path, small_spans):
    """On one stream: host keyframe and delta, then device (its first version encoded on the host against
    the stream's latest, then device deltas), then host deltas again, then device with a forced keyframe."""
    versions = _versions()
    extra = [{k: v.clone() for k, v in versions[-1].items()} for _ in range(4)]
    for number, state in enumerate(extra):
        state["embed"].view(torch.int16).view(-1)[number * 97 % 8481] ^= 1
        state["dense"] += number + 1
    versions += extra
    url = str(tmp_path / "mixed")
    _publish(url, versions[:2], device=False)
    _publish(url, versions[2:4], device=True, start=2)  # 2: host-encoded (fresh), 3: device delta on it
    _publish(url, versions[4:6], device=False, start=4)  # host deltas on the device-encoded chain
    _publish(url, versions[6:9], device=True, start=6, keyframes=(7,))  # device keyframe 7, device delta 8
    stream = Stream(url)
    assert [stream.manifest(v).kind for v in range(9)] == ["keyframe"] + ["delta"] * 6 + ["keyframe", "delta"]
    for version, state in enumerate(versions):
        assert_same_tensors(dict(stream.iter_tensors(version)), state)
    _publish(str(tmp_path / "host"), versions, device=False, keyframes=(7,))
    host = Stream(str(tmp_path / "host"))
    for version in (3, 8):  # the device deltas
        assert stored_entries(stream, version) == stored_entries(host, version)


def test_payload_over_budget_becomes_a_keyframe_then_deltas_resume(tmp_path, monkeypatch):
    monkeypatch.setattr(device_encode, "MAX_PAYLOAD_RATIO", 0.01)
    monkeypatch.setattr(device_encode, "WHOLE_BYTES", 0)  # compared on the "device" (a staged tensor counts whole)
    g = torch.Generator().manual_seed(3)
    state = {"a": torch.randn(4096, generator=g), "b": torch.randn(1000, generator=g).to(torch.bfloat16)}
    states = [{k: v.clone() for k, v in state.items()}]
    state["a"] += 1.0  # every element of the larger tensor
    states.append({k: v.clone() for k, v in state.items()})
    state["b"].view(torch.int16)[17] ^= 1
    states.append({k: v.clone() for k, v in state.items()})
    url = str(tmp_path / "s")
    _publish(url, states, device=True)
    stream = Stream(url)
    assert [stream.manifest(v).kind for v in range(3)] == ["keyframe", "keyframe", "delta"]
    assert {e.name: e.changed for e in stream.manifest(2).tensors} == {"a": 0, "b": 1}
    for version, want in enumerate(states):
        assert_same_tensors(dict(stream.iter_tensors(version)), want)


def test_device_snapshot_changes_and_memory_on_cpu():
    """The capture itself: changed positions (span-relative int32, across spans) and XOR values; the resident
    copy follows the tensors; CPU tensors hold no device memory."""
    snapshot = device_encode.DeviceSnapshot(span_bytes=6, max_payload_ratio=100.0, whole_bytes=0)  # 3 per span
    live = torch.zeros(10, dtype=torch.bfloat16)
    first = snapshot.take({"x": live}, 0)
    assert first.previous is None and first.tensors[0].positions is None and not first.released.is_set()
    with ThreadPoolExecutor(1) as pool:
        landed = snapshot.land(first, pool)
        assert torch.equal(landed.mirror[0][1], live) and first.released.is_set()
        assert landed.tensors["x"].result().changes is None and landed.compared == set()
    live.view(torch.int16)[[2, 3, 9]] = torch.tensor([1, 2, 3], dtype=torch.int16)
    second = snapshot.take({"x": live}, 1)
    assert second.previous == 0 and second.released.is_set()
    (item,) = second.tensors
    assert item.starts == [0, 3, 9] and all(p.dtype == torch.int32 for p in item.positions)  # span-relative
    assert torch.cat([p + start for p, start in zip(item.positions, item.starts)]).tolist() == [2, 3, 9]
    assert torch.cat(item.values).tolist() == [1, 2, 3] and item.values[0].dtype == INT_OF_SIZE[2]
    assert torch.equal(item.resident.view(torch.int16), live.view(torch.int16))
    with ThreadPoolExecutor(1) as pool:
        landed = snapshot.land(second, pool)
    assert torch.equal(landed.mirror[0][1].view(torch.int16), live.view(torch.int16))
    changes = landed.tensors["x"].result().changes
    assert changes is not None and changes[0].tolist() == [2, 3, 9] and changes[0].dtype == torch.int64
    assert landed.hashes() == [codec.tensor_hash(live)] and landed.compared == {"x"} and not landed.prepared
    assert snapshot.device_memory_bytes == 0 and snapshot.pinned_bytes == 0


@pytest.mark.parametrize("host_compared", [False, True])
def test_a_piece_that_moves_is_captured_whole(host_compared):
    """A piece lying elsewhere in its whole tensor than the resident copy's or the mirror's (same local
    shape): no changes against the copy of another box; the version is captured whole (no previous version:
    the host encoder takes it), and later versions compare again."""
    from ckptstream.writer.pieces import PieceOf

    snapshot = device_encode.DeviceSnapshot(whole_bytes=0, host_compared_ratio=1.0 if host_compared else 0.0)
    top, bottom = PieceOf((8, 4), (0, 0), (4, 4)), PieceOf((8, 4), (4, 0), (4, 4))
    live = torch.zeros(4, 4)
    captures = []
    with ThreadPoolExecutor(1) as pool:
        for version, place in enumerate([top, top, bottom, bottom, None]):
            captures.append(snapshot.take({"x": live}, version, None if place is None else {"x": place}))
            snapshot.land(captures[-1], pool).wait()
    assert captures[0].tensors[0].place == top and captures[1].previous == 0
    assert captures[2].previous is None and (host_compared or captures[2].tensors[0].positions is None)
    assert captures[3].previous == 2
    assert captures[4].previous is None  # a whole tensor now


def test_failed_capture_forgets_the_device_copy_and_the_next_version_is_right(tmp_path, small_spans):
    """A tensor refused in the middle of a capture (after others were recorded): nothing is published, and
    the next version, captured whole again, is encoded against the last committed one."""
    versions = _versions()
    url = str(tmp_path / "s")
    with Publisher(url, chunk_bytes=CHUNK_BYTES, device_delta=True, workers=2) as publisher:
        publisher.publish(versions[0], 0).result()
        publisher.publish(versions[1], 1).result()
        bad = list(versions[2].items())
        bad.insert(3, ("embed", torch.zeros(2)))  # given twice
        with pytest.raises(ValueError):
            publisher.publish(bad, 2)
        assert publisher.device_memory_bytes == 0  # the device copy is forgotten (none on CPU anyway)
        assert not publisher._device._resident
        assert publisher.publish(versions[2], 2).result().kind == "delta"
        assert publisher.publish(versions[3], 3).result().kind == "delta"  # a device delta again
        assert publisher._device.landed is not None and publisher._device.landed.previous == 2
    stream = Stream(url)
    assert stream.versions() == [0, 1, 2, 3]
    for version in range(4):
        assert_same_tensors(dict(stream.iter_tensors(version)), versions[version])


def test_staged_versions_in_flight_together(tmp_path, small_spans):
    """``stage`` with two versions in flight: a capture waits until the back half of a whole-tensor capture
    no longer reads the device copy, and every version decodes to its own tensors."""
    versions = _versions()
    url = str(tmp_path / "s")
    with Publisher(url, chunk_bytes=CHUNK_BYTES, device_delta=True, max_in_flight=2, workers=2) as publisher:
        publications = [publisher.stage(state, number) for number, state in enumerate(versions)]
        for publication in publications:
            publication.staged.result()
        assert [p.committed.result().kind for p in publications] == ["keyframe"] + ["delta"] * 4
    stream = Stream(url)
    for version, state in enumerate(versions):
        assert_same_tensors(dict(stream.iter_tensors(version)), state)


def test_the_smallest_tensors_have_no_resident_copy_and_land_right():
    """Within ``host_compared_ratio`` of the model's bytes, the smallest tensors are staged whole instead of
    held resident: the first version lands them whole, later ones find their changes on the host."""
    snapshot = device_encode.DeviceSnapshot(host_compared_ratio=0.2, whole_bytes=0, max_payload_ratio=100.0)
    live = {"big": torch.zeros(1000, dtype=torch.int16), "small": torch.zeros(100, dtype=torch.int16),
            "tiny": torch.zeros(10, dtype=torch.int16)}  # the two smallest: 220 bytes of 2220, within 20 %
    with ThreadPoolExecutor(2) as pool:
        first = snapshot.land(snapshot.take(live, 0), pool)
        assert set(snapshot._resident) == {"big"} and first.compared == set()
        assert all(first.tensors[n].result().changes is None for n in live)
        live["small"][[4, 50]] = 3
        live["big"][999] = 1
        second = snapshot.land(snapshot.take(live, 1), pool)
        assert set(snapshot._resident) == {"big"} and second.compared == {"big", "small", "tiny"}
        changes = {n: second.tensors[n].result().changes for n in live}
    assert {n: c[0].tolist() for n, c in changes.items() if c is not None} == {"big": [999], "small": [4, 50],
                                                                                "tiny": []}
    assert second.hashes() == [codec.tensor_hash(t) for t in live.values()]
    for name, host in second.mirror:
        assert torch.equal(host, live[name])
