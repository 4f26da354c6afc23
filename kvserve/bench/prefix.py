"""`kvserve bench prefix`: workloads that share prefixes, through an OpenAI-compatible server.

Workloads (seeded, token-id prompts, greedy, EOS ignored): (a) ``shared``: N requests sharing a
long system prompt; (b) ``chat``: conversations whose every turn resends the whole history;
(c) ``agent``: one long context, then branches extended over several rounds. A round is sent only
after the previous one finished, as a real conversation would.

With ``--base-url`` it measures that server. Without it, it starts `kvserve serve` twice, with and
without prefix caching (same flags otherwise), runs the same workload on both and prints the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from pathlib import Path

from kvserve.bench.launch import ServerProcess
from kvserve.bench.prefix_workloads import agentic_branches, multi_turn_chat, shared_system_prompt
from kvserve.bench.report import add_report_argument
from kvserve.bench.serving import RequestResult, Target, run_load, summarize
from kvserve.bench.workloads import BenchRequest

WORKLOADS = ("shared", "chat", "agent")


def build_rounds(args) -> list[list[list[int]]]:
    rng = random.Random(args.workload_seed)
    vocab = (100, args.vocab_size)
    if args.workload == "shared":
        return [shared_system_prompt(rng, args.num_requests, args.prefix_len, vocab)]
    if args.workload == "chat":
        return multi_turn_chat(rng, args.conversations, args.turns, vocab)
    return agentic_branches(rng, args.prefix_len, args.branches, args.rounds, vocab)


def run_rounds(base_url: str, rounds: list[list[list[int]]], max_tokens: int, concurrency: int) -> dict:
    target = Target(url=base_url.rstrip("/") + "/v1/completions", model=None, chat=False, ignore_eos=True,
                    headers={}, text_prompts=False)
    results: list[RequestResult] = []
    start = time.perf_counter()
    for prompts in rounds:
        reqs = [BenchRequest(p, max_tokens) for p in prompts]
        got, _ = asyncio.run(run_load(reqs, target, math.inf, concurrency, 0, 3600.0, False))
        results += got
    return summarize(results, time.perf_counter() - start)


def run(args) -> int:
    if args.workload not in WORKLOADS:
        raise ValueError(f"--workload {args.workload!r} must be one of {WORKLOADS}")
    rounds = build_rounds(args)
    if args.base_url:
        report = {"server": run_rounds(args.base_url, rounds, args.max_tokens, args.max_concurrency)}
        report["server"]["prefix_cache_hit_rate"] = None  # another engine's metric names are unknown
    else:
        report = {}
        for name, extra in (("caching", []), ("no_caching", ["--no-prefix-caching"])):
            with ServerProcess(args.serve_args.split() + extra) as server:
                run_rounds(server.base_url, [[rounds[0][0][:32]]], 2, 1)  # warm-up, shares nothing
                report[name] = run_rounds(server.base_url, rounds, args.max_tokens, args.max_concurrency)
                report[name]["prefix_cache_hit_rate"] = server.metric("kvserve:prefix_cache_hit_rate")
        report["throughput_ratio"] = report["caching"]["output_throughput"] / report["no_caching"]["output_throughput"]
        report["mean_ttft_ratio"] = report["caching"]["ttft"]["mean_ms"] / report["no_caching"]["ttft"]["mean_ms"]
    _print(report, args)
    return 0


def write_report(report: dict, args) -> Path:
    from kvserve.bench.report import Page, Table, bar_chart, fmt, write_page

    out = Path(args.report)
    servers = {name: s for name, s in report.items() if isinstance(s, dict)}
    names = list(servers)
    bar_chart(out / "throughput.png", f"{args.workload}: output throughput", "tokens/s", names,
              {"output tokens/s": [s["output_throughput"] for s in servers.values()]})
    bar_chart(out / "ttft.png", f"{args.workload}: time to first token", "ms", names,
              {k: [s["ttft"][f"{k}_ms"] for s in servers.values()] for k in ("mean", "p50", "p99")})
    rows = [(name, f"{s['completed']}/{s['completed'] + s['failed']}", fmt(s["duration_s"]), fmt(s["output_throughput"]),
             fmt(s["total_token_throughput"]), fmt(s["ttft"]["mean_ms"], 0), fmt(s["ttft"]["p50_ms"], 0),
             fmt(s["ttft"]["p99_ms"], 0), fmt(s.get("prefix_cache_hit_rate"), 3)) for name, s in servers.items()]
    tables = [Table(("server", "ok", "seconds", "output tok/s", "total tok/s", "TTFT mean ms", "TTFT p50 ms",
                     "TTFT p99 ms", "prefix hit rate"), rows)]
    if "throughput_ratio" in report:
        tables.append(Table(("caching / no caching", "ratio"), [("throughput", fmt(report["throughput_ratio"], 2)),
                                                                ("mean TTFT", fmt(report["mean_ttft_ratio"], 3))]))
    described = f"workload {args.workload}, {args.max_tokens} output tokens per request, seed {args.workload_seed}"
    return write_page(Page("kvserve bench prefix", described, tables,
                           [("throughput.png", "Output throughput"), ("ttft.png", "Time to first token")],
                           {"workload": args.workload, **report}), out)


def _print(report: dict, args) -> None:
    if args.report:
        print(f"report: {write_report(report, args)}", file=sys.stderr)
    if args.json:
        print(json.dumps({"workload": args.workload, **report}, indent=2))
        return
    for name, s in report.items():
        if not isinstance(s, dict):
            continue
        print(f"{args.workload:6} {name:10}: {s['completed']} ok, {s['failed']} failed, {s['duration_s']:.1f} s, "
              f"{s['output_throughput']:.1f} out tok/s, {s['total_token_throughput']:.1f} total tok/s, "
              f"TTFT mean {s['ttft']['mean_ms']:.0f} ms p50 {s['ttft']['p50_ms']:.0f} ms, "
              f"hit rate {s.get('prefix_cache_hit_rate')}")
    if "throughput_ratio" in report:
        print(f"caching / no caching: throughput x{report['throughput_ratio']:.2f}, "
              f"mean TTFT x{report['mean_ttft_ratio']:.3f}")


def add_parser(bench_sub) -> None:
    p = bench_sub.add_parser("prefix", help="prefix-sharing workloads through the server, caching on vs off")
    p.add_argument("--workload", choices=WORKLOADS, default="shared")
    p.add_argument("--base-url", default=None, help="measure this server instead of starting two")
    p.add_argument("--serve-args", default="--dtype bfloat16", help="flags for the `kvserve serve` it starts")
    p.add_argument("--num-requests", type=int, default=200, help="(a) requests sharing the system prompt")
    p.add_argument("--prefix-len", type=int, default=1000, help="(a) system prompt / (c) context length")
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--branches", type=int, default=8)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-concurrency", type=int, default=64)
    p.add_argument("--vocab-size", type=int, default=49152)
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    add_report_argument(p, "throughput and TTFT of each server")
    p.set_defaults(func=run)


if __name__ == "__main__":  # pragma: no cover
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    a = parser.parse_args(sys.argv[1:])
    sys.exit(a.func(a))
