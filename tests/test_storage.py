"""The generic storage suite: the same behaviour on every backend."""

from __future__ import annotations

import pytest

from ckptstream.storage import open_storage


@pytest.fixture
def storage(stream_url: str):
    return open_storage(stream_url)


def test_put_if_absent_is_exclusive(storage):
    storage.put_if_absent("manifests/a.json", b"first")
    with pytest.raises(FileExistsError):
        storage.put_if_absent("manifests/a.json", b"second")
    assert storage.read("manifests/a.json") == b"first"
    assert [e.name for e in storage.list("manifests")] == ["a.json"]  # no temp file left behind


def test_open_write_appears_only_on_success(storage):
    with pytest.raises(RuntimeError):
        with storage.open_write("versions/x/data.bin") as f:
            f.write(b"partial")
            raise RuntimeError("writer crashed")
    assert not storage.exists("versions/x/data.bin")
    assert [e for e in storage.list("versions/x") if not e.name.startswith(".tmp-")] == []
    with storage.open_write("versions/x/data.bin") as f:
        f.write(b"0123456789")
    assert storage.size("versions/x/data.bin") == 10
    assert storage.read("versions/x/data.bin", 2, 5) == b"234"
    buffer = bytearray(4)
    storage.read_into("versions/x/data.bin", 6, memoryview(buffer))
    assert bytes(buffer) == b"6789"
    with pytest.raises(EOFError):
        storage.read_into("versions/x/data.bin", 8, memoryview(bytearray(4)))


def test_list_delete_and_missing(storage):
    assert storage.list("nothing") == []
    with pytest.raises(FileNotFoundError):
        storage.read("nothing/here")
    storage.put("d/one", b"1")
    storage.put("d/sub/two", b"22")
    entries = {e.name: e for e in storage.list("d")}
    assert set(entries) == {"one", "sub"}
    assert entries["sub"].is_dir and not entries["one"].is_dir and entries["one"].size == 1
    assert entries["one"].mtime is not None
    storage.delete("d/one")
    storage.delete("d/one")  # missing is fine
    assert not storage.exists("d/one")
    storage.delete_tree("d")
    assert storage.list("d") == []


def test_put_replaces(storage):
    storage.put("replicas/r.json", b"old")
    storage.put("replicas/r.json", b"new")
    assert storage.read("replicas/r.json") == b"new"
