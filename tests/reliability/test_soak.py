"""`kvserve bench soak` for a few seconds: the load runs, RSS is sampled, and nothing is left behind."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_short_soak_reports_rss_and_no_leaks():
    run = subprocess.run([sys.executable, "-m", "kvserve.cli", "bench", "soak", "--minutes", "0.25",
                          "--concurrency", "4", "--sample-seconds", "5", "--json"],
                         capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(report["rss_mib"]) >= 3 and report["rss_end_mib"] > 0
    assert report["requests"]["ok"] > 0 and report["requests"]["bad"] > 0 and report["requests"]["errors"] == 0
    assert set(report["left_after_load"].values()) == {0.0} and report["healthy_after"]
