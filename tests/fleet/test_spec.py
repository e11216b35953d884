"""The fleet's plain parts, without Ray: names, settings, CLI usage errors."""

from __future__ import annotations

import os
import time

import pytest

from ckptstream.cli import main
from ckptstream.errors import EXIT_USAGE
from ckptstream.fleet import FleetSpec, fleet_name
from ckptstream.fleet.spec import stream_location
from ckptstream.reader.replicas import replica_path


def test_a_fleet_is_named_after_its_stream_wherever_it_is_named_from(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    here = fleet_name("stream")
    assert here == fleet_name(str(tmp_path / "stream")) == fleet_name(f"file://{tmp_path}/stream")
    assert here.startswith("fleet-stream-") and here != fleet_name(str(tmp_path / "other" / "stream"))
    assert fleet_name("s3://bucket/runs/r1/") == fleet_name("s3://bucket/runs/r1/")
    replica_path(fleet_name("s3://bucket/a b:c/") + "-0")  # usable as a replica id: no ValueError
    assert stream_location("stream") == os.path.join(str(tmp_path), "stream")
    assert stream_location("s3://bucket/r") == "s3://bucket/r"


def test_settings_that_cannot_work_are_refused():
    with pytest.raises(ValueError, match="split evenly"):
        FleetSpec(url="/s", name="f", replicas=1, gpus_per_replica=3, nodes_per_replica=2)
    with pytest.raises(ValueError, match="router"):
        FleetSpec(url="/s", name="f", replicas=1, rolling=True)
    assert FleetSpec(url="/s", name="f", replicas=1, gpus_per_replica=16, nodes_per_replica=2).gpus_per_node == 8
    with pytest.raises(ValueError, match="cache_versions must be 0 or 1"):
        FleetSpec(url="/s", name="f", replicas=1, cache_versions=2)


def test_cli_usage_errors(capsys):
    assert main(["fleet", "up", "/s", "--replicas", "2", "--rolling"]) == EXIT_USAGE
    assert "--rolling" in capsys.readouterr().err
    assert main(["replay", "/s", "--versions", "1:2", "--", "true"]) == EXIT_USAGE
    both = ["replay", "/s", "--fleet", "--vllm-url", "http://x:1", "--versions", "1:2", "--", "true"]
    assert main(both) == EXIT_USAGE
    assert main(["replay", "/s", "--vllm-url", "http://x:1", "--servers", "2", "--versions", "1:2", "--", "true"]
                ) == EXIT_USAGE
    assert "--servers, --name: only with --fleet" in capsys.readouterr().err
    assert main(["fleet"]) == EXIT_USAGE


def test_adapter_options_are_refused_on_a_weights_stream_before_ray(tmp_path, capsys):
    import torch

    from ckptstream import Publisher

    url = str(tmp_path / "weights")
    with Publisher(url) as publisher:
        publisher.publish({"w": torch.ones(2)}).result()
    assert main(["fleet", "up", url, "--replicas", "1", "--keep", "3", "--address", "127.0.0.1:9"]) == EXIT_USAGE
    assert f"--keep: for adapter streams (LoRA); {url} is a weights stream" in capsys.readouterr().err
    from ckptstream.errors import FleetError
    from ckptstream.fleet import Fleet

    with pytest.raises(FleetError, match="keep, base_dir: for adapter streams"):  # before Ray: no server started
        Fleet(url, keep=3, base_dir="/models/base")
    with pytest.raises(ValueError, match="keep must be 1 or more"):
        FleetSpec(url="/s", name="f", replicas=1, keep=0)


def test_cache_versions_are_for_a_fleet_of_a_weights_stream(tmp_path, capsys):
    from ckptstream import Publisher
    from ckptstream.testing.adapters import tiny_peft_model
    from ckptstream.testing.models import TinyModelSpec, write_tiny_model

    url = str(tmp_path / "lora")
    base = write_tiny_model(tmp_path / "base", TinyModelSpec())
    with Publisher(url, adapter_of=tiny_peft_model(base, rank=2, seed=1)) as publisher:
        publisher.publish().result()
    assert main(["fleet", "up", url, "--replicas", "1", "--cache-versions", "0", "--address", "127.0.0.1:9"]
                ) == EXIT_USAGE
    assert f"--cache-versions: for weights streams; {url} is an adapter stream" in capsys.readouterr().err


def test_fleet_help_has_examples_and_imports_neither_torch_nor_ray():
    import subprocess
    import sys

    check = ("import contextlib, io, sys\n"
             "from ckptstream.cli import main\n"
             "for argv in [['fleet', c, '--help'] for c in ('up', 'status', 'down')]:\n"
             "    with contextlib.redirect_stdout(io.StringIO()) as out:\n"
             "        try:\n"
             "            code = main(argv)\n"
             "        except SystemExit as exc:\n"
             "            code = exc.code\n"
             "    assert code == 0 and 'examples:' in out.getvalue() and 'exit codes:' in out.getvalue(), argv\n"
             "assert 'torch' not in sys.modules and 'ray' not in sys.modules\n")
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_test_cluster_finds_its_processes_by_their_open_files_and_their_children(tmp_path):
    """Ray's processes rename themselves (their /proc environment is gone then): what the teardown kills is
    found by the files they keep open in the cluster's directory, and by parenthood."""
    import subprocess

    from ckptstream.testing.ray import cluster_processes, pid_alive

    shell = subprocess.Popen(["sh", "-c", f"exec 3>{tmp_path}/log; sleep 60 3>&- & wait"])
    try:
        deadline = time.monotonic() + 10
        while len(found := cluster_processes(str(tmp_path))) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert shell.pid in found and len(found) == 2  # the shell (its open file) and its child (closed it)
        assert cluster_processes(str(tmp_path / "other")) == []
    finally:
        for pid in cluster_processes(str(tmp_path)):
            os.kill(pid, 9)
        shell.wait()
    deadline = time.monotonic() + 10  # a SIGKILLed orphan ends (and init reaps it) a moment later
    while any(pid_alive(p) for p in found) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(pid_alive(p) for p in found)
