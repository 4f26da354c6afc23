"""`kvserve bench soak` end to end, briefly: rounds of load, RSS samples, no errors, no leaks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.e2e.server import ROOT


@pytest.mark.slow
def test_a_short_soak_reports_memory_errors_and_leaks(chat_model):
    run = subprocess.run([sys.executable, "-m", "kvserve.cli", "bench", "soak", str(chat_model), "--minutes", "0.2",
                          "--server-args", "--num-kv-blocks 256 --block-size 8 --max-model-len 256 --dtype float32",
                          "--num-requests", "16", "--prompt-max", "64", "--output-max", "32", "--vocab-size", "200",
                          "--warmup-rounds", "1"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    summary = json.loads(run.stdout[run.stdout.index('{\n  "summary"'):])["summary"]
    assert summary["rounds"] >= 1 and summary["errors"] == 0 and summary["leaks"] == []
    assert summary["rss_last_mib"] > 50
