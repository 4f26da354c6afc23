"""Prefix-aware against round-robin routing over two real replicas: multi-turn chats about documents.

Each conversation pastes its own document (a slice of tests/data/alice29.txt, ~1,500 tokens) under
one short shared system prompt, then asks follow-up questions, resending the whole history every
turn as chat clients do. Each replica's KV pool holds half the conversations' final histories (and
4% more), as a loaded server's does: where a conversation's history is cached decides whether its
next turn is a hit. Reported per run: each router's prefix-cache hit rate (cached prompt tokens /
prompt tokens, summed over the replicas' /metrics), the time to first token, and where the turns
after the first went (to the replica of the conversation's previous turn or the other) with each
side's hit rate; over several seeds, the mean and range of each and the ratio of the mean hit rates.

Schedules (``--schedule``): ``independent`` (the default) runs each conversation at its own pace,
an exponential think time (mean ``--think``, seeded) before each turn, as users and agents do;
``waves`` sends every conversation's turn t together, in a seeded order, and waits for all of them
before turn t + 1. Seeds alternate which router runs first.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/router_prefix.py --seeds 0 1 2 3 4 [--trace] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from kvserve.bench.launch import ServerProcess

SYSTEM = "You are a careful reading assistant. Answer questions about the user's document in two sentences."
DOCUMENT = Path(__file__).resolve().parent.parent / "tests" / "data" / "alice29.txt"
DOC_CHARS = 6000
QUESTIONS = ["Who is in this passage?", "What happens next?", "Why is that?", "Quote one line.",
             "What is the most surprising part?", "Summarise it for me.", "And after that?", "Anything else?"]
KV_BLOCKS = 480  # x 16 tokens per replica: 8 conversations' final histories take ~920 (--kv-blocks)
ROUTERS = ("round-robin", "prefix-aware")


@dataclass
class Turn:
    conversation: int
    turn: int
    replica: int
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    sent_s: float  # since the workload started


async def _turn(client: httpx.AsyncClient, url: str, history: list[dict]) -> tuple[float, str, int, dict]:
    start = time.perf_counter()
    ttft, text, usage = None, [], {}
    body = {"model": "SmolLM2-135M-Instruct", "messages": history, "max_tokens": 24, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        replica = int(r.headers.get("x-kvserve-replica", -1))
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            if not chunk.get("choices"):
                continue
            delta = chunk["choices"][0]["delta"].get("content") or ""
            if delta and ttft is None:
                ttft = time.perf_counter() - start
            text.append(delta)
    return ttft if ttft is not None else time.perf_counter() - start, "".join(text), replica, usage


def _histories(conversations: int) -> list[list[dict]]:
    text = DOCUMENT.read_text(encoding="utf-8")
    return [[{"role": "system", "content": SYSTEM},
             {"role": "user", "content": "Here is my document:\n" + text[c * DOC_CHARS:(c + 1) * DOC_CHARS]}]
            for c in range(conversations)]


def _ask(h: list[dict], t: int) -> None:
    question = QUESTIONS[t % len(QUESTIONS)]
    if h[-1]["role"] == "user":  # the first turn: the question follows the document
        h[-1] = {"role": "user", "content": h[-1]["content"] + "\n\n" + question}
    else:
        h.append({"role": "user", "content": question})


async def _one(client, url, h, c, t, t0, log: list[Turn]) -> None:
    sent = time.perf_counter() - t0
    ttft, text, replica, usage = await _turn(client, url, h)
    h.append({"role": "assistant", "content": text})
    details = usage.get("prompt_tokens_details") or {}
    log.append(Turn(c, t, replica, usage.get("prompt_tokens", 0), details.get("cached_tokens", 0), ttft, sent))


async def _waves(url: str, conversations: int, turns: int, seed: int) -> list[Turn]:
    histories, log, rng = _histories(conversations), [], random.Random(seed)
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:
        for t in range(turns):
            for h in histories:
                _ask(h, t)
            order = rng.sample(range(conversations), conversations)  # a fixed order would pin round-robin
            await asyncio.gather(*(_one(client, url, histories[c], c, t, t0, log) for c in order))
    return log


async def _independent(url: str, conversations: int, turns: int, seed: int, think_s: float) -> list[Turn]:
    histories, log, rng = _histories(conversations), [], random.Random(seed)
    thinks = [[rng.expovariate(1 / think_s) for _ in range(turns)] for _ in range(conversations)]
    t0 = time.perf_counter()

    async def chat(client: httpx.AsyncClient, c: int) -> None:
        for t in range(turns):
            await asyncio.sleep(thinks[c][t])  # before the first turn too: the conversations start apart
            _ask(histories[c], t)
            await _one(client, url, histories[c], c, t, t0, log)

    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(chat(client, c) for c in range(conversations)))
    return log


def _per_replica(text: str, name: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{") and 'replica="' in line:
            replica = line.split('replica="', 1)[1].split('"', 1)[0]
            out[replica] = out.get(replica, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def run(router: str, args: argparse.Namespace, seed: int) -> dict:
    argv = ["--data-parallel-size", "2", "--router", router, "--distributed-backend", args.backend,
            "--num-kv-blocks", str(args.kv_blocks), "--block-size", "16", "--num-threads", "1"]  # a core each
    with ServerProcess(argv, startup_timeout=900) as server:
        if args.schedule == "waves":
            log = asyncio.run(_waves(server.base_url, args.conversations, args.turns, seed))
        else:
            log = asyncio.run(_independent(server.base_url, args.conversations, args.turns, seed, args.think))
        text = httpx.get(server.url("/metrics"), timeout=10).text
    hits, queries = (_per_replica(text, f"kvserve:prefix_cache_{n}_total") for n in ("hits", "queries"))
    evictions = _per_replica(text, "kvserve:prefix_cache_evictions_total")
    preemptions = _per_replica(text, "kvserve:num_preemptions_total")
    ttfts = [r.ttft_s for r in log]
    hit_sum, query_sum = sum(hits.values()), sum(queries.values())
    return {"router": router, "seed": seed, "prefix_hit_rate": hit_sum / query_sum if query_sum else 0.0,
            "prefix_hits": hit_sum, "prefix_queries": query_sum, "ttft_p50_s": statistics.median(ttfts),
            "ttft_p90_s": statistics.quantiles(ttfts, n=10)[-1], "requests": len(log),
            "per_replica": {"hits": hits, "queries": queries, "evictions": evictions, "preemptions": preemptions},
            "later_turns": where_later_turns_went([asdict(r) for r in log]),
            "turns": [asdict(r) for r in sorted(log, key=lambda r: (r.conversation, r.turn))]}


def where_later_turns_went(turns: list[dict]) -> dict:
    """Turns after the first, split by whether they went to the replica of the conversation's
    previous turn: each side's share of those turns and the share of its prompt tokens that hit."""
    sides = {"same": [0, 0, 0], "other": [0, 0, 0]}  # turns, cached tokens, prompt tokens
    previous = {}
    for t in sorted(turns, key=lambda t: (t["conversation"], t["turn"])):
        if t["conversation"] in previous:
            side = sides["same" if previous[t["conversation"]] == t["replica"] else "other"]
            side[0] += 1
            side[1] += t["cached_tokens"]
            side[2] += t["prompt_tokens"]
        previous[t["conversation"]] = t["replica"]
    total = sum(n for n, _, _ in sides.values()) or 1
    return {k: {"share_of_turns": n / total, "hit_rate": c / p if p else 0.0} for k, (n, c, p) in sides.items()}


def print_trace(row: dict) -> None:
    """Per conversation and turn: the replica that served it and the share of its prompt that hit."""
    print(f"  {row['router']} seed {row['seed']}: replica:cached/prompt tokens per turn; per replica "
          + ", ".join(f"r{k} hits {row['per_replica']['hits'][k]:.0f}/{v:.0f} evictions "
                      f"{row['per_replica']['evictions'].get(k, 0):.0f}" for k, v in row["per_replica"]["queries"].items()))
    by_conv: dict[int, list[dict]] = {}
    for t in row["turns"]:
        by_conv.setdefault(t["conversation"], []).append(t)
    for c, turns in sorted(by_conv.items()):
        print(f"    c{c}: " + "  ".join(f"r{t['replica']}:{t['cached_tokens']}/{t['prompt_tokens']}" for t in turns))


def _spread(values: list[float]) -> str:
    mean = statistics.fmean(values)
    return f"{mean:.3f} ({min(values):.3f}-{max(values):.3f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--schedule", choices=["independent", "waves"], default="independent")
    p.add_argument("--think", type=float, default=2.0, help="mean think time before a turn, seconds (independent)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="one run per router and seed")
    p.add_argument("--routers", nargs="+", choices=ROUTERS, default=list(ROUTERS))
    p.add_argument("--backend", choices=["mp", "ray"], default="mp")
    p.add_argument("--kv-blocks", type=int, default=KV_BLOCKS, help="blocks of 16 tokens in each replica's pool")
    p.add_argument("--trace", action="store_true", help="print each run's routing and hits per conversation and turn")
    p.add_argument("--json", default=None, help="write the results here too")
    args = p.parse_args()
    rows = []
    for i, seed in enumerate(args.seeds):
        routers = args.routers if i % 2 == 0 else args.routers[::-1]  # alternate which runs first
        for router in routers:
            row = run(router, args, seed)
            rows.append(row)
            print(f"{router:13} seed {seed}: prefix hit rate {row['prefix_hit_rate']:.3f} ({row['prefix_hits']:.0f} of "
                  f"{row['prefix_queries']:.0f} prompt tokens), TTFT p50 {row['ttft_p50_s']:.3f} s, "
                  f"p90 {row['ttft_p90_s']:.3f} s", flush=True)
            same, other = row["later_turns"]["same"], row["later_turns"]["other"]
            print(f"{'':13} later turns: {same['share_of_turns']:.0%} to the previous turn's replica (hit rate "
                  f"{same['hit_rate']:.3f}), {other['share_of_turns']:.0%} to the other (hit rate {other['hit_rate']:.3f})")
            if args.trace:
                print_trace(row)
    summary = {}
    for router in args.routers:
        mine = [r for r in rows if r["router"] == router]
        summary[router] = {"prefix_hit_rate_mean": statistics.fmean(r["prefix_hit_rate"] for r in mine),
                           "ttft_p50_s_mean": statistics.fmean(r["ttft_p50_s"] for r in mine)}
        print(f"{router:13} over {len(mine)} seeds: hit rate {_spread([r['prefix_hit_rate'] for r in mine])}, "
              f"TTFT p50 {_spread([r['ttft_p50_s'] for r in mine])} s")
    if len(summary) == 2:
        rr, pa = (summary[r]["prefix_hit_rate_mean"] for r in ROUTERS)
        summary["hit_rate_ratio_of_means"] = pa / rr if rr else None
        print(f"prefix-aware / round-robin hit rate (ratio of means): {pa / rr:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"conversations": args.conversations, "turns": args.turns, "schedule": args.schedule,
                       "think_s": args.think, "kv_blocks": args.kv_blocks, "seeds": args.seeds,
                       "summary": summary, "runs": rows}, f, indent=2)


if __name__ == "__main__":
    main()
