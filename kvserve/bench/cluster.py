"""`kvserve bench cluster`: the real routers in front of 1 to N simulated replicas.

A seeded agentic workload is replayed in simulated time: sessions arrive at a steady rate per
replica, each picks one of a few long system prompts, and every turn resends the whole history
(as chat clients and agents do) after the previous reply and a think time. Each replica is a
continuous-batching engine with a paged, prefix-cached KV pool of the size the planner gives the
chosen model on the chosen GPU, and each of its steps lasts what the planner's roofline says for
that step's decodes and prefill chunks. The routers are the objects `kvserve serve
--data-parallel-size` uses (entrypoints/cluster/router.py), given the same token ids. Reported per
router and replica count: output throughput, TTFT p50/p99 and the prefix-cache hit rate.

What the simulation leaves out: host overhead between steps and preemption (a request reserves
blocks for its whole length when admitted, and waits until they are free).
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import statistics
import sys
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from kvserve.entrypoints.cluster.router import ROUTERS, Router, make_router
from kvserve.kv_cache.hashing import BlockKey, chain_keys
from kvserve.planner.capacity import Setup, kv_capacity_tokens_of
from kvserve.planner.hardware import lookup_gpu
from kvserve.planner.models import resolve_model
from kvserve.planner.roofline import mixed_step
from kvserve.planner.shape import ModelShape


@dataclass(frozen=True)
class Workload:
    sessions_per_replica: int = 48
    rate_per_replica: float = 4.0  # new sessions per second
    system_prompts: int = 4
    system_len: int = 4000  # an agent's instructions and tool definitions
    turns: tuple[int, int] = (3, 10)
    user_len: tuple[int, int] = (100, 1500)  # a user message or a tool's output
    reply_len: tuple[int, int] = (30, 300)
    think_s: float = 2.0  # mean, exponential: a person typing or a tool running
    vocab: int = 32000
    seed: int = 0


@dataclass
class Turn:
    user: list[int]
    reply_len: int


@dataclass
class Session:
    arrival: float
    system: list[int]
    turns: list[Turn]
    think: list[float]  # before each turn after the first
    history: list[int] = field(default_factory=list)
    keys: list[BlockKey] = field(default_factory=list)  # the history's full blocks, extended each turn
    next_turn: int = 0


def make_sessions(w: Workload, num_replicas: int) -> list[Session]:
    """The same sessions for every router at a replica count (their number and rate scale with it)."""
    rng = random.Random(w.seed)
    systems = [[rng.randrange(w.vocab) for _ in range(w.system_len)] for _ in range(w.system_prompts)]
    sessions, t = [], 0.0
    for _ in range(w.sessions_per_replica * num_replicas):
        t += rng.expovariate(w.rate_per_replica * num_replicas)
        turns = [Turn([rng.randrange(w.vocab) for _ in range(rng.randint(*w.user_len))], rng.randint(*w.reply_len))
                 for _ in range(rng.randint(*w.turns))]
        think = [rng.expovariate(1 / w.think_s) for _ in turns]
        sessions.append(Session(t, rng.choice(systems), turns, think))
    return sessions


@dataclass
class Request:
    session: Session
    prompt: list[int]
    keys: list[BlockKey]  # the prompt's full blocks
    reply: list[int]  # the tokens it will generate (fixed by the seed, so every router sees the same)
    arrival: float
    replica: int = -1
    cached: int = 0  # prompt tokens found in the replica's cache
    computed: int = 0  # prompt tokens prefilled so far (the cached ones count)
    generated: int = 0
    first_token_at: float | None = None
    finished_at: float | None = None


class Replica:
    """One engine: FIFO admission under a token budget and a sequence limit, chunked prefill, a KV
    pool of ``num_blocks`` whose free blocks keep their prefix (evicted least recently used first)."""

    def __init__(self, setup: Setup, num_blocks: int, max_num_seqs: int, max_batched_tokens: int) -> None:
        self.setup, self.block_size = setup, setup.block_size
        self.num_blocks, self.max_num_seqs, self.max_batched_tokens = num_blocks, max_num_seqs, max_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.reserved = 0  # blocks held by running requests
        self.cache: OrderedDict[int, None] = OrderedDict()  # hashes of cached full blocks
        self.busy = False
        self._decodes: list[Request] = []  # the step scheduled last
        self._chunks: list[tuple[Request, int]] = []

    def _blocks(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs:
            r = self.waiting[0]
            need = self._blocks(len(r.prompt) + len(r.reply))
            if need > self.num_blocks:
                raise ValueError(f"a request of {len(r.prompt) + len(r.reply)} tokens needs {need} KV blocks; "
                                 f"a replica has {self.num_blocks}: a shorter workload or a bigger GPU")
            if self.reserved + need > self.num_blocks:
                break
            self.waiting.popleft()
            hit = 0
            for k in r.keys[: (len(r.prompt) - 1) // self.block_size]:  # the last token is always computed
                if k.hash not in self.cache:
                    break
                self.cache.move_to_end(k.hash)
                hit += 1
            r.cached = r.computed = hit * self.block_size
            self.reserved += need
            self._evict()
            self.running.append(r)

    def _evict(self) -> None:
        while self.cache and len(self.cache) > self.num_blocks - self.reserved:
            self.cache.popitem(last=False)

    def step(self) -> float | None:
        """Schedule one step: its duration, or None when there is no work."""
        self._admit()
        if not self.running:
            return None
        self._decodes = [r for r in self.running if r.computed == len(r.prompt)]
        budget = self.max_batched_tokens - len(self._decodes)
        self._chunks = []
        for r in self.running:
            if r.computed < len(r.prompt) and budget > 0:
                n = min(len(r.prompt) - r.computed, budget)
                self._chunks.append((r, n))
                budget -= n
        contexts = [len(r.prompt) + r.generated for r in self._decodes]
        return mixed_step(self.setup, contexts, [(r.computed, n) for r, n in self._chunks]).seconds

    def finish_step(self, now: float) -> list[Request]:
        """Apply the step scheduled last; the requests it completed."""
        done = []
        for r in self._decodes:
            r.generated += 1
        for r, n in self._chunks:
            r.computed += n
            if r.computed == len(r.prompt):
                r.generated, r.first_token_at = 1, now
        for r in self.running:
            if r.generated >= len(r.reply):
                done.append(r)
        for r in done:
            r.finished_at = now
            self.running.remove(r)
            self.reserved -= self._blocks(len(r.prompt) + len(r.reply))
            r.session.history = r.prompt + r.reply  # the next turn's prefix
            r.session.keys = chain_keys(r.session.history, self.block_size, r.keys)
            for k in r.session.keys:
                self.cache[k.hash] = None
                self.cache.move_to_end(k.hash)
            self._evict()
        return done


def simulate(router: Router, replicas: list[Replica], sessions: list[Session], seed: int,
             block_size: int) -> list[Request]:
    """Run every session to its end; the requests, completed."""
    rng = random.Random(seed)
    events: list[tuple[float, int, str, object]] = []  # (time, tie-break, kind, what)
    order = 0

    def push(t: float, kind: str, what: object) -> None:
        nonlocal order
        order += 1
        heapq.heappush(events, (t, order, kind, what))

    def start_step(i: int, now: float) -> None:
        seconds = replicas[i].step()
        replicas[i].busy = seconds is not None
        if seconds is not None:
            push(now + seconds, "step", i)

    for s in sessions:
        push(s.arrival, "turn", s)
    requests = []
    while events:
        now, _, kind, what = heapq.heappop(events)
        if kind == "turn":
            s = what
            turn = s.turns[s.next_turn]
            s.next_turn += 1
            prompt = (s.history or s.system) + turn.user
            keys = chain_keys(prompt, block_size, s.keys)
            r = Request(s, prompt, keys, [rng.randrange(1 << 20) for _ in range(turn.reply_len)], now)
            r.replica = router.choose(prompt)
            router.started(r.replica)
            requests.append(r)
            replicas[r.replica].waiting.append(r)
            if not replicas[r.replica].busy:
                start_step(r.replica, now)
        else:
            i = what
            for r in replicas[i].finish_step(now):
                router.finished(i)
                s = r.session
                if s.next_turn < len(s.turns):
                    push(now + s.think[s.next_turn], "turn", s)
            start_step(i, now)
    return requests


def summarize(requests: list[Request]) -> dict:
    ttfts = sorted(r.first_token_at - r.arrival for r in requests)
    span = max(r.finished_at for r in requests) - min(r.arrival for r in requests)
    prompt = sum(len(r.prompt) for r in requests)
    return {
        "requests": len(requests),
        "output_tokens_per_s": sum(len(r.reply) for r in requests) / span,
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p99_s": ttfts[min(len(ttfts) - 1, math.ceil(0.99 * len(ttfts)) - 1)],
        "prefix_hit_rate": sum(r.cached for r in requests) / prompt,
    }


def make_setup(model: str, gpu: str, block_size: int) -> Setup:
    name, cfg = resolve_model(model)
    return Setup(model=ModelShape.from_hf(cfg, name), hardware=lookup_gpu(gpu), dtype="bfloat16",
                 block_size=block_size)


def run_one(setup: Setup, router_name: str, num_replicas: int, workload: Workload,
            max_num_seqs: int = 256, max_batched_tokens: int = 8192) -> dict:
    num_blocks = kv_capacity_tokens_of(setup) // setup.block_size
    if num_blocks <= 0:
        raise ValueError(f"{setup.label}: the weights leave no room for a KV cache")
    replicas = [Replica(setup, num_blocks, max_num_seqs, max_batched_tokens) for _ in range(num_replicas)]
    router = make_router(router_name, num_replicas, setup.block_size)
    for i in range(num_replicas):  # as the front end does, from each replica's /metrics
        router.set_capacity(i, num_blocks)
    requests = simulate(router, replicas, make_sessions(workload, num_replicas), workload.seed, setup.block_size)
    return {"router": router_name, "replicas": num_replicas, **summarize(requests)}


def plot(rows: list[dict], title: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    panels = [(lambda r: r["output_tokens_per_s"] / r["replicas"], "output tokens/s per replica"),
              (lambda r: 1000 * r["ttft_p50_s"], "TTFT p50 (ms)"), (lambda r: r["prefix_hit_rate"], "prefix-cache hit rate")]
    for ax, (value, label) in zip(axes, panels):
        for router in dict.fromkeys(r["router"] for r in rows):
            mine = [r for r in rows if r["router"] == router]
            ax.plot([r["replicas"] for r in mine], [value(r) for r in mine], marker="o", label=router)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("replicas")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def run(args: argparse.Namespace) -> int:
    routers = args.router.split(",")
    bad = [r for r in routers if r not in ROUTERS]
    if bad or any(n < 1 for n in args.replicas):
        print(f"kvserve bench cluster: error: --router takes {', '.join(ROUTERS)}; --replicas positive "
              f"integers", file=sys.stderr)
        return 2
    try:
        setup = make_setup(args.model, args.gpu, args.block_size)
    except (KeyError, ValueError) as e:
        print(f"kvserve bench cluster: error: {e}", file=sys.stderr)
        return 2
    w = Workload(sessions_per_replica=args.sessions_per_replica, rate_per_replica=args.rate_per_replica,
                 system_prompts=args.system_prompts, system_len=args.system_len, think_s=args.think_s,
                 seed=args.seed)
    rows = [run_one(setup, r, n, w, args.max_num_seqs, args.max_num_batched_tokens)
            for n in args.replicas for r in routers]
    if args.json:
        print(json.dumps({"setup": setup.label, "workload": w.__dict__, "results": rows}, indent=2))
    else:
        print(f"{setup.label}; {w.sessions_per_replica} sessions and {w.rate_per_replica:g} new sessions/s "
              f"per replica, {w.system_prompts} system prompts of {w.system_len} tokens")
        print(f"{'replicas':>8} {'router':>13} {'requests':>8} {'out tok/s':>10} {'TTFT p50':>9} "
              f"{'TTFT p99':>9} {'hit rate':>8}")
        for r in rows:
            print(f"{r['replicas']:>8} {r['router']:>13} {r['requests']:>8} {r['output_tokens_per_s']:>10.0f} "
                  f"{r['ttft_p50_s']:>8.3f}s {r['ttft_p99_s']:>8.3f}s {r['prefix_hit_rate']:>8.3f}")
    if args.plot:
        plot(rows, f"kvserve bench cluster: {setup.label}", args.plot)
        if not args.json:
            print(f"plot written to {args.plot}")
    return 0


def add_parser(bench_sub) -> None:
    p = bench_sub.add_parser("cluster", help="routers over simulated replicas (planner's roofline step times)")
    p.add_argument("--replicas", type=_ints, default=[1, 2, 4, 8, 16], help="replica counts, e.g. 1,2,4,8,16")
    p.add_argument("--router", default=",".join(reversed(ROUTERS)), help=f"comma-separated: {', '.join(ROUTERS)}")
    p.add_argument("--model", default="Llama-3.1-8B", help="a model the planner knows, or a folder with config.json")
    p.add_argument("--gpu", default="H100-SXM", help="an accelerator from the planner's table")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--sessions-per-replica", type=int, default=Workload.sessions_per_replica)
    p.add_argument("--rate-per-replica", type=float, default=Workload.rate_per_replica,
                   help="new sessions per second per replica")
    p.add_argument("--system-prompts", type=int, default=Workload.system_prompts)
    p.add_argument("--system-len", type=int, default=Workload.system_len)
    p.add_argument("--think-s", type=float, default=Workload.think_s, help="mean pause between turns")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=None, help="write the three panels to this PNG")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)
