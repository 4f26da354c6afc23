"""The HTTP load generator's arithmetic: arrivals, percentiles, SSE chunk parsing, the summary."""

from __future__ import annotations

import argparse
import math

import pytest

from kvserve.bench import serving
from kvserve.bench.serving import RequestResult, arrival_offsets, chunk_text, percentiles, summarize
from kvserve.bench.workloads import BenchRequest


def test_arrivals_are_seeded_poisson_or_all_at_once():
    assert arrival_offsets(5, math.inf, 0) == [0.0] * 5
    a = arrival_offsets(2000, 10.0, 7)
    assert a == arrival_offsets(2000, 10.0, 7) and a != arrival_offsets(2000, 10.0, 8)
    assert a[0] == 0 and all(x < y for x, y in zip(a, a[1:], strict=False))
    assert (a[-1] / (len(a) - 1)) == pytest.approx(0.1, rel=0.1)  # mean gap 1 / rate


def test_percentiles_interpolate_in_ms():
    p = percentiles([0.001 * i for i in range(1, 101)])  # 1..100 ms
    assert p["mean_ms"] == pytest.approx(50.5)
    assert (p["p50_ms"], p["p90_ms"], p["p99_ms"]) == pytest.approx((50.5, 90.1, 99.01))
    assert percentiles([])["p99_ms"] is None


def test_chunk_text_reads_both_endpoints():
    assert chunk_text({"choices": [{"index": 0, "text": "ab", "finish_reason": None}]}) == "ab"
    assert chunk_text({"choices": [{"index": 0, "delta": {"content": "x"}}]}) == "x"
    assert chunk_text({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}) == ""
    assert chunk_text({"choices": [], "usage": {"completion_tokens": 3}}) == ""


def test_summary_counts_only_completed_requests():
    results = [RequestResult(True, 10, 4, ttft=0.1, e2e=0.4, itls=[0.1, 0.1, 0.1]),
               RequestResult(True, 10, 4, ttft=0.3, e2e=0.6, itls=[0.1, 0.1, 0.1]),
               RequestResult(False, 10, error="HTTP 429: busy")]
    s = summarize(results, wall=2.0)
    assert (s["completed"], s["failed"], s["errors"]) == (2, 1, ["HTTP 429: busy"])
    assert s["output_throughput"] == pytest.approx(4.0) and s["total_token_throughput"] == pytest.approx(14.0)
    assert s["ttft"]["p50_ms"] == pytest.approx(200.0) and s["itl"]["p99_ms"] == pytest.approx(100.0)


def test_sampling_flags_reach_the_request_body():
    parser = argparse.ArgumentParser()
    serving.add_parser(parser.add_subparsers())
    greedy = parser.parse_args(["serve", "--base-url", "http://x"])
    sampled = parser.parse_args(["serve", "--base-url", "http://x", "--temperature", "1", "--top-p", "0.9",
                                 "--top-k", "50"])
    req = BenchRequest([5, 6, 7], 4)

    def body(args):
        target = serving.Target("http://x/v1/completions", None, False, True, {}, False, serving.sampling_fields(args))
        return serving.request_body(req, target)

    assert body(greedy)["temperature"] == 0 and "top_p" not in body(greedy) and "top_k" not in body(greedy)
    assert {k: body(sampled)[k] for k in ("temperature", "top_p", "top_k")} == {"temperature": 1.0, "top_p": 0.9,
                                                                             "top_k": 50}
    for bad in (["--temperature", "-1"], ["--top-p", "0"], ["--top-p", "1.5"]):
        with pytest.raises(ValueError, match="temperature|top-p"):
            serving._validated_run(parser.parse_args(["serve", "--base-url", "http://x", *bad]))
