"""The change between two versions (what workers apply in place), built from the stored deltas and from two
decoded versions, against full decodes, bit for bit."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from ckptstream import Publisher, Stream
from ckptstream.codec import bit_pattern, check_sum
from ckptstream.errors import IntegrityError
from ckptstream.format import CHECK_MASK, ChangeCheck, check_element, data_path, manifest_path
from ckptstream.testing.models import rl_like_step
from ckptstream.vllm_loader.inplace.change import (TOO_MANY, UNCHECKED, build_change, build_change_from_deltas,
                                                   build_change_unbased, read_change)
from tests.helpers import random_state


def _apply(tensors: dict[str, torch.Tensor], change: Path) -> dict[str, torch.Tensor]:
    """``tensors`` with ``change`` written into copies of them, the old values checked on the way."""
    patched = {name: t.clone() for name, t in tensors.items()}
    with safe_open(str(change), framework="pt") as handle:
        for name, (shape, positions, old, new, *_) in read_change(handle):
            flat = patched[name].view(-1)
            assert tuple(patched[name].shape) == shape
            assert torch.equal(bit_pattern(flat[positions]), bit_pattern(old)), name
            flat[positions] = new
    return patched


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(bit_pattern(a[n].reshape(-1)), bit_pattern(b[n].reshape(-1)))
                                        for n in a)


def _file_tensors(path: Path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """A change file's metadata, and per changed tensor its positions, old and new values by name."""
    with safe_open(str(path), framework="pt") as handle:
        tensors = {}
        for name, (_, positions, old, new, *_) in read_change(handle):
            tensors.update({f"{name}:positions": positions, f"{name}:old": old, f"{name}:new": new})
        return handle.metadata(), tensors


@pytest.fixture
def chain(tmp_path):
    """Version 0 a keyframe, 1-3 deltas: small changes everywhere, one tensor changed densely in 1 (a dense
    XOR chunk), one element changed in 2 and changed back in 3 (no change across them)."""
    url = str(tmp_path / "stream")
    state = random_state(0, scale=4)
    generator = torch.Generator().manual_seed(1)
    states = [{k: v.clone() for k, v in state.items()}]
    with Publisher(url, keyframe_every=100) as publisher:
        publisher.publish(state).result()
        for step in range(1, 4):
            rl_like_step(state, fraction=0.02, generator=generator)
            if step == 1:
                state["layer.0.b"].add_(1.0)  # every element: a dense chunk
            norm = state["layer.0.norm"]
            norm[3] = 2.0 if step == 2 else 1.0
            publisher.publish(state).result()
            states.append({k: v.clone() for k, v in state.items()})
    stream = Stream(url)
    for version in (0, 3):
        stream.materialize(version, tmp_path / f"v{version}")
    return stream, states, tmp_path


def test_the_change_from_the_deltas_equals_the_change_from_the_decoded_versions(chain):
    stream, states, tmp = chain
    chunks = {c[2] for m in stream.chain(3)[1:] for t in m.tensors for c in t.chunks}
    assert chunks == {"sparse", "dense"}  # both layouts are read
    stream_id = stream.info().stream_id
    from_deltas, from_dirs = tmp / "deltas.safetensors", tmp / "dirs.safetensors"
    summary = build_change_from_deltas(stream, tmp / "v0", from_deltas, base=0, version=3, max_fraction=0.5)
    assert summary.problem is None and summary.changed > 0
    assert build_change(tmp / "v0", tmp / "v3", from_dirs, stream_id=stream_id, base=0, version=3,
                        max_fraction=0.5) == summary
    (meta_a, tensors_a), (meta_b, tensors_b) = _file_tensors(from_deltas), _file_tensors(from_dirs)
    assert meta_a == meta_b and _same(tensors_a, tensors_b)
    assert "layer.0.norm:positions" in tensors_a  # its other changes stay, the reverted element does not
    assert 3 not in tensors_a["layer.0.norm:positions"].tolist()
    assert _same(_apply(states[0], from_deltas), states[3])


def test_one_delta_and_a_version_on_itself(chain):
    stream, states, tmp = chain
    stream.materialize(2, tmp / "v2")
    out = tmp / "one.safetensors"
    assert build_change_from_deltas(stream, tmp / "v2", out, base=2, version=3, max_fraction=0.5).problem is None
    assert _same(_apply(states[2], out), states[3])
    nothing = build_change_from_deltas(stream, tmp / "v3", tmp / "none.safetensors", base=3, version=3,
                                       max_fraction=0.5)
    assert nothing.changed == 0 and _file_tensors(tmp / "none.safetensors")[1] == {}


def test_no_change_from_the_deltas_across_a_keyframe_or_beyond_the_limit(tmp_path, chain):
    stream, _, tmp = chain
    out = tmp / "c.safetensors"
    too_many = build_change_from_deltas(stream, tmp / "v0", out, base=0, version=3, max_fraction=0.001)
    assert too_many.problem == TOO_MANY and not out.exists()
    too_many = build_change_unbased(stream, out, base=0, version=3, max_fraction=0.001)
    assert too_many.problem == TOO_MANY and not out.exists()
    url = str(tmp_path / "keyframes")
    with Publisher(url, keyframe_every=1) as publisher:
        publisher.publish(random_state(0)).result()
        publisher.publish(random_state(0)).result()
    keyframes = Stream(url)
    keyframes.materialize(0, tmp_path / "k0")
    across = build_change_from_deltas(keyframes, tmp_path / "k0", out, base=0, version=1, max_fraction=0.5)
    assert across.problem is not None and "whole" in across.problem and not out.exists()
    across = build_change_unbased(keyframes, out, base=0, version=1, max_fraction=0.5)
    assert across.problem == UNCHECKED and not out.exists()  # the caller falls back as before


def test_the_changes_of_many_small_tensors_read_in_batches_equal_each_tensors_own(tmp_path):
    """A one-step delta of many small tensors (a MoE model's experts) is read in batches of tensors
    (``decode.changes_of_sparse``): positions and XOR values equal each tensor's read alone, bit for bit, with
    tensors of other item sizes, unchanged and densely changed ones between them."""
    from ckptstream.reader import decode

    generator = torch.Generator().manual_seed(3)
    state = {f"experts.{i}.w": torch.randn(48, 64, generator=generator).to(torch.bfloat16) for i in range(60)}
    state.update({"norm": torch.ones(64), "bias": torch.zeros(64, dtype=torch.bfloat16), "dense": torch.ones(256)})
    with Publisher(str(tmp_path / "s"), keyframe_every=10) as publisher:
        publisher.publish(state).result()
        rl_like_step(state, fraction=0.02, generator=generator)
        state["norm"][7] = 2.0
        state["bias"].copy_(torch.zeros(64, dtype=torch.bfloat16))  # unchanged
        state["dense"].add_(1.0)
        publisher.publish(state).result()
    stream = Stream(str(tmp_path / "s"))
    manifest = stream.manifest(1)
    batched = dict(stream.changes_since(1, 0, lambda entry, positions, xors: (entry.name, (positions, xors)),
                                        max_tensor_bytes=1 << 30))
    alone = {entry.name: decode.changes_since(stream._files, stream.manifest, manifest, entry, 0, 1 << 30)
             for entry in manifest.tensors}
    assert sum(decode.sparse_delta(e) for e in manifest.tensors) > 50  # most are read in batches
    assert batched.keys() == alone.keys() and batched["bias"][0].numel() == 0
    for name, (positions, xors) in alone.items():
        assert positions.numel() and name != "bias" or not positions.numel() and name == "bias"
        assert torch.equal(batched[name][0], positions) and torch.equal(batched[name][1], xors), name
        assert batched[name][0].dtype == torch.int64


def test_a_corrupt_delta_is_refused_naming_version_file_and_tensor(chain):
    stream, _, tmp = chain
    manifest = stream.manifest(2)
    entry = next(t for t in manifest.tensors if t.encoding == "xor-zstd" and t.name == "layer.0.w")
    path = Path(stream.url) / data_path(2, entry.file)
    data = bytearray(path.read_bytes())
    data[entry.offset + entry.length // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError) as refused:
        build_change_from_deltas(stream, tmp / "v0", tmp / "c.safetensors", base=0, version=3, max_fraction=0.5)
    assert refused.value.version == 2 and refused.value.tensor == "layer.0.w"
    assert data_path(2, entry.file) in str(refused.value)
    assert not (tmp / "c.safetensors").exists()


@pytest.mark.parametrize("counts", [[2, -1], [1, 1], [3, 3]], ids=["negative", "fewer", "more"])
def test_a_change_file_whose_counts_disagree_with_its_tensors_is_refused(tmp_path, counts):
    """The metadata's counts must be positive and add up to the file's positions and values (a bad file
    would shift one tensor's positions onto another's values)."""
    from safetensors.torch import save_file

    path = tmp_path / "forged.safetensors"
    tensors = {"positions": torch.arange(4), "old.bfloat16": torch.zeros(4, dtype=torch.bfloat16),
               "new.bfloat16": torch.ones(4, dtype=torch.bfloat16)}
    entries = [["a", [4], "bfloat16", counts[0]], ["b", [4], "bfloat16", counts[1]]]
    save_file(tensors, str(path), metadata={"layout": "packed-1", "tensors": json.dumps(entries)})
    with safe_open(str(path), framework="pt") as handle, pytest.raises(ValueError):
        list(read_change(handle))


def _expected_check(old: torch.Tensor, new: torch.Tensor) -> ChangeCheck:
    """The check of the change from ``old`` to ``new`` (FORMAT.md "Change checks"), element by element."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[old.element_size()]
    mask = (1 << (8 * old.element_size())) - 1
    a, b = old.reshape(-1).view(ints).tolist(), new.reshape(-1).view(ints).tolist()
    changed = [(p, x & mask, y & mask) for p, (x, y) in enumerate(zip(a, b)) if x != y]
    return ChangeCheck(len(changed), sum(check_element(p, x) for p, x, _ in changed) & CHECK_MASK,
                       sum(check_element(p, y) for p, _, y in changed) & CHECK_MASK)


def test_the_check_terms_on_the_host_and_on_a_device_agree():
    """The host computes the check's mix through numpy, a device (a rank's parameters) through torch; neither
    writes the values it is given."""
    from ckptstream import codec

    generator = torch.Generator().manual_seed(2)
    positions = torch.randint(0, 1 << 50, (1000,), generator=generator)
    mixed = codec.check_positions(positions)
    assert torch.equal(mixed, codec._torch_positions(positions))
    for dtype in (torch.uint8, torch.int16, torch.int32, torch.int64):
        bits = torch.randint(-100, 100, (1000,), generator=generator).to(dtype)
        before = bits.clone()
        assert torch.equal(codec.check_terms(mixed, bits), codec._torch_terms(mixed, bits)), dtype
        assert torch.equal(bits, before), f"the terms of {dtype} values overwrote them"  # (a rank's staged values)
    assert codec.check_sum(torch.tensor([0, 1]), torch.tensor([0, 0x3F80], dtype=torch.int16)) == \
        (check_element(0, 0) + check_element(1, 0x3F80)) & CHECK_MASK


def test_each_delta_entry_carries_the_check_of_its_change(chain):
    stream, states, _ = chain
    for version in (1, 2, 3):
        for entry in stream.manifest(version).tensors:
            if entry.encoding == "xor-zstd":
                assert entry.check == _expected_check(states[version - 1][entry.name], states[version][entry.name])
            else:
                assert entry.encoding == "unchanged" and entry.check is None


def test_a_pieces_checks_add_up_to_the_whole_tensors():
    """A tensor written as two pieces (columns [0, 5) and [5, 8): strided boxes of the whole): each piece's
    check is taken at its elements' positions in the whole tensor, so the two add up to the whole's."""
    from concurrent.futures import ThreadPoolExecutor

    from ckptstream.format import Manifest
    from ckptstream.writer.encode import BaseVersion, DeltaEncoder
    from ckptstream.writer.pieces import PieceOf

    old = torch.randn(6, 8, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    new = old.clone()
    new.view(-1)[[1, 6, 13, 40, 47]] += 1.0
    boxes = {"w": PieceOf((6, 8), (0, 0), (6, 5))}, {"w": PieceOf((6, 8), (0, 5), (6, 3))}
    manifest = Manifest(version=0, kind="keyframe", base_version=None, keyframe_version=0, chain_length=0,
                        stream_id="s", created="", files=(), tensors=())
    checks = []
    with ThreadPoolExecutor(2) as pool:
        for box, columns in zip(boxes, (slice(0, 5), slice(5, 8))):
            base = BaseVersion(manifest, {"w": old[:, columns].contiguous()})
            encoder = DeltaEncoder(pool, chunk_bytes=16, max_ratio=100)
            encoded = encoder.encode([("w", new[:, columns].contiguous())], base, box)
            checks.append(encoded.tensors[0].check)
    assert checks[0].count == 2 and checks[1].count == 3
    assert checks[0] + checks[1] == _expected_check(old, new)


def _apply_steps(tensors: dict[str, torch.Tensor], change: Path) -> tuple[dict[str, torch.Tensor], list[int]]:
    """``tensors`` with a change from the deltas alone applied to copies of them in the order of its entries,
    each entry's check compared with its old and new values there; and the steps' versions, in that order."""
    patched, steps = {name: t.clone() for name, t in tensors.items()}, []
    with safe_open(str(change), framework="pt") as handle:
        for name, tensor in read_change(handle):
            assert tensor.old is None and tensor.new is None
            steps.append(tensor.step)
            flat = patched[name].view(-1)
            ints = {2: torch.int16, 4: torch.int32}[flat.element_size()]
            old = flat[tensor.positions]
            new = (old.view(ints) ^ tensor.xor.view(ints)).view(flat.dtype)
            assert tensor.check == ChangeCheck(tensor.positions.numel(), check_sum(tensor.positions, old),
                                               check_sum(tensor.positions, new)), (name, tensor.step)
            flat[tensor.positions] = new
    return patched, steps


def test_a_change_from_the_deltas_alone_across_a_chain_holds_each_steps_changes(chain):
    """Across three deltas (layout ``xor-steps-1``): each step's positions, XOR and check, oldest step
    first; applied step by step on the base's values they make the last version's, each step's check
    holding there. The one-step change keeps its layout (``xor-1``, no step)."""
    stream, states, tmp = chain
    out = tmp / "steps.safetensors"
    summary = build_change_unbased(stream, out, base=0, version=3, max_fraction=0.5)
    assert summary.problem is None and summary.changed > 0
    with safe_open(str(out), framework="pt") as handle:
        assert handle.metadata()["layout"] == "xor-steps-1"
        assert json.loads(handle.metadata()["steps"]) == [[0, 1], [1, 2], [2, 3]]
    patched, steps = _apply_steps(states[0], out)
    assert _same(patched, states[3]) and steps == sorted(steps) and set(steps) == {1, 2, 3}
    assert summary.changed == sum(stream.manifest(v).tensor(n).changed or 0 for v in (1, 2, 3)
                                  for n in states[0])
    assert _apply_steps(states[1], _built(stream, tmp / "two.safetensors", 1, 3))[1][0] == 2
    from safetensors.torch import save_file

    with safe_open(str(out), framework="pt") as handle:  # steps out of order: refused, not misapplied
        metadata, tensors = handle.metadata(), {k: handle.get_tensor(k) for k in handle.keys()}
    save_file(tensors, str(out), metadata={**metadata, "tensors": json.dumps(json.loads(metadata["tensors"])[::-1])})
    with safe_open(str(out), framework="pt") as handle, pytest.raises(ValueError, match="not in order"):
        list(read_change(handle))
    one = _built(stream, tmp / "one.safetensors", 2, 3)
    patched, steps = _apply_steps(states[2], one)
    assert _same(patched, states[3]) and set(steps) == {None}
    with safe_open(str(one), framework="pt") as handle:
        assert handle.metadata()["layout"] == "xor-1" and "steps" not in handle.metadata()


def _built(stream: Stream, out: Path, base: int, version: int) -> Path:
    assert build_change_unbased(stream, out, base=base, version=version, max_fraction=0.5).problem is None
    return out


def test_a_change_from_the_deltas_alone_holds_each_changes_xor_and_check(chain):
    """From the deltas alone: the positions, the XOR of old and new bits (a rank holding the old values gets
    the new ones from it) and each tensor's check. Not across several deltas, nor from a delta without
    checks: the caller then builds the change with the served version's copy. Across several deltas (see
    ``test_a_change_from_the_deltas_alone_across_a_chain_holds_each_steps_changes``)."""
    stream, states, tmp = chain
    out = tmp / "unbased.safetensors"
    summary = build_change_unbased(stream, out, base=2, version=3, max_fraction=0.5)
    assert summary.problem is None and summary.changed > 0
    patched = {name: t.clone() for name, t in states[2].items()}
    with safe_open(str(out), framework="pt") as handle:
        assert handle.metadata()["layout"] == "xor-1"
        for name, tensor in read_change(handle):
            assert tensor.old is None and tensor.new is None
            flat = patched[name].view(-1)
            ints = {2: torch.int16, 4: torch.int32}[flat.element_size()]
            old = flat[tensor.positions]
            new = (old.view(ints) ^ tensor.xor.view(ints)).view(flat.dtype)
            assert tensor.check == ChangeCheck(tensor.positions.numel(), check_sum(tensor.positions, old),
                                               check_sum(tensor.positions, new))
            flat[tensor.positions] = new
    assert _same(patched, states[3])
    manifest = stream.manifest(3)  # as a writer without checks (the device encoder) writes it
    unchecked = dataclasses.replace(manifest, tensors=tuple(dataclasses.replace(t, check=None)
                                                            for t in manifest.tensors))
    stream.storage.delete(manifest_path(3))
    stream.storage.put(manifest_path(3), unchecked.to_bytes())
    assert build_change_unbased(Stream(stream.url), tmp / "none.safetensors", base=2, version=3,
                                max_fraction=0.5).problem == UNCHECKED


def test_a_change_file_keeps_its_positions_in_int32_and_reads_int64_ones_alike(chain, monkeypatch):
    """Positions are written as int32 where every changed tensor's elements fit (half the bytes to write, read and
    send to a device); int64 where one does not; either reads to the same int64 positions, and a change file whose
    positions are neither is refused."""
    from safetensors.torch import save_file

    from ckptstream.vllm_loader.inplace import change as change_module

    stream, states, tmp = chain
    narrow, wide = tmp / "narrow.safetensors", tmp / "wide.safetensors"
    build_change_unbased(stream, narrow, base=0, version=1, max_fraction=0.5)
    monkeypatch.setattr(change_module, "_NARROW_POSITIONS_MAX", 7)  # (as if some tensor were past 2^31 elements)
    build_change_unbased(stream, wide, base=0, version=1, max_fraction=0.5)
    with safe_open(str(narrow), framework="pt") as a, safe_open(str(wide), framework="pt") as b:
        assert a.get_tensor("positions").dtype == torch.int32 and b.get_tensor("positions").dtype == torch.int64
        assert a.metadata() == b.metadata()
        read_a, read_b = dict(read_change(a)), dict(read_change(b))
        tensors, metadata = {key: b.get_tensor(key) for key in b.keys()}, b.metadata()
    assert read_a.keys() == read_b.keys() and read_a
    for name, tensor in read_a.items():
        assert tensor.positions.dtype == torch.int64 and torch.equal(tensor.positions, read_b[name].positions)
        assert torch.equal(bit_pattern(tensor.xor), bit_pattern(read_b[name].xor))
        assert tensor.check == read_b[name].check
    # (each tensor's positions against the full versions: the elements that differ)
    for name, tensor in read_a.items():
        differs = bit_pattern(states[0][name].reshape(-1)) != bit_pattern(states[1][name].reshape(-1))
        assert torch.equal(tensor.positions, differs.nonzero().view(-1)), name
    for path in (narrow, wide):  # every tensor's bytes start aligned to its dtype (a reader may view them in place)
        raw = path.read_bytes()
        length = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + length])
        sizes = {"I64": 8, "F64": 8, "I32": 4, "F32": 4, "BF16": 2, "F16": 2, "I16": 2}
        assert all((8 + length + spec["data_offsets"][0]) % sizes[spec["dtype"]] == 0
                   for name, spec in header.items() if name != "__metadata__")
    foreign = tmp / "foreign.safetensors"
    save_file({**tensors, "positions": tensors["positions"].to(torch.float64)}, str(foreign), metadata=metadata)
    with safe_open(str(foreign), framework="pt") as handle, pytest.raises(ValueError, match="positions are"):
        dict(read_change(handle))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bfloat16])
def test_ranges_gathered_from_a_window_on_a_device_equal_the_hosts_gather(dtype):
    """What a GPU worker does with a change file's tensors (``change._window``: the span holding a chunk's ranges,
    sent whole where it is dense enough; ``change._gather_window``: one index made there) gives the host's gather
    (numpy, by ranges): ranges out of order, adjacent, apart, repeated (a tensor copied twice), of one element, run
    here on the CPU's tensors; ranges one after the other are the window itself."""
    from ckptstream.vllm_loader.inplace.change import _WINDOW_SLACK, _gather_window, _ranges, _window
    from ckptstream.vllm_loader.inplace.upload import Uploads

    generator = torch.Generator().manual_seed(3)
    tensor = torch.randint(-2**15, 2**15, (5000,), generator=generator, dtype=torch.int64).to(dtype)
    other = tensor.flip(0).contiguous()  # (a second tensor gathered by the same index: old and new values)
    windowed = 0
    for _ in range(40):
        cuts = sorted(torch.randint(0, 5000, (16,), generator=generator).unique().tolist())
        ranges = [(start, stop - start) for start, stop in zip(cuts, cuts[1:]) if stop > start]
        ranges = [ranges[i] for i in torch.randperm(len(ranges), generator=generator).tolist()][:9]
        ranges += [ranges[0], (4999, 1)]
        expected = _ranges((tensor, other), ranges)
        low, high = min(s for s, _ in ranges), max(s + c for s, c in ranges)
        total = sum(count for _, count in ranges)
        assert expected[0].numel() == total and expected[0].dtype == dtype
        found = _window(ranges)
        assert (found is None) == (high - low > _WINDOW_SLACK * total)
        if found is not None:
            windowed += 1
            assert found == ((low, high), [(start - low, count) for start, count in ranges], total)
        got = _gather_window((tensor[low:high], other[low:high]), [(start - low, count) for start, count in ranges],
                             total)
        assert all(torch.equal(bit_pattern(g), bit_pattern(e)) for g, e in zip(got, expected))
        on_the_host = _ranges((tensor, other), ranges, Uploads(torch.device("cpu")))
        assert all(torch.equal(g, e) for g, e in zip(on_the_host, expected))
    assert 0 < windowed < 40  # (both decisions taken)
    (whole,) = _gather_window((tensor[10:30],), [(0, 5), (5, 15)], 20)
    assert whole.data_ptr() == tensor[10:30].data_ptr()
