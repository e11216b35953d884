"""Serving an adapter stream without a server: the vLLM arguments ``serve`` computes, the adapter names, the
alias file of the stable name, and the reading of vLLM's count of adapters' requests."""

from __future__ import annotations

import re

import pytest

from ckptstream.errors import VllmArgumentError, VllmError
from ckptstream.lora_aliases import ALIASES_ENV, read_aliases, write_alias
from ckptstream.vllm_loader.adapters.resident import parse_version_name, version_name
from ckptstream.vllm_loader.client import lora_names_in_use
from ckptstream.vllm_loader.serve import RUNTIME_LORA_ENV, adapter_vllm_settings


def test_the_settings_hold_the_newest_versions_and_the_stable_name():
    args, env = adapter_vllm_settings(["--dtype", "bfloat16"], keep=3, rank=12, aliases="/run/a.json")
    assert args == ["--dtype", "bfloat16", "--enable-lora", "--max-loras", "4", "--max-cpu-loras", "5",
                    "--max-lora-rank", "16"]
    assert env == {RUNTIME_LORA_ENV: "True", ALIASES_ENV: "/run/a.json"}


def test_the_users_own_settings_are_kept_where_they_suffice():
    user = ["--enable-lora", "--max-loras=6", "--max-lora-rank", "64"]
    args, _ = adapter_vllm_settings(user, keep=2, rank=8, aliases="a.json")
    assert args == [*user, "--max-cpu-loras", "6"]  # vLLM wants at least --max-loras there
    args, _ = adapter_vllm_settings(["--max-cpu-loras", "3"], keep=2, rank=512, aliases="a.json")
    assert args == ["--max-cpu-loras", "3", "--enable-lora", "--max-loras", "3", "--max-lora-rank", "512"]


@pytest.mark.parametrize("user, keep, rank, says", [
    (["--max-loras", "3"], 3, 8, "--max-loras 3 is below --keep 3 + 1"),
    (["--max-lora-rank=8"], 1, 16, "--max-lora-rank 8 is below the adapters' rank 16"),
    ([], 1, 1024, "rank 1024 is above vLLM's largest --max-lora-rank 512"),
    (["--disable-log-stats"], 1, 8, "request statistics"),
    (["--max-loras", "many"], 1, 8, "--max-loras 'many' is not an integer"),
    ([], 0, 8, "--keep must be at least 1"),
])
def test_contradicting_settings_are_refused(user, keep, rank, says):
    with pytest.raises(VllmArgumentError, match=re.escape(says)) as refused:
        adapter_vllm_settings(user, keep=keep, rank=rank, aliases="a.json")
    assert refused.value.exit_code == 2


def test_version_names():
    assert version_name("policy", 17) == "policy@17"
    assert parse_version_name("policy", "policy@17") == 17
    for other in ("policy", "policy@", "policy@x", "other@17", "policy@17@3", "policy-2@17"):
        assert parse_version_name("policy", other) is None, other


def test_the_alias_file_is_replaced_whole(tmp_path):
    aliases = tmp_path / "aliases.json"
    assert read_aliases(aliases) == {}
    write_alias(aliases, "policy", tmp_path / "v1")
    write_alias(aliases, "critic", tmp_path / "c1")
    write_alias(aliases, "policy", tmp_path / "v2")
    assert read_aliases(aliases) == {"policy": str(tmp_path / "v2"), "critic": str(tmp_path / "c1")}
    assert [p.name for p in tmp_path.iterdir()] == ["aliases.json"]  # no temporary left
    aliases.write_text("[1]")
    with pytest.raises(ValueError, match="not a JSON object"):
        read_aliases(aliases)


GAUGE = """\
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="4",running_lora_adapters="",waiting_lora_adapters=""} 1.7963131541192636e+09
vllm:lora_requests_info{max_lora="4",running_lora_adapters="p@1,p",waiting_lora_adapters="p@1,p"} 1.79631315e+09
vllm:lora_requests_info{max_lora="4",running_lora_adapters="p@2",waiting_lora_adapters="p@2,q\\\\\\"x"} 1.8e+09
vllm:num_requests_running{engine="0"} 3.0
"""


def test_the_newest_series_of_vllms_gauge_names_the_adapters_in_use():
    assert lora_names_in_use(GAUGE) == {"p@2", 'q\\"x'}
    older = "\n".join(line for line in GAUGE.splitlines() if "1.8e+09" not in line)
    assert lora_names_in_use(older) == set()  # the newest: every request ended
    assert lora_names_in_use("\n".join(GAUGE.splitlines()[:2])) == set()  # no adapter request yet


def test_a_server_without_the_gauge_is_an_error():
    with pytest.raises(VllmError, match="--disable-log-stats"):
        lora_names_in_use("vllm:num_requests_running 0\n", "http://h:1")
