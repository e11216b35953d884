"""Across sites: N followers behind a mirror and a site relay cost the origin one copy of the stream."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def test_four_followers_behind_a_site_relay_cost_the_origin_one_copy():
    done = subprocess.run([sys.executable, str(TOOLS / "bench_relay.py"), "--followers", "4", "--size", "8MB",
                           "--steps", "3", "--json"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout)
    stored = figures["stored_bytes"]
    # Without the relay every follower pulls the whole chain from the origin (each byte once: no data is
    # fetched twice); with it, the mirror carries it once and the site relay serves the four.
    assert 4 * stored <= figures["origin_bytes_without_relay"] <= 4 * stored * 1.02
    assert stored <= figures["origin_bytes_with_relay"] <= stored * 1.02
    assert 4 * stored <= figures["site_relay_bytes"] <= 4 * stored * 1.02
