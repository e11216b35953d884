"""Materialized directories: plain HF layout that vLLM loads, built atomically, also from a local base."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from ckptstream import IntegrityError, Publisher, Stream
from ckptstream.hf import iter_hf_weights
from ckptstream.testing.models import rl_like_step
from tests.helpers import assert_same_tensors


@pytest.fixture
def model_stream(stream_url, tiny_model):
    state = dict(iter_hf_weights(tiny_model))
    history = []
    with Publisher(stream_url, assets=tiny_model, keyframe_every=3) as publisher:
        for step in range(5):
            if step:
                rl_like_step(state, fraction=0.01)
            history.append({k: v.clone() for k, v in state.items()})
            publisher.publish(state, step=step).result()
    return stream_url, history


def test_materialize_writes_a_servable_directory(model_stream, tiny_model, tmp_path):
    url, history = model_stream
    out = Stream(url).materialize("latest", tmp_path / "out")
    assert_same_tensors(load_file(out / "model.safetensors"), history[4])
    for name in ("config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (tiny_model / name).read_bytes()
    assert json.loads((out / "ckptstream.json").read_text())["version"] == 4
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_materialize_sharded_with_index(model_stream, tmp_path):
    url, history = model_stream
    out = Stream(url).materialize(2, tmp_path / "sharded", shard_bytes=100_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1
    loaded = {}
    for f in files:
        loaded.update(load_file(out / f))
    assert_same_tensors(loaded, history[2])


def test_materialize_from_a_local_base(model_stream, tmp_path):
    url, history = model_stream
    stream = Stream(url)
    base = stream.materialize(3, tmp_path / "v3")
    out = stream.materialize(4, tmp_path / "v4", base_dir=base)
    assert_same_tensors(load_file(out / "model.safetensors"), history[4])
    # A corrupted base copy is detected, not silently used.
    tensors = load_file(base / "model.safetensors")
    name = next(iter(tensors))
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 1
    from safetensors.torch import save_file

    save_file(tensors, str(base / "model.safetensors"))
    with pytest.raises(Exception, match="base copy differs"):
        stream.materialize(4, tmp_path / "v4b", base_dir=base)
    assert not (tmp_path / "v4b").exists()


def test_materialize_refuses_to_clobber(model_stream, tmp_path):
    url, history = model_stream
    stream = Stream(url)
    out = stream.materialize(0, tmp_path / "m")
    with pytest.raises(FileExistsError):
        stream.materialize(1, out)
    stream.materialize(1, out, overwrite=True)
    assert_same_tensors(load_file(out / "model.safetensors"), history[1])


def test_diff_counts_changed_elements(model_stream):
    url, history = model_stream
    diffs = {d.name: d for d in Stream(url).diff(1, 2)}
    for name, before in history[1].items():
        after = history[2][name]
        changed = int((before.view(torch.int16) != after.view(torch.int16)).sum())
        assert diffs[name].changed == changed
        assert diffs[name].status == ("same" if changed == 0 else "changed")


def test_applying_deltas_to_a_base_in_segments(model_stream, tmp_path, monkeypatch):
    """Deltas applied to a base copy go through in segments (read, patched, hashed, written): with segments
    far smaller than the tensors, across two deltas, the result is the version's; a damaged base is refused
    naming it, and the output never appears."""
    from ckptstream.reader import decode

    monkeypatch.setattr(decode, "SEGMENT_BYTES", 4096 + 2)  # not a divisor of the tensors' sizes
    url, history = model_stream
    stream = Stream(url)
    base = stream.materialize(0, tmp_path / "v0")
    out = stream.materialize(2, tmp_path / "v2", base_dir=base)
    assert_same_tensors(load_file(out / "model.safetensors"), history[2])
    monkeypatch.setattr(decode, "STREAM_MAX_CHANGES_BYTES", 100)  # more changes than that: decoded whole
    out = stream.materialize(2, tmp_path / "v2-whole", base_dir=base)
    assert_same_tensors(load_file(out / "model.safetensors"), history[2])
    monkeypatch.undo()
    monkeypatch.setattr(decode, "SEGMENT_BYTES", 4096 + 2)
    tensors = load_file(base / "model.safetensors")
    name = max(tensors, key=lambda n: tensors[n].numel())
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[-1] += 1  # in its last segment
    from safetensors.torch import save_file

    save_file(tensors, str(base / "model.safetensors"))
    with pytest.raises(Exception, match="base copy differs") as info:
        stream.materialize(2, tmp_path / "v2b", base_dir=base)
    assert info.value.tensor == name
    assert not (tmp_path / "v2b").exists()


def test_materialize_streams_from_the_stored_start(tmp_path, monkeypatch):
    """A tensor whose chain starts at a keyframe (raw) or at the delta that introduced it (zstd chunks) goes
    through in segments from storage, here far smaller than the tensors: the result is the version's. A
    damaged keyframe byte in a late segment is refused naming the keyframe, its file and the tensor (the
    stored hash that the segments skip is checked by the whole decode that traces the mismatch), and the
    output never appears."""
    from ckptstream.format import data_path
    from ckptstream.reader import decode

    monkeypatch.setattr(decode, "SEGMENT_BYTES", 4096 + 2)  # not a divisor of the tensors' sizes
    url = str(tmp_path / "stream")
    generator = torch.Generator().manual_seed(0)
    state = {"c": torch.randn(3000, 7, generator=generator).to(torch.bfloat16),  # stored before the larger "a"
             "a": torch.randn(30000, 7, generator=generator).to(torch.bfloat16),
             "small": torch.randn(5, generator=generator).to(torch.bfloat16)}
    history = []
    with Publisher(url, keyframe_every=10, chunk_bytes=8192) as publisher:
        for step in range(3):
            if step == 1:  # new in a delta: stored whole there, in zstd chunks of 8 KiB
                state["b"] = torch.randn(2000, 3, generator=generator)
            if step:
                rl_like_step(state, fraction=0.01, generator=generator)
            history.append({k: v.clone() for k, v in state.items()})
            publisher.publish(state, step=step).result()
    stream = Stream(url)
    chain = {m.version: m for m in stream.chain(2)}
    plans = {e.name: decode.plan_tensor(stream._files, chain.__getitem__, chain[2], e) for e in chain[2].tensors}
    assert [plans[n].steps[-1][1].encoding for n in ("a", "b")] == ["raw", "zstd"]
    assert len(plans["b"].steps[-1][1].chunks) > 1 and len(plans["b"].segments.bounds) > 2
    assert plans["a"].segments is not None  # ("small" has dense chunks: decoded whole)
    # Decoded whole first; then the streamed ones in the order of their stored bytes, not of their sizes.
    assert [plan.entry.name for plan in sorted(plans.values(), key=decode.decode_order)] == ["small", "c", "a", "b"]
    assert plans["small"].stored_root is None
    a, b = chain[0].tensor("a"), chain[1].tensor("b")
    assert (plans["a"].stored_root, plans["b"].stored_root) == ((0, a.file, a.offset), (1, b.file, b.offset))
    out = stream.materialize(2, tmp_path / "v2")
    assert_same_tensors(load_file(out / "model.safetensors"), history[2])

    entry = chain[0].tensor("a")
    path = tmp_path / "stream" / data_path(0, entry.file)
    original = path.read_bytes()
    data = bytearray(original)
    data[entry.offset + entry.length - 10] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="stored bytes hash mismatch") as info:
        stream.materialize(2, tmp_path / "bad")
    assert (info.value.version, info.value.tensor, info.value.file) == (0, "a", data_path(0, entry.file))
    assert not (tmp_path / "bad").exists()

    path.write_bytes(original)  # then a damaged byte in a zstd chunk of the delta that introduced "b"
    entry = chain[1].tensor("b")
    path = tmp_path / "stream" / data_path(1, entry.file)
    data = bytearray(path.read_bytes())
    data[entry.offset + entry.chunks[0][1] + 5] ^= 0x40  # inside its second chunk
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError) as info:
        stream.materialize(2, tmp_path / "bad")
    assert (info.value.version, info.value.tensor, info.value.file) == (1, "b", data_path(1, entry.file))
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("writes", ["mapped", "pwrite", "unreservable"])
def test_materialize_writes_its_shards_each_way(model_stream, tmp_path, monkeypatch, writes):
    """The shards come out the same written through a mapping (machines of many cores; forced here), with
    pwrite (few cores: this CI machine's way), and with pwrite where the file system cannot reserve blocks
    (NFSv3, macOS: none is at hand here, so the C library's ``fallocate`` is taken away)."""
    from ckptstream.reader import materialize

    monkeypatch.setattr(materialize, "MAPPED_WRITES_MIN_CORES", 1 if writes != "pwrite" else 10**6)
    if writes == "unreservable":
        monkeypatch.setattr(materialize, "_fallocate", lambda: None)
    url, history = model_stream
    out = Stream(url).materialize(4, tmp_path / "out", shard_bytes=100_000)
    loaded = {}
    for path in out.glob("*.safetensors"):
        loaded.update(load_file(path))
    assert_same_tensors(loaded, history[4])


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root (CI runs as root)")
def test_a_full_disk_is_an_error_not_a_crash(tmp_path, tiny_model):
    """On a real full file system (a 64 KiB tmpfs in a mount namespace of its own), materialize writing
    through a mapping raises ENOSPC from the write that found no space, and leaves no output: each write
    reserves its blocks first, so the process gets no SIGBUS."""
    url = str(tmp_path / "stream")
    with Publisher(url, assets=tiny_model) as publisher:
        publisher.publish(dict(iter_hf_weights(tiny_model)), step=0).result()
    mount = tmp_path / "small"
    mount.mkdir()
    script = ("import errno, sys\n"
              "from ckptstream import Stream\n"
              "from ckptstream.reader import materialize\n"
              "materialize.MAPPED_WRITES_MIN_CORES = 1\n"  # (the way that could meet a SIGBUS)
              "try:\n"
              f"    Stream({url!r}).materialize(0, {str(mount / 'out')!r})\n"
              "except OSError as exc:\n"
              "    print('errno', errno.errorcode.get(exc.errno))\n")
    result = subprocess.run(
        ["unshare", "--mount", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {mount} && \"$0\" -c \"$1\" && "
         f"ls -A {mount}", sys.executable, script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["errno", "ENOSPC"], result.stdout  # and `ls` found nothing left


@pytest.mark.parametrize("start", ["raw", "zstd"])
def test_a_streamed_tensor_is_asked_for_ahead_of_its_reads(tmp_path, monkeypatch, start):
    """Each decoding thread hints its tensor's stored bytes to the storage (``will_read``) ahead of its
    reads, up to ``READ_AHEAD_BYTES`` beyond the segment just read: every byte of the entry after its first
    read is hinted once, in order, before it is read, and never more than that depth ahead (the calls
    recorded on the real storage). A keyframe's raw bytes go in fixed segments, the zstd chunks of a tensor
    new in a delta chunk by chunk."""
    from ckptstream.reader import decode
    from ckptstream.storage.posix import PosixStorage

    depth = 4 * 4096
    monkeypatch.setattr(decode, "SEGMENT_BYTES", 4096)
    monkeypatch.setattr(decode, "READ_AHEAD_BYTES", depth)
    url = str(tmp_path / "stream")
    state = {"a": torch.randn(100_000, generator=torch.Generator().manual_seed(0))}  # 400 KB
    with Publisher(url, chunk_bytes=8192) as publisher:
        publisher.publish(state).result()
        if start == "zstd":  # new in a delta: stored whole there, in zstd chunks
            state["b"] = torch.randn(100_000, generator=torch.Generator().manual_seed(1))  # 49 chunks
            publisher.publish(state).result()
    version, name = (0, "a") if start == "raw" else (1, "b")
    entry = Stream(url).manifest(version).tensor(name)
    assert entry.encoding == start
    events: list[tuple[str, int, int]] = []
    real_will_read, real_read_into = PosixStorage.will_read, PosixStorage.read_into

    def will_read(self, path, offset, length):
        if offset >= entry.offset and path.endswith(entry.file):
            events.append(("hint", offset, length))
        return real_will_read(self, path, offset, length)

    def read_into(self, path, offset, out):
        if offset >= entry.offset and path.endswith(entry.file) and offset + len(out) <= entry.offset + entry.length:
            events.append(("read", offset, len(out)))
        return real_read_into(self, path, offset, out)

    monkeypatch.setattr(PosixStorage, "will_read", will_read)
    monkeypatch.setattr(PosixStorage, "read_into", read_into)
    out = Stream(url).materialize(version, tmp_path / "out")
    assert_same_tensors(load_file(out / "model.safetensors"), state)
    reads = [(offset, length) for kind, offset, length in events if kind == "read"]
    hints = [(offset, length) for kind, offset, length in events if kind == "hint"]
    assert len(reads) > 20 and len(hints) > 5
    covered = reads[0][0] + reads[0][1]  # the first read is not hinted; the rest is, in order
    for offset, length in hints:
        assert offset == covered and length > 0
        covered += length
    assert covered == entry.offset + entry.length
    hinted, depths = reads[0][0] + reads[0][1], []
    for kind, offset, length in events[1:]:
        if kind == "hint":
            hinted = offset + length
        else:
            depths.append(hinted - (offset + length))
    assert min(depths) >= 0  # each read was hinted before it
    assert max(depths) <= depth and max(depths) > reads[1][1]  # deeper than the next read alone
