"""Prefix-aware against round-robin routing over two real replicas: multi-turn chats about documents.

Each conversation pastes its own document (a slice of tests/data/alice29.txt, ~1,500 tokens) under
one short shared system prompt, then asks follow-up questions, resending the whole history every
turn as chat clients do. The conversations run side by side, turn by turn, sent in a seeded random
order each turn (in a fixed order round-robin would pin each conversation to one replica). Each
replica's KV pool holds about half the conversations' histories, as a loaded server's does: where
a conversation's history is cached decides whether its next turn is a hit. The script reports each
router's prefix-cache hit rate (summed over the replicas' /metrics) and the time to first token.

    .venv/bin/python benchmarks/router_prefix.py --conversations 8 --turns 6 [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

import httpx

from kvserve.bench.launch import ServerProcess

SYSTEM = "You are a careful reading assistant. Answer questions about the user's document in two sentences."
DOCUMENT = Path(__file__).resolve().parent.parent / "tests" / "data" / "alice29.txt"
DOC_CHARS = 6000
QUESTIONS = ["Who is in this passage?", "What happens next?", "Why is that?", "Quote one line.",
             "What is the most surprising part?", "Summarise it for me.", "And after that?", "Anything else?"]
KV_BLOCKS = 560  # x 16 tokens per replica: about half of 8 conversations' final histories (--kv-blocks)


async def _turn(client: httpx.AsyncClient, url: str, history: list[dict]) -> tuple[float, str]:
    start = time.perf_counter()
    ttft, text = None, []
    body = {"model": "SmolLM2-135M-Instruct", "messages": history, "max_tokens": 24, "temperature": 0,
            "stream": True}
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
            if delta and ttft is None:
                ttft = time.perf_counter() - start
            text.append(delta)
    return ttft if ttft is not None else time.perf_counter() - start, "".join(text)


async def _workload(url: str, conversations: int, turns: int) -> list[float]:
    text = DOCUMENT.read_text(encoding="utf-8")
    histories = [[{"role": "system", "content": SYSTEM},
                  {"role": "user", "content": "Here is my document:\n" + text[c * DOC_CHARS:(c + 1) * DOC_CHARS]}]
                 for c in range(conversations)]
    ttfts = []
    rng = random.Random(0)
    async with httpx.AsyncClient(timeout=600) as client:
        for t in range(turns):
            for h in histories:
                question = QUESTIONS[t % len(QUESTIONS)]
                if h[-1]["role"] == "user":  # the first turn: the question follows the document
                    h[-1] = {"role": "user", "content": h[-1]["content"] + "\n\n" + question}
                else:
                    h.append({"role": "user", "content": question})
            order = rng.sample(histories, len(histories))
            results = await asyncio.gather(*(_turn(client, url, h) for h in order))
            for h, (ttft, text) in zip(order, results):
                h.append({"role": "assistant", "content": text})
                ttfts.append(ttft)
    return ttfts


def _sum_metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def run(router: str, conversations: int, turns: int, backend: str, kv_blocks: int) -> dict:
    args = ["--data-parallel-size", "2", "--router", router, "--distributed-backend", backend,
            "--num-kv-blocks", str(kv_blocks), "--block-size", "16", "--num-threads", "1"]  # a core each
    with ServerProcess(args, startup_timeout=900) as server:
        ttfts = asyncio.run(_workload(server.base_url, conversations, turns))
        text = httpx.get(server.url("/metrics"), timeout=10).text
    hits, queries = _sum_metric(text, "kvserve:prefix_cache_hits_total"), _sum_metric(
        text, "kvserve:prefix_cache_queries_total")
    return {"router": router, "prefix_hit_rate": hits / queries if queries else 0.0, "prefix_hits": hits,
            "prefix_queries": queries, "ttft_p50_s": statistics.median(ttfts),
            "ttft_p90_s": statistics.quantiles(ttfts, n=10)[-1], "requests": len(ttfts)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--backend", choices=["mp", "ray"], default="mp")
    p.add_argument("--kv-blocks", type=int, default=KV_BLOCKS, help="blocks of 16 tokens in each replica's pool")
    p.add_argument("--json", default=None, help="write the results here too")
    args = p.parse_args()
    rows = [run(r, args.conversations, args.turns, args.backend, args.kv_blocks)
            for r in ("round-robin", "prefix-aware")]
    for r in rows:
        print(f"{r['router']:13} prefix hit rate {r['prefix_hit_rate']:.3f} ({r['prefix_hits']:.0f} of "
              f"{r['prefix_queries']:.0f} prompt tokens), TTFT p50 {r['ttft_p50_s']:.3f} s, p90 {r['ttft_p90_s']:.3f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"conversations": args.conversations, "turns": args.turns, "kv_blocks": args.kv_blocks,
                       "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
