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

from kvserve.bench.launch import ServerProcess
from kvserve.bench.prefix_workloads import agentic_branches, multi_turn_chat, shared_system_prompt
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


def _print(report: dict, args) -> None:
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
    p.set_defaults(func=run)


if __name__ == "__main__":  # pragma: no cover
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    a = parser.parse_args(sys.argv[1:])
    sys.exit(a.func(a))
