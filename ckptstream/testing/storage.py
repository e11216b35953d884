"""The generic storage suite: the behaviour every ``Storage`` backend must show, shipped with the package so
that a new backend (in ckptstream or outside it) proves itself by subclassing it, as zarr's store tests do.

Usage (pytest collects the subclass, not this base)::

    class TestMyStorage(WritableStorageSuite):   # ReadOnlyStorageSuite for a backend that cannot write
        @pytest.fixture
        def storage(self, tmp_path):
            return MyStorage(...)

        def populate(self, storage, files):  # bypass the storage under test
            ...

A read-only backend subclasses ``ReadOnlyStorageSuite`` and must implement :meth:`StorageSuite.populate` (the
suite then checks that every write is refused and that reads work on files put there another way).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Mapping
from typing import Any, ClassVar

import pytest

from ..errors import IntegrityError, StorageCapabilityError
from ..format import TEMP_PREFIX
from ..storage import Capabilities, Storage

__all__ = ["ReadOnlyStorageSuite", "StorageSuite", "WritableStorageSuite"]

# 1 KiB whose bytes all differ from their neighbours, so that an off-by-one range shows.
DATA = bytes(range(256)) * 4
FILE = "d/data.bin"


class StorageSuite:
    """Generic tests of a ``Storage`` backend; subclass it with a ``storage`` fixture (see the module)."""

    read_only: ClassVar[bool] = False
    """The backend cannot write: the suite checks writes are refused, and fills it through ``populate``."""

    notify_timeout: ClassVar[float] = 10.0
    """Seconds a watch may take to report a change."""

    @pytest.fixture
    def storage(self) -> Storage:
        """A fresh, empty storage of the backend under test; each subclass provides it."""
        raise NotImplementedError(f"{type(self).__name__} must define a `storage` fixture")

    def populate(self, storage: Storage, files: Mapping[str, bytes]) -> None:
        """Put ``files`` (path → bytes) into ``storage``. Override it to write without the storage's own
        methods (required for a read-only backend); by default it uses ``storage.put``."""
        if self.read_only:
            raise NotImplementedError(f"{type(self).__name__} is read-only and must define populate()")
        for path, data in files.items():
            storage.put(path, data)

    # ------------------------------------------------------------------------------------- capabilities

    def test_capabilities_are_declared(self, storage: Storage) -> None:
        caps = storage.capabilities
        assert isinstance(caps, Capabilities)
        assert storage.is_posix == caps.posix
        assert storage.atomic_create == caps.put_if_absent
        assert caps.writable == (not self.read_only)
        if not caps.writable:
            assert not caps.put_if_absent
        with pytest.raises(AttributeError):
            caps.writable = not caps.writable  # type: ignore[misc]  # frozen: nobody changes what a backend can do

    # ------------------------------------------------------------------------------------------ reading

    def test_read_whole_and_ranges(self, storage: Storage) -> None:
        self.populate(storage, {FILE: DATA, "d/empty": b""})
        assert storage.read(FILE) == DATA
        assert storage.read(FILE, 10, 20) == DATA[10:20]
        assert storage.read(FILE, 1000) == DATA[1000:]
        assert storage.read(FILE, None, 5) == DATA[:5]
        assert storage.read(FILE, 1020, 1030) == DATA[1020:]  # fewer at the end of the file
        assert storage.read(FILE, 5, 5) == b""
        assert storage.read(FILE, len(DATA), len(DATA) + 4) == b""
        assert storage.read(FILE, len(DATA) + 10, len(DATA) + 20) == b""
        assert storage.read("d/empty") == b""

    def test_read_small(self, storage: Storage) -> None:
        self.populate(storage, {FILE: DATA, "d/empty": b""})
        assert storage.read_small(FILE, len(DATA)) == DATA
        assert storage.read_small(FILE, 10 * len(DATA)) == DATA
        assert storage.read_small("d/empty", 16) == b""
        with pytest.raises(IntegrityError, match=f"file {FILE}: over the {len(DATA) - 1}-byte limit"):
            storage.read_small(FILE, len(DATA) - 1)
        with pytest.raises(FileNotFoundError):
            storage.read_small("nothing/here", 16)

    def test_missing_file(self, storage: Storage) -> None:
        with pytest.raises(FileNotFoundError):
            storage.read("nothing/here")
        with pytest.raises(FileNotFoundError):
            storage.read("nothing/here", 0, 4)
        with pytest.raises(FileNotFoundError):
            storage.read("nothing/here", 4, 4)
        with pytest.raises(FileNotFoundError):
            storage.read_into("nothing/here", 0, memoryview(bytearray(4)))
        with pytest.raises(FileNotFoundError):
            storage.read_ranges("nothing/here", [(0, 4), (4, 8)])
        with pytest.raises(FileNotFoundError):
            storage.size("nothing/here")
        with pytest.raises(FileNotFoundError):
            storage.open_read("nothing/here").read()
        assert not storage.exists("nothing/here")

    def test_read_into(self, storage: Storage) -> None:
        self.populate(storage, {FILE: DATA})
        buffer = bytearray(100)
        storage.read_into(FILE, 7, memoryview(buffer))
        assert bytes(buffer) == DATA[7:107]
        storage.read_into(FILE, 3, memoryview(bytearray(0)))  # nothing to read
        with pytest.raises(EOFError):
            storage.read_into(FILE, len(DATA) - 2, memoryview(bytearray(4)))
        with pytest.raises(EOFError):
            storage.read_into(FILE, len(DATA) + 8, memoryview(bytearray(4)))

    def test_read_ranges(self, storage: Storage) -> None:
        self.populate(storage, {FILE: DATA})
        ranges = [(0, 10), (5, 15), (100, 100), (1000, len(DATA)), (0, len(DATA)), (512, 513)]
        assert storage.read_ranges(FILE, ranges) == [DATA[s:e] for s, e in ranges]
        assert storage.read_ranges(FILE, []) == []
        with pytest.raises(EOFError):
            storage.read_ranges(FILE, [(0, 4), (len(DATA) - 2, len(DATA) + 2)])
        with pytest.raises(EOFError):
            storage.read_ranges(FILE, [(len(DATA) + 4, len(DATA) + 8)])
        with pytest.raises(ValueError):
            storage.read_ranges(FILE, [(8, 4)])

    def test_read_ranges_many(self, storage: Storage) -> None:
        """More ranges than run at once, in any order: each result is its own range's bytes."""
        rng = random.Random(0)
        data = rng.randbytes(1 << 16)
        self.populate(storage, {FILE: data})
        ranges = [(s, s + rng.randrange(1, 4096)) for s in (rng.randrange(0, len(data) - 4096) for _ in range(100))]
        assert storage.read_ranges(FILE, ranges) == [data[s:e] for s, e in ranges]

    def test_read_ranges_into(self, storage: Storage) -> None:
        self.populate(storage, {FILE: DATA})
        buffers = [bytearray(n) for n in (10, 0, 24, 1)]
        offsets = [0, 50, 1000, len(DATA) - 1]
        storage.read_ranges_into(FILE, [(o, memoryview(b)) for o, b in zip(offsets, buffers)])
        assert [bytes(b) for b in buffers] == [DATA[o:o + len(b)] for o, b in zip(offsets, buffers)]
        with pytest.raises(EOFError):
            storage.read_ranges_into(FILE, [(0, memoryview(bytearray(4))), (len(DATA) - 1, memoryview(bytearray(2)))])

    def test_open_read(self, storage: Storage) -> None:
        self.populate(storage, {FILE: DATA})
        with storage.open_read(FILE) as f:
            chunks = []
            while chunk := f.read(300):
                chunks.append(chunk)
        assert b"".join(chunks) == DATA

    def test_size(self, storage: Storage) -> None:
        self.populate(storage, {FILE: DATA, "d/empty": b""})
        assert storage.size(FILE) == len(DATA)
        assert storage.size("d/empty") == 0

    def test_exists_is_fresh(self, storage: Storage) -> None:
        assert not storage.exists(FILE)
        self.populate(storage, {FILE: DATA})  # behind the storage's back: no cached answer may remain
        assert storage.exists(FILE)
        assert not storage.exists("d")  # a directory is not a file

    def test_reads_after_a_listing_are_fresh(self, storage: Storage) -> None:
        """Files created or replaced behind the storage's back after their directory was listed are read,
        opened and sized as they are now: no cached listing may answer (a commit reads back the manifest
        it or another writer just stored, after listing ``manifests/`` to number the version)."""
        listed = storage.capabilities.listing
        self.populate(storage, {"d/other": b"1"})
        if listed:
            assert [e.name for e in storage.list("d")] == ["other"]
        self.populate(storage, {FILE: DATA})
        assert storage.read(FILE) == DATA
        with storage.open_read(FILE) as f:
            assert f.read() == DATA
        if listed:
            assert {e.name for e in storage.list("d")} == {"other", FILE.rsplit("/", 1)[1]}
        self.populate(storage, {FILE: DATA * 2})
        assert storage.read(FILE) == DATA * 2
        assert storage.size(FILE) == len(DATA) * 2
        with storage.open_read(FILE) as f:
            assert f.read() == DATA * 2

    def test_list(self, storage: Storage) -> None:
        if not storage.capabilities.listing:
            with pytest.raises(StorageCapabilityError):
                storage.list("d")
            return
        assert storage.list("nothing") == []
        self.populate(storage, {"d/one": b"1", "d/sub/two": b"22"})
        entries = {e.name: e for e in storage.list("d")}
        assert set(entries) == {"one", "sub"}
        assert entries["sub"].is_dir and not entries["one"].is_dir and entries["one"].size == 1
        assert entries["one"].mtime is not None
        assert [e.name for e in storage.list("d/sub")] == ["two"]

    # ------------------------------------------------------------------------------------------ changes

    def test_watch(self, storage: Storage) -> None:
        self.populate(storage, {"manifests/old.json": b"{}"})
        changed = threading.Event()
        watch = storage.watch("manifests", changed.set)
        if not storage.capabilities.notifications:
            assert watch is None
            return
        assert watch is not None
        try:
            time.sleep(0.2)  # let the watch settle
            assert storage.read("manifests/old.json") == b"{}"
            assert not changed.wait(0.5), "a read is not a change"
            self.populate(storage, {"manifests/new.json": b"{}"})
            assert changed.wait(self.notify_timeout), "no notification of a new file"
        finally:
            watch.stop()


class WritableStorageSuite(StorageSuite):
    """The suite of a backend that writes: atomic writes, put-if-absent (or its refusal), deletes."""

    def test_open_write_appears_only_on_success(self, storage: Storage) -> None:
        with pytest.raises(RuntimeError), storage.open_write("versions/x/data.bin") as f:
            f.write(b"partial")
            raise RuntimeError("writer crashed")
        assert not storage.exists("versions/x/data.bin")
        if storage.capabilities.listing:
            assert [e for e in storage.list("versions/x") if not e.name.startswith(TEMP_PREFIX)] == []
        with storage.open_write("versions/x/data.bin") as f:
            f.write(DATA[:500])
            f.write(DATA[500:])
        assert storage.read("versions/x/data.bin") == DATA

    def test_open_write_failure_keeps_the_old_file(self, storage: Storage) -> None:
        storage.put("r/file", b"old")
        with pytest.raises(RuntimeError), storage.open_write("r/file") as f:
            f.write(b"new, but never finished")
            raise RuntimeError("writer crashed")
        assert storage.read("r/file") == b"old"
        if storage.capabilities.listing:
            assert [e.name for e in storage.list("r") if not e.name.startswith(TEMP_PREFIX)] == ["file"]

    def test_put_replaces(self, storage: Storage) -> None:
        storage.put("replicas/r.json", b"old")
        storage.put("replicas/r.json", b"new")
        assert storage.read("replicas/r.json") == b"new"

    def test_put_if_absent_is_exclusive(self, storage: Storage) -> None:
        if not storage.capabilities.put_if_absent:
            with pytest.raises(StorageCapabilityError):
                storage.put_if_absent("manifests/a.json", b"first")
            assert not storage.exists("manifests/a.json")
            return
        storage.put_if_absent("manifests/a.json", b"first")
        with pytest.raises(FileExistsError):
            storage.put_if_absent("manifests/a.json", b"second")
        assert storage.read("manifests/a.json") == b"first"
        if storage.capabilities.listing:
            assert [e.name for e in storage.list("manifests")] == ["a.json"]  # no temp file left behind

    def test_put_if_absent_race_has_one_winner(self, storage: Storage) -> None:
        if not storage.capabilities.put_if_absent:
            return  # test_put_if_absent_is_exclusive checks that it is refused
        writers = 8
        start = threading.Barrier(writers)
        outcomes: dict[int, str] = {}

        def commit(i: int) -> None:
            start.wait()
            try:
                storage.put_if_absent("manifests/race.json", f"writer {i}".encode())
                outcomes[i] = "won"
            except FileExistsError:
                outcomes[i] = "lost"
            except Exception as exc:  # noqa: BLE001 - reported by the assertion below
                outcomes[i] = repr(exc)

        threads = [threading.Thread(target=commit, args=(i,)) for i in range(writers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        winners = [i for i, outcome in outcomes.items() if outcome == "won"]
        assert len(winners) == 1 and sorted(outcomes.values()) == ["lost"] * (writers - 1) + ["won"], outcomes
        assert storage.read("manifests/race.json") == f"writer {winners[0]}".encode()

    def test_touch_refreshes_the_modification_time(self, storage: Storage) -> None:
        storage.put(FILE, DATA)
        written = _mtime(storage, FILE)
        if written is not None:  # object stores keep whole seconds: wait until the clock shows a later one
            while time.time() < written + 1.5:
                time.sleep(0.05)
        storage.touch(FILE)
        assert storage.read(FILE) == DATA
        if written is not None:
            touched = _mtime(storage, FILE)
            assert touched is not None and touched > written, (written, touched)
        with pytest.raises(FileNotFoundError):
            storage.touch("never/was")

    def test_delete_is_idempotent(self, storage: Storage) -> None:
        storage.put("d/one", b"1")
        storage.delete("d/one")
        storage.delete("d/one")  # missing is fine
        assert not storage.exists("d/one")
        storage.delete("never/was")

    def test_delete_tree_is_idempotent(self, storage: Storage) -> None:
        storage.put("t/one", b"1")
        storage.put("t/sub/two", b"22")
        storage.put("keep", b"k")
        storage.delete_tree("t")
        storage.delete_tree("t")
        storage.delete_tree("never/was")
        assert not storage.exists("t/one") and not storage.exists("t/sub/two")
        assert storage.read("keep") == b"k"
        if storage.capabilities.listing:
            assert storage.list("t") == []


class ReadOnlyStorageSuite(StorageSuite):
    """The suite of a read-only backend: every write is refused; reads work on files ``populate`` put there."""

    read_only = True

    def test_writes_are_refused(self, storage: Storage) -> None:
        self.populate(storage, {FILE: DATA})
        with pytest.raises(StorageCapabilityError), storage.open_write(FILE) as f:
            f.write(b"x")
        with pytest.raises(StorageCapabilityError):
            storage.put(FILE, b"x")
        with pytest.raises(StorageCapabilityError):
            storage.put_if_absent("manifests/a.json", b"x")
        with pytest.raises(StorageCapabilityError):
            storage.delete(FILE)
        with pytest.raises(StorageCapabilityError):
            storage.touch(FILE)
        with pytest.raises(StorageCapabilityError):
            storage.delete_tree("d")
        assert storage.read(FILE) == DATA
        assert not storage.exists("manifests/a.json")


def stored_entries(stream: Any, version: int) -> list[tuple[dict, bytes | None]]:
    """What ``version`` of ``stream`` (a ``Stream``) stores, tensor by tensor (a tensor stored in pieces: then
    piece by piece): each manifest entry without its file name (which is unique to the writer) and its stored
    bytes; equal for two writers that encoded alike."""
    import dataclasses

    from ..format import data_path

    out = []
    for tensor in stream.manifest(version).tensors:
        for entry in (tensor, *tensor.pieces):
            data = None if entry.file is None else stream.storage.read(data_path(version, entry.file), entry.offset,
                                                                       entry.offset + entry.length)
            out.append(({k: v for k, v in dataclasses.asdict(entry).items() if k not in ("file", "pieces")}, data))
    return out


def _mtime(storage: Storage, path: str) -> float | None:
    """The modification time ``list`` reports for a file (None where the backend cannot list)."""
    if not storage.capabilities.listing:
        return None
    directory, _, name = path.rpartition("/")
    return next(e.mtime for e in storage.list(directory) if e.name == name)
