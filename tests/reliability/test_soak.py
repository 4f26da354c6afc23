"""`kvserve bench soak` for a few seconds: rounds run, RSS is sampled, and nothing is left behind."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_short_soak_reports_rss_and_no_leaks(chat_model):
    run = subprocess.run([sys.executable, "-m", "kvserve.cli", "bench", "soak", str(chat_model), "--minutes", "0.2",
                          "--server-args", "--max-model-len 256 --dtype float32", "--num-requests", "8",
                          "--prompt-max", "64", "--output-max", "32", "--vocab-size", "256", "--warmup-rounds", "1"],
                         capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads(run.stdout[run.stdout.index('{\n  "summary"'):])["summary"]
    assert summary["rounds"] >= 2 and summary["rss_last_mib"] > 0, summary
    assert summary["errors"] == 0 and summary["leaks"] == [], summary
