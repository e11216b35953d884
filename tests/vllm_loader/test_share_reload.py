"""The tensors a full reload hands vLLM's loaders (``share_reload.mapped_weights``), without vLLM: what they hold,
which files, bad files refused, and what a rank's slice reads; which reload the client asks a server for (the
engine itself: test_multinode.py)."""

from __future__ import annotations

import http.server
import json
import mmap

import pytest
import torch
from safetensors.torch import save_file

from ckptstream.errors import IntegrityError
from ckptstream.format import INDEX_FILE
from ckptstream.testing.pagecache import drop_pages, resident_bytes
from ckptstream.vllm_loader import VllmClient
from ckptstream.vllm_loader.share_reload import mapped_weights
from ckptstream.vllm_loader.worker import METHODS_METHOD, RELOAD_METHOD
from tests.helpers import serving


def test_the_mapped_tensors_are_the_files_tensors_as_vllm_reads_them(tmp_path):
    generator = torch.Generator().manual_seed(0)
    first = {"b.weight": torch.randn(64, 48, generator=generator).bfloat16(), "a.bias": torch.randn(7),
             "empty": torch.zeros(0, 3), "ids": torch.arange(5, dtype=torch.int64)}
    second = {"c.weight": torch.randn(3, 5, 2, generator=generator).half()}
    save_file(first, tmp_path / "model-00001-of-00002.safetensors")
    save_file(second, tmp_path / "model-00002-of-00002.safetensors")
    save_file({"stray": torch.ones(2)}, tmp_path / "unindexed.safetensors")  # (vLLM reads what the index names)
    weight_map = {name: "model-00001-of-00002.safetensors" for name in first}
    weight_map.update({name: "model-00002-of-00002.safetensors" for name in second})
    (tmp_path / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))

    with mapped_weights(tmp_path) as weights:
        got = list(weights)
        assert [name for name, _ in got] == ["a.bias", "b.weight", "empty", "ids", "c.weight"]
        for name, tensor in got:
            want = {**first, **second}[name]
            assert tensor.dtype == want.dtype and torch.equal(tensor, want), name
        assert torch.equal(got[1][1].narrow(1, 8, 16), first["b.weight"].narrow(1, 8, 16))
        del got, tensor

    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002"), mapped_weights(tmp_path):
        pass
    for path in [tmp_path / INDEX_FILE, *tmp_path.glob("*.safetensors")]:
        path.unlink()
    with pytest.raises(FileNotFoundError, match="no weight files"), mapped_weights(tmp_path):
        pass
    with pytest.raises(FileNotFoundError, match="no such checkpoint directory"), mapped_weights(tmp_path / "gone"):
        pass


def test_a_file_that_lies_about_its_tensors_is_refused(tmp_path):
    save_file({"w": torch.zeros(4, 4)}, tmp_path / "model.safetensors")
    raw = bytearray((tmp_path / "model.safetensors").read_bytes())
    at = raw.index(b'"shape":[4,4]')
    raw[at:at + 13] = b'"shape":[4,5]'  # (the same length: the header still parses)
    (tmp_path / "model.safetensors").write_bytes(raw)
    with mapped_weights(tmp_path) as weights, pytest.raises(IntegrityError, match="tensor w.*64 bytes for a F32"):
        next(weights)


def test_a_bad_file_is_refused_before_any_tensor_is_handed_over(tmp_path):
    """vLLM's layer-wise reload keeps what it was given of a layer it did not finish: a file refused after the
    first tensors were handed over would leave it views of maps closed since."""
    save_file({"a": torch.ones(4, 4)}, tmp_path / "model-00001-of-00002.safetensors")
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"\x08" + bytes(7) + b"not json")
    with mapped_weights(tmp_path) as weights, pytest.raises(IntegrityError, match="model-00002-of-00002"):
        next(weights)


def test_a_ranks_slice_reads_its_pages_only(tmp_path):
    rows, columns = 512, 4096  # (a row of 8 KiB: half a row is a page or two)
    save_file({"w": torch.ones(rows, columns, dtype=torch.bfloat16)}, tmp_path / "model.safetensors")
    files = [tmp_path / "model.safetensors"]
    size = files[0].stat().st_size
    drop_pages(files)
    if resident_bytes(files):
        pytest.skip("the temporary directory keeps its pages (a tmpfs): nothing to count")
    with mapped_weights(tmp_path) as weights:
        (_, tensor), = weights
        half = tensor.narrow(0, rows // 2, rows // 2)  # (a column-parallel rank's slice: contiguous)
        assert float(half.float().sum()) == rows // 2 * columns
        read = resident_bytes(files)
        assert size // 2 <= read <= size // 2 + 8 * mmap.PAGESIZE  # (its pages, and the header read ahead)
        del tensor, half
    drop_pages(files)
    assert resident_bytes(files) == 0, "the map outlived mapped_weights"


@pytest.mark.parametrize("extension", ["none", "older", "current"])
def test_the_client_reloads_through_the_worker_extension_where_the_server_has_it(extension):
    """A server with ckptstream's worker extension gets ``ckptstream_reload_weights``; one without it (vLLM
    refuses a method its workers lack), or with an older ckptstream's that lacks the method, vLLM's own
    ``reload_weights``, asked for the same directory."""
    calls = []
    methods = {"none": [], "older": ["ckptstream_label"], "current": ["ckptstream_label", METHODS_METHOD,
                                                                    RELOAD_METHOD]}[extension]

    class Server(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            calls.append(body)
            known = not body["method"].startswith("ckptstream_") or body["method"] in methods
            result = methods if body["method"] == METHODS_METHOD else None
            answer = json.dumps({"results": [result, result]} if known else {"error": "no such method"}).encode()
            self.send_response(200 if known else 500)
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: object) -> None:
            pass

    with serving(Server) as url:
        client = VllmClient(url)
        client.reload_weights("/cache/000000000007")
        client.reload_weights("/cache/000000000008")
    reloads = [call for call in calls if call["method"] in (RELOAD_METHOD, "reload_weights")]
    if extension == "current":
        assert reloads == [{"method": RELOAD_METHOD, "kwargs": {"path": f"/cache/00000000000{v}"}} for v in (7, 8)]
    else:
        assert reloads == [{"method": "reload_weights", "kwargs": {"weights_path": f"/cache/00000000000{v}",
                                                                   "is_checkpoint_format": True}} for v in (7, 8)]
    probes = len(calls) - len(reloads)  # (looked for once per client: the extension, then the method)
    assert probes == (1 if extension == "none" else 2)
