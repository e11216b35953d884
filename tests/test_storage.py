"""The generic storage suite run against every backend, and what is particular to each backend."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from ckptstream.cli import main
from ckptstream.errors import EXIT_INCOMPATIBLE, IntegrityError, StorageCapabilityError
from ckptstream.storage import (MAX_CONCURRENT_READS, Capabilities, FsspecStorage, PosixStorage, ReadOnlyStorage,
                                Storage, ThrottledStorage, open_storage, register_backend, registered_schemes, throttle)
from ckptstream.storage.base import concurrently
from ckptstream.testing.lossy_proxy import LossyProxy
from ckptstream.testing.storage import ReadOnlyStorageSuite, WritableStorageSuite
from tests.helpers import new_bucket, s3_refusing_every_put

# ------------------------------------------------------------------------------------ the suite, per backend


def _write_files(root: Path, files: Mapping[str, bytes]) -> None:
    for path, data in files.items():
        target = root.joinpath(*path.split("/"))
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)


class TestPosixStorage(WritableStorageSuite):
    @pytest.fixture
    def storage(self, tmp_path: Path) -> Storage:
        return open_storage(str(tmp_path / "stream"))

    def populate(self, storage: Storage, files: Mapping[str, bytes]) -> None:
        assert isinstance(storage, PosixStorage)
        _write_files(Path(storage.root), files)


class TestS3Storage(WritableStorageSuite):
    """FsspecStorage over s3fs, against a real S3-protocol server (moto) on loopback."""

    @pytest.fixture
    def storage(self, s3_endpoint: str) -> Storage:
        self.bucket = new_bucket(s3_endpoint)
        self.endpoint = s3_endpoint
        return open_storage(f"s3://{self.bucket}/runs/stream")

    def populate(self, storage: Storage, files: Mapping[str, bytes]) -> None:
        import boto3  # another client than the storage's own, so that no cache of it knows the files

        client = boto3.client("s3", endpoint_url=self.endpoint)
        for path, data in files.items():
            client.put_object(Bucket=self.bucket, Key=f"runs/stream/{path}", Body=data)


class TestMemoryStorage(WritableStorageSuite):
    """FsspecStorage over fsspec's memory:// file system: no atomic put-if-absent, files visible while
    being written (so writes go through a temporary name)."""

    @pytest.fixture
    def storage(self) -> Iterator[Storage]:
        storage = open_storage(f"memory://ckptstream-test-{uuid.uuid4().hex}/stream")
        yield storage
        assert isinstance(storage, FsspecStorage)
        storage.delete_tree("")  # memory:// is one store for the whole process

    def populate(self, storage: Storage, files: Mapping[str, bytes]) -> None:
        assert isinstance(storage, FsspecStorage)
        for path, data in files.items():
            storage.fs.pipe_file(f"{storage.root}/{path}", data)

    def test_memory_has_no_put_if_absent(self, storage: Storage) -> None:
        assert not storage.capabilities.put_if_absent and not storage.atomic_create


class TestReadOnlyStorage(ReadOnlyStorageSuite):
    """The read-only branch of the suite, on a read-only view of a POSIX directory."""

    @pytest.fixture
    def storage(self, tmp_path: Path) -> Storage:
        self.root = tmp_path / "stream"
        return ReadOnlyStorage(PosixStorage(str(self.root)))

    def populate(self, storage: Storage, files: Mapping[str, bytes]) -> None:
        _write_files(self.root, files)


class TestThrottledStorage(WritableStorageSuite):
    """A throttled view of a POSIX directory behaves as a storage (at a rate high enough not to slow the suite,
    and with pieces small enough that the suite's reads are cut into several)."""

    @pytest.fixture
    def storage(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Storage:
        monkeypatch.setattr(throttle, "THROTTLE_PIECE_BYTES", 100)
        return ThrottledStorage(open_storage(str(tmp_path / "stream")), 1 << 30)

    def populate(self, storage: Storage, files: Mapping[str, bytes]) -> None:
        assert isinstance(storage, ThrottledStorage) and isinstance(storage.inner, PosixStorage)
        _write_files(Path(storage.inner.root), files)


# ------------------------------------------------------------------------------------ the same, per stream URL


@pytest.fixture
def storage(stream_url: str) -> Storage:
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


# ------------------------------------------------------------------------------------ POSIX particulars


def test_posix_put_if_absent_accepts_its_own_retransmitted_link(tmp_path, monkeypatch):
    """NFS: a link(2) whose reply was lost is retransmitted and answered EEXIST although this very call
    created the link. That cannot be caused for real on a local disk, so os.link is replaced by one that
    links and then reports EEXIST, as the NFS client does."""
    real_link = os.link

    def link_then_eexist(src, dst, *args, **kwargs):
        real_link(src, dst, *args, **kwargs)
        raise FileExistsError(17, "File exists", dst)

    storage = PosixStorage(str(tmp_path / "stream"))
    monkeypatch.setattr(os, "link", link_then_eexist)
    storage.put_if_absent("manifests/000000000001.json", b"mine")
    monkeypatch.setattr(os, "link", real_link)
    assert storage.read("manifests/000000000001.json") == b"mine"
    assert [e.name for e in storage.list("manifests")] == ["000000000001.json"]  # the temp file is gone
    with pytest.raises(FileExistsError):  # someone else's file under the name is still a conflict
        storage.put_if_absent("manifests/000000000001.json", b"theirs")
    assert storage.read("manifests/000000000001.json") == b"mine"


# ------------------------------------------------------------------------------------ S3 particulars


def test_s3_412_that_names_no_condition_is_file_exists():
    """A 412 that does not name the failed condition (some S3-compatible stores) is an OSError(EINVAL) to
    s3fs: put_if_absent still raises the FileExistsError that commits and stream creation take for "exists"."""
    with s3_refusing_every_put() as endpoint:
        storage = open_storage("s3://bucket/stream", {"endpoint_url": endpoint, "key": "k", "secret": "s"})
        with pytest.raises(FileExistsError, match="manifests/000000000001.json"):
            storage.put_if_absent("manifests/000000000001.json", b"mine")


def _object_and_uploads(endpoint: str, bucket: str, key: str) -> tuple[dict | None, list]:
    """The object's HEAD (None if absent) and the bucket's unfinished multipart uploads, asked with boto3."""
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint)
    try:
        head = client.head_object(Bucket=bucket, Key=key)
    except client.exceptions.ClientError:
        head = None
    return head, client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])


def test_s3_open_write_uploads_parts_and_a_small_file_in_one_put(s3_endpoint):
    """Writes of any size and buffer type become parts of PART_BYTES (uploaded while later writes fill the next
    part); an object no larger than one part is a single PUT."""
    from ckptstream.storage.s3upload import PART_BYTES

    bucket = new_bucket(s3_endpoint)
    storage = open_storage(f"s3://{bucket}/s")
    data = bytes(range(256)) * ((2 * PART_BYTES + PART_BYTES // 2) // 256)
    cuts = [0, 1, 7 << 20, PART_BYTES + 3, 2 * PART_BYTES, len(data)]
    with storage.open_write("big") as f:
        for start, end in zip(cuts, cuts[1:]):
            f.write(memoryview(bytearray(data[start:end])))
    assert storage.read("big") == data
    head, uploads = _object_and_uploads(s3_endpoint, bucket, "s/big")
    assert head["ETag"].endswith('-3"') and uploads == []  # three parts, the upload completed
    storage.put("small", data[:PART_BYTES])
    assert storage.read("small") == data[:PART_BYTES]
    assert "-" not in _object_and_uploads(s3_endpoint, bucket, "s/small")[0]["ETag"]  # one PUT


def test_s3_open_write_failing_leaves_no_object_and_no_upload(s3_endpoint):
    """A write that fails — the caller's error, or a part the server never gets (a real proxy answers 500
    to every PUT of the object without forwarding it) — aborts the multipart upload: nothing appears."""
    from ckptstream.storage.s3upload import PART_BYTES

    bucket = new_bucket(s3_endpoint)
    data = bytes(3 * PART_BYTES)
    storage = open_storage(f"s3://{bucket}/s")
    with pytest.raises(RuntimeError, match="caller"):
        with storage.open_write("big") as f:
            f.write(data)
            raise RuntimeError("the caller failed")
    assert _object_and_uploads(s3_endpoint, bucket, "s/big") == (None, [])
    with LossyProxy(s3_endpoint, r"/s/big$", forward=False, losses=1000) as proxy:
        lossy = open_storage(f"s3://{bucket}/s", {"endpoint_url": proxy.url,
                                                   "config_kwargs": {"retries": {"max_attempts": 1}}})
        with pytest.raises(OSError):
            with lossy.open_write("big") as f:
                f.write(data)
        assert proxy.lost  # the parts were sent and lost
    assert _object_and_uploads(s3_endpoint, bucket, "s/big") == (None, [])


def test_posix_capabilities(tmp_path):
    storage = open_storage(f"file://{tmp_path}/stream")
    assert isinstance(storage, PosixStorage) and storage.root == f"{tmp_path}/stream"
    assert storage.is_posix and storage.atomic_create
    assert storage.capabilities == Capabilities(posix=True, notifications=True)  # watchdog is installed here


@pytest.mark.timeout(60)  # before the fix, opening the FIFO blocked for ever
@pytest.mark.parametrize("kind", ["fifo", "device", "directory"])
def test_posix_read_small_refuses_what_is_not_a_regular_file_without_blocking(tmp_path, kind):
    storage = PosixStorage(str(tmp_path))
    target = tmp_path / "small.json"
    if kind == "fifo":
        os.mkfifo(target)  # a reader opening it blocks until a writer comes: none ever does
    elif kind == "device":
        target.symlink_to("/dev/zero")  # endless: read whole, it fills the memory
    else:
        target.mkdir()
    with pytest.raises(IntegrityError, match="file small.json: not a regular file"):
        storage.read_small("small.json", 4096)


def test_capabilities_are_consistent():
    with pytest.raises(ValueError):
        Capabilities(writable=False)  # put_if_absent is a write
    assert not Capabilities(writable=False, put_if_absent=False).writable


# ------------------------------------------------------------------------------------ registry


def test_unknown_scheme_is_a_capability_error():
    with pytest.raises(StorageCapabilityError) as info:
        open_storage("foo://bucket/stream")
    message = str(info.value)
    assert "'foo'" in message and "foo://bucket/stream" in message
    assert "s3" in message and "file" in message and "memory" in message  # what is supported
    assert info.value.exit_code == EXIT_INCOMPATIBLE


def test_scheme_without_its_package_is_a_capability_error():
    for url, package in [("gs://bucket/stream", "gcsfs"), ("hdfs://namenode/stream", "pyarrow")]:
        if importlib.util.find_spec(package) is not None:
            continue
        with pytest.raises(StorageCapabilityError, match=f"'{url.partition(':')[0]}'.*not installed"):
            open_storage(url)


def test_cli_unknown_scheme_exits_incompatible(capsys):
    assert main(["ls", "foo://bucket/stream"]) == EXIT_INCOMPATIBLE
    err = capsys.readouterr().err
    assert err.startswith("Error: ") and "unknown storage URL scheme 'foo'" in err


def test_register_backend(tmp_path):
    scheme = f"ckpt{uuid.uuid4().hex[:8]}"
    seen = []

    def factory(url, options):
        seen.append((url, dict(options)))
        return PosixStorage(str(tmp_path / url.partition("://")[2]))

    register_backend(scheme, factory)
    register_backend(scheme, factory)  # the same factory again is fine
    assert scheme in registered_schemes() and {"file", "local"} <= set(registered_schemes())
    storage = open_storage(f"{scheme.upper()}://a/b", {"k": "v"})  # schemes are case-insensitive
    assert isinstance(storage, PosixStorage) and storage.root == str(tmp_path / "a" / "b")
    assert seen == [(f"{scheme.upper()}://a/b", {"k": "v"})]
    with pytest.raises(ValueError, match="already has a storage backend"):
        register_backend(scheme, lambda url, options: PosixStorage(url))
    register_backend(scheme, lambda url, options: ReadOnlyStorage(factory(url, options)), replace=True)
    assert not open_storage(f"{scheme}://a/b").capabilities.writable
    with pytest.raises(ValueError):
        register_backend("bad://", factory)


def test_import_is_cheap():
    """Importing the storage package imports neither fsspec (nor s3fs) nor torch. The parent package is
    stubbed, since what ckptstream/__init__.py imports is not the storage package's doing."""
    code = ("import sys, types; pkg = types.ModuleType('ckptstream'); pkg.__path__ = [sys.argv[1]]; "
            "sys.modules['ckptstream'] = pkg; import ckptstream.storage; "
            "print(sorted(m for m in ('fsspec', 's3fs', 'torch', 'watchdog') if m in sys.modules))")
    package_dir = str(Path(__file__).resolve().parent.parent / "ckptstream")
    out = subprocess.run([sys.executable, "-c", code, package_dir], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(Path(package_dir).parent)})
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


# ------------------------------------------------------------------------------------ concurrency


def test_concurrent_reads_are_bounded_and_raise_the_first_error():
    lock = threading.Lock()
    running = peak = 0

    def work(i: int) -> int:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        time.sleep(0.02)
        with lock:
            running -= 1
        if i in (7, 30):
            raise EOFError(f"range {i}")
        return i

    with pytest.raises(EOFError, match="range 7"):
        concurrently(work, list(range(3 * MAX_CONCURRENT_READS)))
    assert peak == MAX_CONCURRENT_READS
    assert running == 0  # every item finished before the error was raised
    assert concurrently(lambda i: i * 2, list(range(40))) == [i * 2 for i in range(40)]


# ------------------------------------------------------------------------------------------------ --bwlimit


@pytest.mark.parametrize("reader", ["read", "read_into", "read_ranges", "read_ranges_into", "open_read"])
def test_throttled_reads_keep_to_the_rate(storage, reader):
    """Every kind of read, from concurrent threads, stays within the rate: (bytes - burst) / rate seconds at
    least (a lower bound only: a slow machine may take longer)."""
    data = os.urandom(3 << 19)  # 1.5 MiB: two pieces and a half
    storage.put("versions/x/data.bin", data)
    rate = 4 << 20
    throttled = ThrottledStorage(storage, rate)
    quarter = len(data) // 4
    spans = [(i * quarter, (i + 1) * quarter) for i in range(4)]
    started = time.perf_counter()
    if reader == "read":
        got = b"".join(throttled.read("versions/x/data.bin", a, b) for a, b in spans)
    elif reader == "read_into":
        buffer = bytearray(len(data))
        throttled.read_into("versions/x/data.bin", 0, memoryview(buffer))
        got = bytes(buffer)
    elif reader == "read_ranges":
        got = b"".join(throttled.read_ranges("versions/x/data.bin", spans))
    elif reader == "read_ranges_into":
        buffers = [bytearray(b - a) for a, b in spans]
        throttled.read_ranges_into("versions/x/data.bin", [(a, memoryview(buf)) for (a, _), buf in zip(spans, buffers)])
        got = b"".join(buffers)
    else:
        with throttled.open_read("versions/x/data.bin") as f:
            got = f.read()
    elapsed = time.perf_counter() - started
    assert got == data
    assert elapsed >= (len(data) - throttled.bucket.burst) / rate * 0.95


def test_token_bucket_is_shared_by_threads():
    bucket = throttle.TokenBucket(1 << 20)
    started = time.perf_counter()
    threads = [threading.Thread(target=lambda: [bucket.take(64 << 10) for _ in range(4)]) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert time.perf_counter() - started >= ((8 * 4 * (64 << 10)) - bucket.burst) / (1 << 20) * 0.95  # 2 MiB: ~1.9 s


@pytest.mark.parametrize(("text", "rate"), [("10M", 10 << 20), ("512K", 512 << 10), ("512k", 512 << 10),
                                            ("1000", 1000), ("1.5G", 1.5 * (1 << 30)), ("2M", 2 << 20),
                                            ("100B", 100), ("1M/s", 1 << 20)])
def test_bwlimit_rates_in_rclone_units(text, rate):
    from ckptstream.cli.options import parse_rate

    assert parse_rate(text) == rate


@pytest.mark.parametrize("text", ["", "0", "-1M", "fast", "10X", "inf", "nan"])
def test_bwlimit_refuses_what_is_not_a_rate(text, capsys):
    assert main(["materialize", "/nowhere", "0", "/tmp/out", "--bwlimit", text]) == 2
    err = capsys.readouterr().err
    assert "Error: argument --bwlimit" in err


def test_will_read_is_a_hint_that_never_fails_a_read(tmp_path):
    """``will_read`` asks for read-ahead; a missing file or a range past the end is for the read to report."""
    from ckptstream.storage import open_storage
    from ckptstream.storage.timing import TimedReads

    storage = open_storage(str(tmp_path))
    storage.put("data", b"x" * 10)
    for target in (storage, TimedReads(storage)):  # (a wrapper passes it through)
        target.will_read("data", 0, 10)
        target.will_read("data", 100, 10)
        target.will_read("missing", 0, 10)
    assert storage.read("data") == b"x" * 10


def test_timed_reads_count_the_bytes_every_kind_of_read_returns(tmp_path):
    from ckptstream.storage.timing import TimedReads

    storage = open_storage(str(tmp_path))
    storage.put("data", bytes(range(100)))
    meter = TimedReads(storage)
    assert meter.read("data", 10, 20) == bytes(range(10, 20)) and meter.bytes_read() == 10
    meter.read_small("data", 1000)
    buffer = bytearray(5)
    meter.read_into("data", 0, memoryview(buffer))
    meter.read_ranges("data", [(0, 3), (50, 60)])
    meter.read_ranges_into("data", [(0, memoryview(bytearray(7)))])
    assert meter.bytes_read() == 10 + 100 + 5 + 13 + 7
    with meter.open_read("data") as f:
        assert f.read() == bytes(range(100))
    assert meter.bytes_read() == 235
    meter.size("data"), meter.exists("data"), meter.list("")  # metadata: no bytes
    assert meter.bytes_read() == 235 and meter.read_seconds() > 0


def test_kept_reads_serve_a_range_read_while_keeping_once_within_their_bound(tmp_path):
    from ckptstream.storage.kept import KeptReads
    from ckptstream.storage.timing import TimedReads

    storage = open_storage(str(tmp_path))
    storage.put("data", bytes(range(100)))
    meter = TimedReads(storage)
    kept = KeptReads(meter)
    kept.read("data", 0, 10)  # not keeping: passes through
    assert kept.kept_bytes == 0 and meter.bytes_read() == 10
    with kept.keeping(25):
        kept.read("data", 0, 10)
        kept.read_into("data", 10, memoryview(bytearray(10)))
        kept.read("data", 20, 30)  # past the bound: read, not kept
        kept.read("data", 95, 105)  # the end of the file: not the range asked, not kept
    assert kept.kept_bytes == 20 and meter.bytes_read() == 10 + 35
    assert kept.read_ranges("data", [(0, 10), (40, 41)]) == [bytes(range(10)), bytes([40])]
    buffer = bytearray(10)
    kept.read_ranges_into("data", [(10, memoryview(buffer))])
    assert bytes(buffer) == bytes(range(10, 20)) and meter.bytes_read() == 45 + 1  # the kept ones from memory
    assert kept.kept_bytes == 0
    kept.read("data", 0, 10)  # served once: read again
    assert meter.bytes_read() == 56
    with kept.keeping(100):
        kept.read("data", 0, 10)
    kept.clear()
    kept.read("data", 0, 10)
    assert meter.bytes_read() == 76 and kept.kept_bytes == 0


def test_a_kept_range_serves_its_parts_until_each_byte_was_served(tmp_path):
    """A batch of tensors is read as one range while keeping; the decode then reads them one by one from memory."""
    from ckptstream.storage.kept import KeptReads
    from ckptstream.storage.timing import TimedReads

    storage = open_storage(str(tmp_path))
    storage.put("data", bytes(range(100)))
    meter = TimedReads(storage)
    kept = KeptReads(meter)
    with kept.keeping(100):
        kept.read_into("data", 10, memoryview(bytearray(30)))  # [10, 40) as one range
    assert kept.read("data", 20, 30) == bytes(range(20, 30)) and kept.kept_bytes == 30
    buffer = bytearray(10)
    kept.read_into("data", 10, memoryview(buffer))
    assert bytes(buffer) == bytes(range(10, 20)) and meter.bytes_read() == 30  # both from memory
    assert kept.read("data", 35, 45) == bytes(range(35, 45)) and meter.bytes_read() == 40  # past its end: storage
    assert kept.read("data", 30, 40) == bytes(range(30, 40)) and kept.kept_bytes == 0  # its last part: dropped
    assert meter.bytes_read() == 40
    kept.read("data", 10, 20)  # every byte served: read again
    assert meter.bytes_read() == 50


def test_kept_ranges_overlapping_one_kept_are_not_kept_and_thousands_serve_their_reads(tmp_path):
    from ckptstream.storage.kept import KeptReads
    from ckptstream.storage.timing import TimedReads

    storage = open_storage(str(tmp_path))
    storage.put("data", bytes(range(256)) * 64)
    meter = TimedReads(storage)
    kept = KeptReads(meter)
    with kept.keeping(1 << 20):
        kept.read("data", 10, 40)
        kept.read("data", 30, 50)  # overlaps [10, 40): read, not kept
        assert kept.kept_bytes == 30
        for start in range(100, 16100, 4):  # 4,000 ranges of one file, kept in reverse order of reads
            kept.read("data", start, start + 4)
    read = meter.bytes_read()
    assert kept.read("data", 45, 50) == bytes(range(45, 50)) and meter.bytes_read() == read + 5  # from storage
    for start in reversed(range(100, 16100, 4)):
        assert kept.read("data", start + 1, start + 3) == (bytes(range(256)) * 64)[start + 1:start + 3]
    assert meter.bytes_read() == read + 5  # every one from memory
    assert kept.kept_bytes == 30 + 4000 * 4  # each served 2 of its 4 bytes: still kept
