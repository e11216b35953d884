"""MkDocs hooks (mkdocs.yml ``hooks:``): the parts of the docs site that come from the code or from files kept
outside docs/, made at build time so that they cannot drift.

- ``index.md`` is README.md (its links into docs/ made relative to the site), ``format.md`` is FORMAT.md.
- Docstrings' reST roles (``:class:``) are dropped from the API pages' HTML, their code kept.
- A page's ``<!-- generated: NAME -->`` line is replaced by what ``GENERATED[NAME]`` makes: the CLI reference
  from the argparse definitions (``ckptstream.cli.build_parser``), the metrics from the follower's and the
  relay's Prometheus registries, the exit codes from ``ckptstream.errors``.

Whatever would make a page wrong is a warning, which ``mkdocs build --strict`` turns into a failed build: a CLI
option or positional argument without help text, an unknown generated block.
"""

from __future__ import annotations

import argparse
import html
import inspect
import logging
import os
import re
from pathlib import Path
from typing import Callable

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"^<!-- generated: ([a-z-]+) -->$", re.MULTILINE)
log = logging.getLogger("mkdocs.hooks.ckptstream")


# ------------------------------------------------------------------------------------------- mkdocs events

def on_files(files: Files, config) -> Files:
    """README.md as the home page and FORMAT.md as format.md (the files stay where they are)."""
    readme = (ROOT / "README.md").read_text()
    readme = re.sub(r"\]\(docs/", "](", readme).replace("](FORMAT.md", "](format.md")
    files.append(File.generated(config, "index.md", content=readme))
    files.append(File.generated(config, "format.md", abs_src_path=str(ROOT / "FORMAT.md")))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    def generate(match: re.Match[str]) -> str:
        make = GENERATED.get(match.group(1))
        if make is None:
            log.warning("%s: unknown generated block %r (known: %s)", page.file.src_uri, match.group(1),
                        ", ".join(GENERATED))
            return match.group(0)
        return make()

    return MARKER.sub(generate, markdown)


def on_page_content(html: str, page, config, files) -> str:
    """Docstrings name objects with reST roles (``:class:`Stream```), which Markdown shows as text: keep the code."""
    return SPHINX_ROLE.sub("", html)


SPHINX_ROLE = re.compile(r":(?:class|mod|meth|func|attr|exc|data|obj):(?=<code>)")


# ------------------------------------------------------------------------------------------ the CLI reference

def cli_reference() -> str:
    """Every command: what it does, its usage, every option with its help text, its examples."""
    os.environ["COLUMNS"] = "110"  # argparse wraps usage lines to the terminal's width: the same on every build
    from ckptstream.cli import build_parser

    commands = list(_commands(build_parser(), "ckptstream", None))
    out = ["| command | does |", "|---|---|"]
    out += [f"| [`{name}`](#{_anchor(name)}) | {_text(summary)} |" for name, summary, _ in commands]
    for name, summary, parser in commands:
        out += ["", f"## {name}", "", _text(summary[:1].upper() + summary[1:]) + ".", "",
                "```text", parser.format_usage().strip(), "```", ""]
        formatter = parser._get_formatter()
        rows = []
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            invocation = formatter._format_action_invocation(action)
            if not action.help:
                log.warning("`%s %s` has no help text: give it one (help=...) in ckptstream/cli/", name, invocation)
            elif action.help != argparse.SUPPRESS:
                rows.append(f"| `{invocation}` | {_text(formatter._expand_help(action))} |")  # %(default)s filled
        if rows:
            out += ["| option | meaning |", "|---|---|", *rows, ""]
        examples = (parser.epilog or "").split("\n\nexit codes:")[0]
        if examples.startswith("examples:"):
            out += ["Examples:", "", "```bash", inspect.cleandoc(examples[len("examples:"):]), "```"]
    return "\n".join(out)


def _commands(parser: argparse.ArgumentParser, name: str, summary: str | None):
    """(full name, one-line help, parser) of every command, nested ones (``fleet up``) included."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if summary is not None and not subs:
        yield name, summary, parser
    for sub in subs:
        helps = {choice.dest: choice.help for choice in sub._choices_actions}
        for child_name, child in sub.choices.items():
            if not helps.get(child_name):
                log.warning("`%s %s` has no help text", name, child_name)
            yield from _commands(child, f"{name} {child_name}", helps.get(child_name) or "")


def _anchor(title: str) -> str:
    return re.sub(r"[^a-z0-9-]", "", title.lower().replace(" ", "-"))


def _text(text: str) -> str:
    """Help text as markdown table text: no HTML, emphasis or column breaks by accident."""
    text = html.escape(" ".join(text.split()), quote=False)
    return re.sub(r"([*_|\[\]])", r"\\\1", text)


# ------------------------------------------------------------------------------------------------- metrics

def metrics_reference() -> str:
    """The follower's and the relay's metric families, as their registries define them."""
    from ckptstream.testing.metrics import exported_metrics

    out = ["| metric | type | exported by | help (from the code) |", "|---|---|---|---|"]
    out += [f"| `{m.name}` | {m.type} | {m.exporter} | {_text(m.help)} |" for m in exported_metrics()]
    return "\n".join(out)


def metric_reasons() -> str:
    """The values of the ``reason`` labels, from the follower's one definition of each."""
    from ckptstream.vllm_loader.observe import FALLBACK_REASONS, REFUSAL_REASONS

    return "\n".join([
        "- `ckptstream_refused_versions_total{reason}`: "
        + ", ".join(f"`{reason}` ({kind.__name__})" for kind, reason in REFUSAL_REASONS),
        "- `ckptstream_full_reload_fallbacks_total{reason}`: " + ", ".join(f"`{r}`" for r in FALLBACK_REASONS),
    ])


# ---------------------------------------------------------------------------------------------- exit codes

def exit_codes() -> str:
    """``ckptstream.errors``' EXIT_* constants with their comments, and the error classes of ``ckptstream.errors``
    (and the CLI's usage error) that carry each."""
    from ckptstream import errors
    from ckptstream.cli import options  # noqa: F401 - defines UsageError, a CkptStreamError

    source = inspect.getsource(errors)
    classes: dict[int, list[str]] = {}
    pending = [errors.CkptStreamError]
    while pending:
        kind = pending.pop()
        pending += kind.__subclasses__()
        if kind.__module__ in ("ckptstream.errors", "ckptstream.cli.options"):  # not what other pages imported
            classes.setdefault(kind.exit_code, []).append(f"`{kind.__name__}`")
    out = ["| code | constant | meaning | raised as |", "|---|---|---|---|"]
    documented = re.findall(r"^(EXIT_\w+) = (\d+)\s*#\s*(.*)$", source, re.MULTILINE)
    for name in sorted({n for n in vars(errors) if n.startswith("EXIT_")} - {n for n, _, _ in documented}):
        log.warning("ckptstream/errors.py: %s has no comment saying what it means (`%s = N  # meaning`)", name, name)
    for name, value, meaning in documented:
        raised = ", ".join(sorted(set(classes.get(int(value), []))))
        out.append(f"| {value} | `ckptstream.errors.{name}` | {_text(meaning)} | {raised} |")
    return "\n".join(out)


GENERATED: dict[str, Callable[[], str]] = {
    "cli": cli_reference, "metrics": metrics_reference, "metric-reasons": metric_reasons, "exit-codes": exit_codes,
}
