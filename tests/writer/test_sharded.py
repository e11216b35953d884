"""Publishing a sharded model without a gather (``DistributedPublisher.publish_sharded``, FORMAT.md "Tensors
in pieces"): real torch.distributed jobs over gloo on CPU, with a real FSDP2 ``fully_shard`` model (torch 2.13
shards it on a CPU device mesh) plus DTensors of other layouts made with ``distribute_tensor``. Every version,
a keyframe and a chain of deltas, reads back as exactly the ``full_tensor()`` of every tensor; a rank whose
pieces fail aborts the version on every rank, leaving nothing visible."""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

import pytest
import torch

from ckptstream import Stream
from ckptstream.format import ENCODING_PIECES, PIECES_FORMAT_VERSION
from ckptstream.testing.models import rl_like_step
from tests.helpers import assert_same_tensors, run_ranks

VERSIONS = 4  # a keyframe and three deltas


class _TinyLM(torch.nn.Module):
    """Shapes that no world size of 2 or 4 divides evenly (uneven last shards), and a tied embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(301, 64)
        self.proj = torch.nn.Linear(64, 129)
        self.lm_head = torch.nn.Linear(64, 301, bias=False)
        self.lm_head.weight = self.embed.weight


def _start(rank: int, world: int, port: int):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    return init_device_mesh("cpu", (world,))


def _extras(mesh) -> dict[str, torch.Tensor]:
    """Tensors of other layouts than FSDP2's Shard(0): a Shard(1), a replicated DTensor, a tensor shorter than
    a mesh of 4 (an empty shard), and a plain tensor, the same on every rank."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    g = torch.Generator().manual_seed(7)
    return {"cols.weight": distribute_tensor(torch.randn(5, 130, generator=g).bfloat16(), mesh, [Shard(1)]),
            "replicated.scale": distribute_tensor(torch.randn(33, generator=g), mesh, [Replicate()]),
            "short.weight": distribute_tensor(torch.randn(3, 8, generator=g), mesh, [Shard(0)]),
            "plain.steps": torch.arange(10)}


def _step(model: torch.nn.Module, extras: dict[str, torch.Tensor], rank: int, version: int) -> None:
    """An RL-like update of every rank's own shards (replicated tensors: the same change on every rank)."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        local = {n: p.to_local() for n, p in model.named_parameters()}
        local.update({n: t.to_local() for n, t in extras.items()
                      if n not in ("replicated.scale", "hsdp.weight") and isinstance(t, DTensor)})
        rl_like_step(local, fraction=0.02, generator=torch.Generator().manual_seed(1000 * version + rank))
        rl_like_step({"r": extras["replicated.scale"].to_local()}, generator=torch.Generator().manual_seed(version))


def _sharded_worker(rank: int, world: int, port: int, url: str, report: str) -> None:
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from ckptstream.writer.distributed import DistributedPublisher

    mesh = _start(rank, world, port)
    torch.manual_seed(0)
    model = _TinyLM().to(torch.bfloat16)
    fully_shard(model, mesh=mesh)
    extras = _extras(mesh)
    if world == 4:  # HSDP's layout: replicated over the first mesh dimension, sharded over the second
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        extras["hsdp.weight"] = distribute_tensor(torch.randn(7, 10, generator=torch.Generator().manual_seed(9)),
                                                  hsdp, [Replicate(), Shard(0)])
    kinds = []
    with DistributedPublisher(url, timeout=datetime.timedelta(seconds=60)) as publisher:
        for version in range(VERSIONS):
            if version:
                _step(model, extras, rank, version)
            state = {**model.state_dict(), **extras}
            kinds.append(publisher.publish_sharded(state, version).result().kind)
            # What the version must read back as: the whole tensors, gathered here for the test only.
            full = {n: (t.full_tensor() if isinstance(t, DTensor) else t).contiguous().clone()
                    for n, t in state.items()}
            if rank == 0:
                save_file(full, str(Path(report, f"full{version}.safetensors")))
    Path(report, f"rank{rank}.json").write_text(json.dumps(kinds))
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [1, 2, 4])
def test_fsdp2_model_published_from_its_shards(world: int, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    url = str(tmp_path / "stream")
    assert run_ranks(_sharded_worker, world, url, str(tmp_path), timeout=300) == [0] * world
    for rank in range(world):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == ["keyframe"] + ["delta"] * (VERSIONS - 1)
    stream = Stream(url)
    assert stream.versions() == list(range(VERSIONS))
    for version in range(VERSIONS):
        assert_same_tensors(dict(stream.iter_tensors(version)), load_file(tmp_path / f"full{version}.safetensors"))
    last = stream.manifest(VERSIONS - 1)
    out = stream.materialize(VERSIONS - 1, tmp_path / "materialized")
    assert_same_tensors(load_file(out / "model.safetensors"), load_file(tmp_path / f"full{VERSIONS - 1}.safetensors"))
    stream.verify(VERSIONS - 1)

    pieced = {t.name: t.pieces for t in last.tensors if t.encoding == ENCODING_PIECES}
    if world == 1:  # each shard is the whole tensor: written whole, readable by readers of format 1
        assert not pieced and last.format_version == 1
        return
    assert last.format_version == PIECES_FORMAT_VERSION and len(last.files) == world  # each rank its own file
    rows = [p.shape[0] for p in pieced["embed.weight"]]
    assert rows == [151, 150] if world == 2 else rows == [76, 76, 76, 73]
    assert [p.offsets for p in pieced["lm_head.weight"]] == [p.offsets for p in pieced["embed.weight"]]  # tied
    assert [p.offsets[1] for p in pieced["cols.weight"]] == ([0, 65] if world == 2 else [0, 33, 66, 99])
    assert len(pieced["short.weight"]) == min(world, 3)  # rank 3's shard of 3 rows is empty
    assert {"replicated.scale", "plain.steps"}.isdisjoint(pieced)  # written once, whole
    if world == 4:  # each shard written by one of its two replicas
        assert [(p.offsets, p.shape) for p in pieced["hsdp.weight"]] == [((0, 0), (4, 10)), ((4, 0), (3, 10))]
    assert {p.encoding for ps in pieced.values() for p in ps} <= {"xor-zstd", "unchanged"}  # deltas per piece
    # From a materialized base copy: every piece's chain stops at the base copy's box.
    base = stream.materialize(0, tmp_path / "base")
    again = stream.materialize(VERSIONS - 1, tmp_path / "from-base", base_dir=base)
    assert_same_tensors(load_file(again / "model.safetensors"), load_file(tmp_path / f"full{VERSIONS - 1}.safetensors"))


def _device_worker(rank: int, world: int, port: int, url: str, report: str, spans: bool) -> None:
    """The same sharded versions published twice: through the device encoder (its CPU reference: the same
    torch code) and through the host encoder, each into its own stream."""
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from ckptstream.writer import device_encode
    from ckptstream.writer.distributed import DistributedPublisher

    if spans:  # every tensor compared on the "device" in spans of 50 elements (else: staged whole, compared on
        # landing); no payload budget (spans this small make the payload outweigh the changes)
        device_encode.WHOLE_BYTES, device_encode.HOST_COMPARED_RATIO, device_encode.SPAN_BYTES = 0, 0.0, 100
        device_encode.MAX_PAYLOAD_RATIO = 100.0
    mesh = _start(rank, world, port)
    torch.manual_seed(0)
    model = _TinyLM().to(torch.bfloat16)
    fully_shard(model, mesh=mesh)
    extras = _extras(mesh)
    options = dict(timeout=datetime.timedelta(seconds=60), chunk_bytes=1024, delta_max_ratio=10.0)
    landed = []
    with DistributedPublisher(f"{url}-device", device_delta=True, **options) as device, \
            DistributedPublisher(f"{url}-host", device_delta=False, **options) as host:
        for version in range(VERSIONS):
            if version:
                _step(model, extras, rank, version)
            state = {**model.state_dict(), **extras}
            kinds = [publisher.publish_sharded(state, version).result().kind for publisher in (device, host)]
            assert kinds[0] == kinds[1], (version, kinds)
            capture = device._publisher._device.landed  # (which changes the device encoder found)
            landed.append([capture.version, capture.previous, len(capture.compared)])
            full = {n: (t.full_tensor() if isinstance(t, DTensor) else t).contiguous().clone()
                    for n, t in state.items()}  # (a collective: on every rank)
            if rank == 0:
                save_file(full, str(Path(report, f"full{version}.safetensors")))
    Path(report, f"rank{rank}.json").write_text(json.dumps(landed))
    dist.destroy_process_group()


@pytest.mark.parametrize("world,spans", [(2, True), (4, False)], ids=["2-spans", "4-whole"])
def test_pieces_go_through_the_device_encoder(world: int, spans: bool, tmp_path: Path) -> None:
    """Each rank's pieces through the device encoder: changes found against its own resident copies, each
    piece a delta on the same rank's piece, with the entries, chunks and change checks (taken at positions
    in the whole tensor) that the host encoder writes for the same pieces."""
    from safetensors.torch import load_file

    from ckptstream.testing.storage import stored_entries

    url = str(tmp_path / "stream")
    assert run_ranks(_device_worker, world, url, str(tmp_path), spans, timeout=300) == [0] * world
    for rank in range(world):
        landed = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert [v for v, _, _ in landed] == list(range(VERSIONS))
        assert [p for _, p, _ in landed] == [None] + list(range(VERSIONS - 1))  # deltas from the device's changes
        assert all(compared > 0 for _, _, compared in landed[1:])
    device, host = Stream(f"{url}-device"), Stream(f"{url}-host")
    assert [device.manifest(v).kind for v in range(VERSIONS)] == ["keyframe"] + ["delta"] * (VERSIONS - 1)
    for version in range(VERSIONS):
        assert stored_entries(device, version) == stored_entries(host, version), f"version {version}"
        assert_same_tensors(dict(device.iter_tensors(version)), load_file(tmp_path / f"full{version}.safetensors"))
    last = device.manifest(VERSIONS - 1)
    pieces = [p for t in last.tensors if t.encoding == ENCODING_PIECES for p in t.pieces]
    assert len({p.file for p in pieces}) == world and {p.encoding for p in pieces} <= {"xor-zstd", "unchanged"}
    assert all(p.check is not None and p.check.count == p.changed for p in pieces if p.encoding == "xor-zstd")
    assert any(p.offsets[0] for p in pieces)  # (checks at positions in the whole tensor: some pieces start inside it)
    device.verify(VERSIONS - 1)


def _failing_worker(rank: int, world: int, port: int, url: str, report: str) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Partial, Shard

    from ckptstream.writer.distributed import DistributedPublisher

    mesh = _start(rank, world, port)
    good = _extras(mesh)
    outcomes = {}
    with DistributedPublisher(url, timeout=datetime.timedelta(seconds=60)) as publisher:
        outcomes["0"] = publisher.publish_sharded(good, 0).result().kind
        # Version 1: rank 1 holds a partial sum, which cannot be published without a reduction.
        partial = DTensor.from_local(torch.ones(4), mesh, [Partial()])
        bad = {**good, "partial.weight": partial} if rank == 1 else good
        # Version 2: rank 1's pieces of a tensor disagree with rank 0's on its shape (found at the commit).
        local = torch.ones(2, 8)
        shape = (4, 8) if rank == 0 else (5, 8)
        odd = {**good, "odd.weight": DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=shape,
                                                        stride=(8, 1))}
        for version, state in ((1, bad), (2, odd)):
            try:
                publisher.publish_sharded(state, version).result()
                outcomes[str(version)] = "committed"
            except Exception as exc:  # noqa: BLE001 - the outcome is what the test checks
                outcomes[str(version)] = f"{type(exc).__name__}: {exc}"
            try:
                publisher.wait()  # (the failure is raised once more there)
            except Exception:  # noqa: BLE001
                pass
        outcomes["3"] = publisher.publish_sharded(good, 3).result().kind
    Path(report, f"rank{rank}.json").write_text(json.dumps(outcomes))
    dist.destroy_process_group()


def test_a_rank_whose_pieces_fail_aborts_the_version_on_every_rank(tmp_path: Path) -> None:
    url = str(tmp_path / "stream")
    assert run_ranks(_failing_worker, 2, url, str(tmp_path), timeout=240) == [0, 0]
    outcomes = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert outcomes[1]["1"].startswith("TypeError") and "Partial" in outcomes[1]["1"]
    assert outcomes[0]["1"].startswith("PublishError") and "rank 1 failed (TypeError" in outcomes[0]["1"]
    for rank_outcomes in outcomes:
        assert rank_outcomes["0"] == rank_outcomes["3"] == "keyframe"
        assert rank_outcomes["2"].startswith("PublishError") and "odd.weight" in rank_outcomes["2"]
        assert "disagree on its dtype or shape" in rank_outcomes["2"]
    stream = Stream(url)
    assert stream.versions() == [0, 3]
    assert [e.path for v in (1, 2) for e in stream.storage.list(f"versions/{v:012d}")] == []  # no debris left
    assert set(dict(stream.iter_tensors(3))) == {"cols.weight", "replicated.scale", "short.weight", "plain.steps"}


def test_a_delta_never_applies_a_whole_tensor_to_pieces(tmp_path: Path) -> None:
    """One process taking a stream published in pieces over (the whole tensors of its latest version): a
    tensor stored in pieces in the base is written in full (zstd), never XORed against the pieces; a tensor
    stored whole in both is a delta as always."""
    import shutil

    from ckptstream import Publisher

    url = str(tmp_path / "stream")
    shutil.copytree(Path(__file__).resolve().parents[1] / "data" / "golden-pieces", url)
    tensors = dict(Stream(url).iter_tensors(1))
    tensors["norm.weight"][0] = 3.0
    with Publisher(url, delta_max_ratio=4.0) as publisher:  # (tiny tensors: zstd frames outweigh their bytes)
        manifest = publisher.publish(tensors).result()
    assert manifest.version == 2 and manifest.kind == "delta" and manifest.format_version == 1
    encodings = {t.name: t.encoding for t in manifest.tensors}
    assert encodings == {"embed.weight": "zstd", "proj.weight": "zstd", "norm.weight": "xor-zstd",
                         "tiny.bias": "unchanged"}
    assert_same_tensors(dict(Stream(url).iter_tensors(2)), tensors)


def _killed_worker(rank: int, world: int, port: int, url: str, report: str) -> None:
    """Version 0 on both ranks; in version 1 rank 1 is SIGKILLed once its piece's file is written, before it
    reports it (the kill is real; the patch only decides when it happens)."""
    import signal


    from ckptstream.writer.distributed import DistributedPublisher

    mesh = _start(rank, world, port)
    state = _extras(mesh)
    publisher = DistributedPublisher(url, timeout=datetime.timedelta(seconds=60))
    publisher.publish_sharded(state, 0).result()
    if rank == 1:
        storage = publisher.storage
        real_open_write = storage.open_write

        class _Dying:
            def __init__(self, path):
                self.inner = real_open_write(path)

            def __enter__(self):
                return self.inner.__enter__()

            def __exit__(self, *exc):
                self.inner.__exit__(*exc)
                os.kill(os.getpid(), signal.SIGKILL)

        storage.open_write = _Dying
    try:
        publisher.publish_sharded(state, 1, keyframe=True).result()  # (a keyframe: every rank writes a file)
        outcome = "committed"
    except Exception as exc:  # noqa: BLE001 - the outcome is what the test checks
        outcome = f"{type(exc).__name__}: {exc}"
    Path(report, f"rank{rank}.json").write_text(json.dumps(outcome))
    os._exit(0)  # (the group lost a rank: no orderly shutdown of it)


def test_a_killed_rank_leaves_no_visible_version(tmp_path: Path) -> None:
    url = str(tmp_path / "stream")
    codes = run_ranks(_killed_worker, 2, url, str(tmp_path), timeout=240)
    assert codes == [0, -9]
    assert not json.loads((tmp_path / "rank0.json").read_text()).startswith("committed")
    stream = Stream(url)
    assert stream.versions() == [0]  # rank 1's written piece is debris for gc, invisible to readers
    assert stream.latest() == 0 and len(dict(stream.iter_tensors(0))) == 4


def test_a_whole_tensor_xor_on_pieces_is_refused_by_readers(tmp_path: Path, monkeypatch) -> None:
    """A writer that XORs a whole tensor against its pieces (what the layout check above prevents: here it is
    switched off to make one) is refused by every reader, naming the version and the tensor."""
    import shutil

    from ckptstream import IntegrityError, Publisher
    from ckptstream.writer import publisher as publisher_module

    url = str(tmp_path / "stream")
    shutil.copytree(Path(__file__).resolve().parents[1] / "data" / "golden-pieces", url)
    tensors = dict(Stream(url).iter_tensors(1))
    monkeypatch.setattr(publisher_module, "_same_layout_base", lambda base, pieces: base)
    with Publisher(url, delta_max_ratio=4.0) as publisher:
        assert publisher.publish(tensors).result().tensor("embed.weight").encoding == "unchanged"
    with pytest.raises(IntegrityError, match="stores the tensor whole, its base version 1 in pieces") as refused:
        dict(Stream(url).iter_tensors(2))
    assert refused.value.version == 2 and refused.value.tensor in ("embed.weight", "proj.weight")
