"""`kvserve bench serve` against a live kvserve server (tiny model): every request completes and
the report's figures are consistent with the workload it sent."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import TINY_VOCAB, check_report, make_tiny_model
from tests.e2e.server import ROOT, ServerProcess


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("tiny-bench"), "LlamaForCausalLM")
    proc = ServerProcess([str(model), "--num-kv-blocks", "256", "--block-size", "8"])
    yield proc
    assert proc.stop() == 0


def _bench(server, *args: str) -> dict:
    cmd = [sys.executable, "-m", "kvserve.cli", "bench", "serve", "--base-url", server.base_url,
           "--vocab-size", str(TINY_VOCAB), "--json", "--no-progress", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr + done.stdout
    return json.loads(done.stdout)


def test_fixed_concurrency_streams_every_token(server):
    # 40 tokens each: a stream may legitimately merge the tokens that arrive while the client is not
    # reading into one chunk, and with 10 a busy machine once left no request with two text chunks
    # (no inter-token gap to report).
    report = _bench(server, "--num-requests", "12", "--max-concurrency", "4", "--prompt-min", "8", "--prompt-max",
                    "24", "--output-min", "40", "--output-max", "40")
    assert (report["completed"], report["failed"]) == (12, 0)
    assert report["output_tokens"] == 480
    for name in ("ttft", "itl", "e2e"):
        p = report[name]
        assert 0 < p["p50_ms"] <= p["p90_ms"] <= p["p99_ms"], name
    assert report["e2e"]["p50_ms"] >= report["ttft"]["p50_ms"]
    assert report["output_throughput"] == pytest.approx(480 / report["duration_s"])


def test_failed_requests_are_reported_and_poisson_text_prompts_run(server):
    # The tiny model has no chat template, so chat requests fail: the bench reports them and exits non-zero.
    cmd = [sys.executable, "-m", "kvserve.cli", "bench", "serve", "--base-url", server.base_url,
           "--endpoint", "chat", "--num-requests", "3", "--json", "--no-progress"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 1
    report = json.loads(done.stdout)
    assert report["failed"] == 3 and "chat template" in report["errors"][0]
    text = _bench(server, "--num-requests", "6", "--request-rate", "20", "--prompt-format", "text",
                  "--output-min", "4", "--output-max", "4", "--prompt-min", "4", "--prompt-max", "8")
    assert (text["completed"], text["output_tokens"]) == (6, 24)
    assert text["config"]["request_rate"] == 20.0


def test_report_puts_servers_and_load_points_side_by_side(server, tmp_path):
    # The same server under two names stands in for two servers: the report cannot tell them apart.
    out = tmp_path / "report"
    report = _bench(server, "--base-url", server.base_url, server.base_url, "--label", "first", "second",
                    "--max-concurrency", "1", "4", "--num-requests", "4", "--prompt-min", "8", "--prompt-max", "8",
                    "--output-min", "12", "--output-max", "12", "--report", str(out))
    runs = report["runs"]
    assert [(r["config"]["base_url"], r["config"]["max_concurrency"]) for r in runs] == \
        [(server.base_url, 1), (server.base_url, 4)] * 2
    assert all(r["completed"] == 4 and r["output_tokens"] == 48 for r in runs)
    page, saved = check_report(out, ("throughput.png", "ttft.png", "itl.png"), "runs.json")
    assert page.count("<td>first</td>") == 2 and page.count("<td>second</td>") == 2
    assert "concurrency 4" in page
    assert [r["server"] for r in saved["runs"]] == ["first", "first", "second", "second"]


def test_bench_prefix_writes_a_report(server, tmp_path):
    out = tmp_path / "prefix-report"
    cmd = [sys.executable, "-m", "kvserve.cli", "bench", "prefix", "--base-url", server.base_url, "--workload", "shared",
           "--num-requests", "4", "--prefix-len", "24", "--max-tokens", "4", "--vocab-size", str(TINY_VOCAB),
           "--json", "--report", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr + done.stdout
    printed = json.loads(done.stdout)
    page, saved = check_report(out, ("throughput.png", "ttft.png"))
    assert saved == printed and saved["server"]["completed"] == 4
    assert "<td>server</td><td>4/4</td>" in page and "workload shared" in page
