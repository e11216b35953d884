"""A one-node Ray cluster for tests: ``ray start --head`` on 127.0.0.1, torn down with every process it
started.

Every process of the cluster (GCS, raylet, agents, workers, and what they start: vLLM) is found by its
temp dir (``cluster_processes``); the teardown ends exactly those, by PID (``ray stop`` would end every
Ray process of the machine, other users' clusters included). Run it where nothing but loopback exists
(a network namespace): Ray's processes connect over the machine's own address otherwise.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from ..process import descendants

CLUSTER_MARKER = "CKPTSTREAM_TEST_RAY_CLUSTER"
"""The environment variable every process of a test cluster carries (its value: the cluster's temp dir)."""
START_TIMEOUT = 120.0
STOP_WAIT = 10.0
MEMORY = 4 << 30
"""Bytes of memory the cluster's tasks and actors may reserve (Ray's ``memory`` resource; Ray's default is the
machine's available memory): the test fleets' actors and their vLLM servers take ~1-2 GiB each."""
OBJECT_STORE_MEMORY = 256 << 20
"""Bytes of the cluster's object store (shared memory): the fleets pass handles and records through it, not
weights; Ray's default is 30 % of the machine's memory."""
MEMORY_USAGE_THRESHOLD = "0.98"
"""Ray's memory monitor kills workers once the *machine's* memory in use passes this fraction (default 0.95):
it counts every process of the machine, so on a shared one, at 0.95, it killed a test fleet's actors for
memory other jobs held (1.2 GiB still free of 24). At 0.98 it acts only just before the kernel would."""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cluster_processes(temp_dir: str) -> list[int]:
    """PIDs of the live processes of the cluster whose temp dir is ``temp_dir``, and of their descendants:
    those with ``CLUSTER_MARKER=temp_dir`` in their environment, ``temp_dir`` in their command line, or a
    file open under it (Ray's workers and agents rename themselves with setproctitle, which overwrites the
    environment /proc shows, but keep their logs open in the session directory)."""
    needle, prefix = f"{CLUSTER_MARKER}={temp_dir}".encode(), temp_dir.encode()
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid() or not pid_alive(int(entry)):
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read().split(b"\0")
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
            files = [os.readlink(f"/proc/{entry}/fd/{fd}") for fd in os.listdir(f"/proc/{entry}/fd")]
        except OSError:
            continue
        if needle in environ or prefix in cmdline or any(f.startswith(temp_dir + "/") for f in files):
            found.add(int(entry))
    for pid in list(found):
        found.update(p for p in descendants(pid) if pid_alive(p))
    return sorted(found)


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (not gone, not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


class RayCluster:
    """A Ray head on 127.0.0.1 with ``num_cpus`` logical CPUs and no GPUs, no dashboard, no usage stats, and
    explicit memory: ``memory`` bytes for its tasks and actors, ``object_store_memory`` bytes of object store.

    ``address`` is what ``ray.init(address=...)`` and ``ckptstream fleet --address`` take. ``close()`` (or
    ``with``) ends every process of the cluster and checks that none is left (``RuntimeError`` otherwise).
    """

    def __init__(self, num_cpus: int = 8, env: dict[str, str] | None = None, memory: int = MEMORY,
                 object_store_memory: int = OBJECT_STORE_MEMORY):
        # Short: Ray's unix socket paths live under it and are limited to ~107 bytes.
        self.temp_dir = tempfile.mkdtemp(prefix="ckr-", dir="/tmp")
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.env = {"RAY_memory_usage_threshold": MEMORY_USAGE_THRESHOLD, **os.environ, **(env or {}),
                    CLUSTER_MARKER: self.temp_dir, "RAY_USAGE_STATS_ENABLED": "0"}
        command = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--node-ip-address=127.0.0.1",
                   f"--port={self.port}", f"--num-cpus={num_cpus}", "--num-gpus=0", f"--memory={memory}",
                   f"--object-store-memory={object_store_memory}", "--disable-usage-stats",
                   "--include-dashboard=false", f"--temp-dir={self.temp_dir}"]
        done = subprocess.run(command, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              timeout=START_TIMEOUT)
        if done.returncode != 0:
            self.close()
            raise RuntimeError(f"ray start failed ({done.returncode}): {done.stdout.decode()[-2000:]}")

    def pids(self) -> list[int]:
        """The live processes of this cluster (and of what its workers started)."""
        return cluster_processes(self.temp_dir)

    def close(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in self.pids():
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + STOP_WAIT
            while self.pids() and time.monotonic() < deadline:
                time.sleep(0.2)
        left = self.pids()
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        if left:
            raise RuntimeError(f"Ray processes left after the teardown: {left}")

    def __enter__(self) -> RayCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

