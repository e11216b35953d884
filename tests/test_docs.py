"""The README and the docs pages as a user meets them: every shell block marked runnable (a ``<!-- runnable -->``
line right before it) runs as written, the README stays a front door, every CLI option says what it does.

The docs site's own build (``mkdocs build --strict``: links, anchors, the generated reference) runs in
``make test`` before pytest; docs/contributing.md says how the pages are made."""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
RUNNABLE = re.compile(r"^<!-- runnable -->\n```(?:bash|sh)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
NEEDS = {"vllm": re.compile(r"ckptstream (serve|follow|replay)|vllm"),
         "peft": re.compile(r"make-tiny-adapter|--from-peft")}
"""What a block needs installed, by what it runs (skipped without it, as the tests of those parts are)."""
BLOCK_TIMEOUT = 480


def runnable_blocks(page: Path) -> list[tuple[int, str]]:
    """(line, text) of each runnable shell block of ``page``, in order."""
    text = page.read_text()
    return [(text.count("\n", 0, m.start()) + 2, m.group(1)) for m in RUNNABLE.finditer(text)]


PAGES_WITH_BLOCKS = [page for page in PAGES if runnable_blocks(page)]


def test_the_readme_and_the_guides_have_runnable_blocks() -> None:
    """The marker is found where it is used (a typo in it would silently skip the blocks below)."""
    names = {page.relative_to(ROOT).as_posix() for page in PAGES_WITH_BLOCKS}
    assert {"README.md", "docs/guides/publishing.md", "docs/guides/across-sites.md"} <= names
    marked = sum(len(re.findall(r"^<!-- runnable -->$", page.read_text(), re.MULTILINE)) for page in PAGES)
    assert marked == sum(len(runnable_blocks(page)) for page in PAGES), "a runnable marker not right before a block"


@pytest.mark.parametrize("page", PAGES_WITH_BLOCKS, ids=lambda page: page.relative_to(ROOT).as_posix())
def test_runnable_blocks_run_as_written(page: Path, tmp_path: Path) -> None:
    """A page's runnable blocks, in order, in one fresh directory (a later block may go on from an earlier one),
    each by ``bash -e``: any failing command fails the test. Whatever a block left running (``... &``) is stopped
    afterwards, its process group waited for, so that ports and memory are free for the next."""
    blocks = runnable_blocks(page)
    for module, pattern in NEEDS.items():
        if any(pattern.search(text) for _, text in blocks):
            pytest.importorskip(module)
    for line, text in blocks:
        process = subprocess.Popen(["bash", "-e", "-c", text], cwd=tmp_path, start_new_session=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            output, _ = process.communicate(timeout=BLOCK_TIMEOUT)
        except subprocess.TimeoutExpired:
            _stop_group(process.pid)
            output = process.communicate()[0] + f"\n(timed out after {BLOCK_TIMEOUT} s)"
        _stop_group(process.pid)
        where = f"{page.relative_to(ROOT)}, the block at line {line}"
        assert process.returncode == 0, f"{where} failed ({process.returncode}):\n{text}\n--- output:\n{output[-4000:]}"


def _stop_group(pgid: int) -> None:
    """SIGTERM to what is left of the block's process group, SIGKILL after 60 s; returns once it is gone."""
    for sig, wait in ((signal.SIGTERM, 60.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)  # polling a process group: no event to wait on


def test_the_readme_is_a_front_door() -> None:
    """At most 250 lines, the two commands as CI runs them, and links that lead into the docs."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    assert "make demo" in readme and "make test" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    links = re.findall(r"\]\(((?:docs/|FORMAT\.md)[^)#]*)", readme)
    assert len(links) >= 10
    for link in links:
        assert (ROOT / link).exists(), link


def test_every_cli_option_has_help() -> None:
    """Every option and argument of every command says what it does (the CLI reference is made from them)."""
    from ckptstream.cli import build_parser

    missing = []
    pending = [("ckptstream", build_parser())]
    while pending:
        name, parser = pending.pop()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                pending += [(f"{name} {child}", sub) for child, sub in action.choices.items()]
                missing += [f"{name} {choice.dest}" for choice in action._choices_actions if not choice.help]
            elif not action.help:
                missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}")
    assert not missing
