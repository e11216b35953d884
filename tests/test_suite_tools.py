"""The tools ``make test`` and ``make test-busy`` run the suite under: tools/memwatch.py (the peak memory of a
command's process tree) and tools/busyload.py (a load beside a command)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from ckptstream.testing.ray import pid_alive

TOOLS = Path(__file__).resolve().parents[1] / "tools"
HELD = 512 << 20

# Holds HELD bytes until memwatch has sampled them (its samples file says so), then leaves a file behind.
HOLDER = """
import sys, time
samples, done, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
held = b"x" * size
deadline = time.monotonic() + 120
while not any(int(line.split()[1]) >= size for line in open(samples) if line.strip()):
    assert time.monotonic() < deadline, "memwatch never counted the held memory"
    time.sleep(0.05)
open(done, "w").close()
"""

# Starts the holder detached (its parent, a shell, exits at once: as `ray start` leaves its daemons), waits
# until it is done, and exits 3.
COMMAND = """
import os, subprocess, sys, time
samples, done, size = sys.argv[1:4]
subprocess.run(["sh", "-c", '"$0" -c "$1" "$2" "$3" "$4" &', sys.executable, sys.argv[4], samples, done, size])
deadline = time.monotonic() + 180
while not os.path.exists(done):
    assert time.monotonic() < deadline, "the holder did not finish"
    time.sleep(0.05)
sys.exit(3)
"""


def test_memwatch_counts_a_detached_grandchild_and_passes_the_exit_status_on(tmp_path):
    samples, done = tmp_path / "samples.tsv", tmp_path / "done"
    result = subprocess.run([sys.executable, str(TOOLS / "memwatch.py"), "--interval", "0.1", "--samples",
                             str(samples), "--", sys.executable, "-c", COMMAND, str(samples), str(done), str(HELD),
                             HOLDER], capture_output=True, text=True, timeout=300)
    assert result.returncode == 3, result.stderr
    peak = float(re.search(r"memwatch: peak memory ([\d.]+) GiB", result.stderr).group(1))
    assert HELD / (1 << 30) <= peak < HELD / (1 << 30) + 0.25, result.stderr  # plus three small interpreters
    assert re.search(r"\d+ MiB +\d+ +\S*python\S* -c", result.stderr), result.stderr  # the holder, by name


# Checks the load from inside the command: each process holds its share and is running; prints their PIDs.
CHECK_LOAD = """
import os, sys, time
pids = [int(p) for p in os.environ["BUSYLOAD_PIDS"].split()]
assert len(pids) == 2
def cpu(pid):
    return sum(int(f) for f in open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[11:13])
for pid in pids:
    rss = int(next(line for line in open(f"/proc/{pid}/status") if line.startswith("VmRSS")).split()[1]) * 1024
    assert rss >= 128 << 20, rss
    start, deadline = cpu(pid), time.monotonic() + 60
    while cpu(pid) <= start:
        assert time.monotonic() < deadline, "a load process does not run"
        time.sleep(0.05)
print(*pids)
sys.exit(4)
"""


def test_busyload_holds_its_memory_while_the_command_runs_and_stops_with_it():
    result = subprocess.run([sys.executable, str(TOOLS / "busyload.py"), "--cores", "2", "--memory-gib", "0.25",
                             "--", sys.executable, "-c", CHECK_LOAD], capture_output=True, text=True, timeout=300)
    assert result.returncode == 4, result.stderr
    pids = [int(p) for p in result.stdout.split()]
    assert len(pids) == 2 and not any(pid_alive(pid) for pid in pids)
    assert "load stopped" in result.stderr
