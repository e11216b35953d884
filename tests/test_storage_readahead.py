"""``ChunkedReads``: object-store reads served from aligned chunks fetched concurrently, memory bounded."""

from __future__ import annotations

import os
from collections.abc import Mapping

import pytest

from ckptstream.storage import RANGE_CHUNK_BYTES, Storage, open_storage
from ckptstream.storage.readahead import ChunkedReads
from ckptstream.testing.storage import WritableStorageSuite
from tests.helpers import new_bucket


class TestChunkedReadsOnS3(WritableStorageSuite):
    """The generic suite through the wrapper, on a real S3-protocol server (moto)."""

    @pytest.fixture
    def storage(self, s3_endpoint: str) -> Storage:
        self.bucket = new_bucket(s3_endpoint)
        self.endpoint = s3_endpoint
        return ChunkedReads(open_storage(f"s3://{self.bucket}/runs/stream"))

    def populate(self, storage: Storage, files: Mapping[str, bytes]) -> None:
        import boto3

        client = boto3.client("s3", endpoint_url=self.endpoint)
        for path, data in files.items():
            client.put_object(Bucket=self.bucket, Key=f"runs/stream/{path}", Body=data)


class CountingStorage:
    """Counts the ranged reads that reach the inner storage (a real storage underneath)."""

    def __init__(self, inner: Storage):
        self.inner = inner
        self.reads: list[tuple[int, int]] = []

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def read(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        self.reads.append((start, end))
        return self.inner.read(path, start, end)


def test_ranges_across_chunk_boundaries_are_exact_and_each_chunk_is_fetched_once(tmp_path):
    data = os.urandom(2 * RANGE_CHUNK_BYTES + 12345)
    (tmp_path / "f").write_bytes(data)
    counting = CountingStorage(open_storage(str(tmp_path)))
    chunked = ChunkedReads(counting)  # type: ignore[arg-type]
    # A decoder's pattern: consecutive ranges front to back, some straddling chunk boundaries.
    edges = [0, 8, 1000, RANGE_CHUNK_BYTES - 5, RANGE_CHUNK_BYTES + 7, 2 * RANGE_CHUNK_BYTES, len(data)]
    spans = list(zip(edges, edges[1:]))
    assert chunked.read_ranges("f", spans) == [data[a:b] for a, b in spans]
    assert sorted(counting.reads) == [(i * RANGE_CHUNK_BYTES, (i + 1) * RANGE_CHUNK_BYTES) for i in range(3)]
    assert chunked.held_chunks == 0  # every chunk was handed out whole, so none is held
    assert chunked.read("f", len(data) - 3, len(data) + 10) == data[-3:]  # fewer at the end of the file
    with pytest.raises(EOFError):
        chunked.read_ranges("f", [(len(data) - 3, len(data) + 10)])
    with pytest.raises(FileNotFoundError):
        chunked.read("missing", 0, 10)
    chunked.close()


def test_held_chunks_are_bounded(tmp_path):
    (tmp_path / "f").write_bytes(os.urandom(6 * RANGE_CHUNK_BYTES))
    chunked = ChunkedReads(open_storage(str(tmp_path)), max_chunks=2)
    for index in range(6):  # one byte of each chunk: none is ever handed out whole
        assert len(chunked.read("f", index * RANGE_CHUNK_BYTES, index * RANGE_CHUNK_BYTES + 1)) == 1
        assert chunked.held_chunks <= 2
    chunked.clear()
    assert chunked.held_chunks == 0
    chunked.close()
