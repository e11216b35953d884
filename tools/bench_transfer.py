#!/usr/bin/env python3
"""Benchmark: reading and mirroring a stream on an S3-protocol server against raw GETs of the same objects.

Starts moto's S3 server on 127.0.0.1 (the same server the tests use), publishes a synthetic bf16 model
(a keyframe, then deltas where ~1% of elements change per step) and prints, from one run, side by side:

- raw GET throughput of the stream's data objects: the same byte ranges ckptstream's copy would read, with
  the same concurrency (``MAX_CONCURRENT_READS`` ranged GETs of ``RANGE_CHUNK_BYTES``), straight through s3fs;
- ``materialize`` of the keyframe from S3 (stored bytes per second) and its ratio to raw GET;
- ``mirror`` S3 → local against a raw copy of the same bytes (the raw ranged GETs plus a write of each
  file): the ratio, and the bytes moved per delta version against its stored bytes;
- ``mirror`` local → S3 against a raw upload of the same files.

Medians of ``--repeat`` runs; ratios are what to compare across machines (the S3 server shares the CPUs
with the client here, so absolute figures are low).

    python tools/bench_transfer.py                     # 256 MB model, 4 versions
    python tools/bench_transfer.py --size 1GB --repeat 5
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckptstream import Publisher, Stream  # noqa: E402
from ckptstream.cli.options import parse_bytes  # noqa: E402
from ckptstream.format import data_path  # noqa: E402
from ckptstream.mirror import Mirror  # noqa: E402
from ckptstream.storage import MAX_CONCURRENT_READS, RANGE_CHUNK_BYTES, chunk_spans, open_storage  # noqa: E402
from ckptstream.testing.models import TinyModelSpec, rl_like_step, tiny_state_dict  # noqa: E402


def start_s3() -> tuple[object, str]:
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's request log

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=endpoint)
    return server, endpoint


def new_bucket(endpoint: str) -> str:
    import boto3

    name = f"bench-{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=name)
    return name


def data_objects(stream: Stream, versions: list[int]) -> list[tuple[str, int]]:
    """(path, size) of every data file of ``versions``."""
    return [(data_path(v, f.name), f.size) for v in versions for f in stream.manifest(v).files]


def raw_get(url: str, objects: list[tuple[str, int]], sink_dir: Path | None = None) -> float:
    """Seconds to GET ``objects`` as ranged reads of RANGE_CHUNK_BYTES, MAX_CONCURRENT_READS at once
    (through the same s3fs client ckptstream uses), optionally writing each file to ``sink_dir``."""
    storage = open_storage(url)
    start = time.perf_counter()
    with ThreadPoolExecutor(MAX_CONCURRENT_READS) as pool:
        for path, size in objects:
            spans = chunk_spans(0, size)
            chunks = pool.map(lambda span, p=path: storage.read(p, *span), spans)
            if sink_dir is None:
                for _ in chunks:
                    pass
                continue
            target = sink_dir / path
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "wb") as f:
                for chunk in chunks:
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
    return time.perf_counter() - start


def raw_put(local_root: Path, url: str, objects: list[tuple[str, int]]) -> float:
    """Seconds to upload the same files with s3fs's own put (multipart, its default concurrency)."""
    storage = open_storage(url)
    fs, root = storage.fs, storage.root
    start = time.perf_counter()
    for path, _ in objects:
        fs.put_file(str(local_root / path), f"{root}/{path}")
    return time.perf_counter() - start


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=parse_bytes, default=parse_bytes("256MB"))
    parser.add_argument("--steps", type=int, default=4, help="versions (1 keyframe + deltas)")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    server, endpoint = start_s3()
    work = Path(tempfile.mkdtemp(prefix="ckptstream-bench-transfer-"))
    try:
        spec = TinyModelSpec.for_size(args.size)
        state = tiny_state_dict(spec)
        full = sum(t.numel() * t.element_size() for t in state.values())
        s3_url = f"s3://{new_bucket(endpoint)}/run"
        generator = torch.Generator().manual_seed(0)
        with Publisher(s3_url, keyframe_every=args.steps + 1) as publisher:
            for step in range(args.steps):
                if step:
                    rl_like_step(state, generator=generator)
                publisher.publish(state).result()
        stream = Stream(s3_url)
        versions = stream.versions()
        objects = data_objects(stream, versions)
        keyframe_objects = data_objects(stream, versions[:1])
        stored = sum(size for _, size in objects)
        keyframe_bytes = sum(size for _, size in keyframe_objects)
        print(f"model {full / 1e6:.0f} MB bf16, {len(state)} tensors; {len(versions)} versions, "
              f"{stored / 1e6:.0f} MB stored; S3 = moto on loopback; {os.cpu_count()} CPUs; "
              f"{MAX_CONCURRENT_READS} concurrent ranged reads of {RANGE_CHUNK_BYTES >> 20} MiB")

        rows: dict[str, list[float]] = {k: [] for k in ("raw_get_kf", "materialize", "raw_copy", "mirror_in",
                                                        "raw_put", "mirror_out")}
        moved: dict[int, tuple[int, int]] = {}
        for attempt in range(args.repeat):
            rows["raw_get_kf"].append(raw_get(s3_url, keyframe_objects))
            out = work / f"mat{attempt}"
            rows["materialize"].append(timed(lambda o=out: Stream(s3_url).materialize(versions[0], o)))
            shutil.rmtree(out)
            raw_dir = work / f"raw{attempt}"
            rows["raw_copy"].append(raw_get(s3_url, objects, sink_dir=raw_dir))
            local = work / f"mirror{attempt}"
            start = time.perf_counter()
            results = Mirror(Stream(s3_url), open_storage(str(local))).run_once()
            rows["mirror_in"].append(time.perf_counter() - start)
            moved = {r.version: (r.copied_bytes, r.stored_bytes) for r in results}
            back = f"s3://{new_bucket(endpoint)}/run"
            rows["raw_put"].append(raw_put(local, f"s3://{new_bucket(endpoint)}/raw", objects))
            rows["mirror_out"].append(timed(lambda d=local, b=back: Mirror(Stream(str(d)), open_storage(b)).run_once()))
            shutil.rmtree(raw_dir)
            shutil.rmtree(local)

        med = {k: statistics.median(v) for k, v in rows.items()}
        mbps = lambda n, s: n / s / 1e6  # noqa: E731
        print(f"\nS3 read, keyframe ({keyframe_bytes / 1e6:.0f} MB):")
        print(f"  raw ranged GET          {mbps(keyframe_bytes, med['raw_get_kf']):8.1f} MB/s")
        print(f"  materialize             {mbps(keyframe_bytes, med['materialize']):8.1f} MB/s   "
              f"ratio {med['raw_get_kf'] / med['materialize']:.2f}x")
        print(f"\nmirror S3 -> local ({stored / 1e6:.0f} MB, {len(versions)} versions):")
        print(f"  raw GET + write         {mbps(stored, med['raw_copy']):8.1f} MB/s")
        print(f"  mirror                  {mbps(stored, med['mirror_in']):8.1f} MB/s   "
              f"ratio {med['raw_copy'] / med['mirror_in']:.2f}x")
        print("\nmirror local -> S3:")
        print(f"  raw put_file            {mbps(stored, med['raw_put']):8.1f} MB/s")
        print(f"  mirror                  {mbps(stored, med['mirror_out']):8.1f} MB/s   "
              f"ratio {med['raw_put'] / med['mirror_out']:.2f}x")
        print("\nbytes moved per version (mirror) vs its stored bytes:")
        for version, (copied, stored_bytes) in sorted(moved.items()):
            print(f"  version {version}: {copied:>12,d} moved, {stored_bytes:>12,d} stored "
                  f"({copied / stored_bytes:.3f}x)")
        print(f"\nmedians of {args.repeat} runs")
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
