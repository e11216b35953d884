#!/usr/bin/env python3
"""Benchmark: ckptstream's write path to S3 against s3fs's own ``put_file`` of the same bytes.

Starts moto's S3 server on 127.0.0.1 (the server the tests use), publishes one keyframe of a synthetic bf16
model into a local stream, then, ``--repeat`` times, into fresh buckets: uploads its data files with s3fs's
``put_file`` (multipart, parts uploaded concurrently) and ``mirror``s the stream local -> S3 (what the
publisher's data files go through too: ``Storage.open_write``). Prints both throughputs and their ratio
(medians), from one run. Light: one file of ``--size``, a few uploads.

moto on loopback serves as fast as the CPUs let it, whatever the number of connections. ``--connection-rate``
puts a TCP proxy in front of it that caps each connection's upload at RATE (rclone units), as the throughput of
one connection to a remote S3 is capped: then what counts is how many parts are in flight at once.

    python tools/bench_s3_write.py                    # 384 MB, medians of 3
    python tools/bench_s3_write.py --size 512MB --repeat 5
    python tools/bench_s3_write.py --connection-rate 20M
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import socketserver
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_transfer import data_objects, new_bucket, raw_put, start_s3  # noqa: E402

from ckptstream import Publisher, Stream  # noqa: E402
from ckptstream.cli.options import parse_bytes, parse_rate  # noqa: E402
from ckptstream.mirror import Mirror  # noqa: E402
from ckptstream.storage import open_storage  # noqa: E402
from ckptstream.storage.throttle import TokenBucket  # noqa: E402
from ckptstream.testing.models import TinyModelSpec, tiny_state_dict  # noqa: E402


def wall_and_cpu(fn) -> tuple[float, float]:
    """Wall and CPU seconds (of this whole process: moto's server threads too) that ``fn()`` takes."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def capped_proxy(endpoint: str, rate: float) -> socketserver.ThreadingTCPServer:
    """A TCP proxy on 127.0.0.1 in front of ``endpoint`` (its URL: ``http://127.0.0.1:<server_address[1]>``)
    whose every connection sends at most ``rate`` bytes per second upstream; answers pass unthrottled."""
    upstream = urlsplit(endpoint)

    class Handler(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            server = socket.create_connection((upstream.hostname, upstream.port))
            threading.Thread(target=self._pump, args=(server, self.request, None), daemon=True).start()
            self._pump(self.request, server, TokenBucket(rate))

        @staticmethod
        def _pump(source: socket.socket, sink: socket.socket, bucket: TokenBucket | None) -> None:
            with contextlib.suppress(OSError):
                while data := source.recv(1 << 16):
                    if bucket is not None:
                        bucket.take(len(data))
                    sink.sendall(data)
            with contextlib.suppress(OSError):
                sink.shutdown(socket.SHUT_WR)

    proxy = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
    proxy.daemon_threads = True
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    return proxy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=parse_bytes, default=parse_bytes("384MB"))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--connection-rate", type=parse_rate, metavar="RATE",
                        help="cap each connection's upload at RATE per second (e.g. 20M: 20 MiB/s)")
    args = parser.parse_args()

    server, endpoint = start_s3()
    if args.connection_rate:  # every S3 client of this process goes through the proxy (buckets are made directly)
        proxy = capped_proxy(endpoint, args.connection_rate)
        os.environ["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{proxy.server_address[1]}"
    work = Path(tempfile.mkdtemp(prefix="ckptstream-bench-s3-write-"))
    try:
        local = work / "stream"
        with Publisher(str(local)) as publisher:
            publisher.publish(tiny_state_dict(TinyModelSpec.for_size(args.size))).result()
        stream = Stream(str(local))
        objects = data_objects(stream, stream.versions())
        stored = sum(size for _, size in objects)
        cap = f", each connection capped at {args.connection_rate / 2**20:.0f} MiB/s" if args.connection_rate else ""
        print(f"{len(objects)} data file(s), {stored / 1e6:.0f} MB; S3 = moto on loopback{cap}; "
              f"{os.cpu_count()} CPUs")

        runs: dict[str, list[tuple[float, float]]] = {"put": [], "mirror": []}
        for _ in range(args.repeat):
            runs["put"].append(wall_and_cpu(lambda: raw_put(local, f"s3://{new_bucket(endpoint)}/raw", objects)))
            destination = open_storage(f"s3://{new_bucket(endpoint)}/run")
            runs["mirror"].append(wall_and_cpu(lambda d=destination: Mirror(Stream(str(local)), d).run_once()))
        wall = {k: statistics.median(w for w, _ in v) for k, v in runs.items()}
        cpu = {k: statistics.median(c for _, c in v) for k, v in runs.items()}
        for key, label in (("put", "s3fs put_file"), ("mirror", "mirror local -> S3")):
            print(f"  {label:<22} {stored / wall[key] / 1e6:8.1f} MB/s   {cpu[key]:6.2f} CPU s   (runs: "
                  + ", ".join(f"{w:.2f}" for w, _ in runs[key]) + " s)")
        ratio, cpu_ratio = wall["put"] / wall["mirror"], cpu["put"] / cpu["mirror"]
        print(f"  ratio                  {ratio:8.2f}x        {cpu_ratio:5.2f}x   (medians of {args.repeat}; CPU: this "
              "process, moto's server threads included)")
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
