"""`kvserve bench spec`: speculative decoding against plain decoding, same process, same weights.

Workloads (chat-templated; greedy unless --temperature is given): ``grounded`` asks to repeat,
lightly edit or summarise a given passage or code block (where n-gram lookup shines); ``open`` asks
open-ended questions; ``code`` asks for code completions (for a draft model of the same family).
Each is run
at every ``--concurrency`` through a plain engine and a speculative one, and the output tokens/s,
their ratio (end to end, and over the decode phase alone: from the first token out to the last, since
prefill is the same work either way), the acceptance rate and the mean tokens per verifying step are
reported. ``--rounds``
alternates the two engines, each round on the next prompts of the workload, and sums tokens and
seconds over the rounds: one 128-token request takes well under a second, so a single pass measures
the machine's noise as much as the engines. Greedy outputs must be identical; sampled ones follow the
same distribution but not the same draws.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from kvserve.bench.report import add_report_argument
from kvserve.bench.texts import CODE_PROMPTS, GROUNDED_TASKS, OPEN_QUESTIONS, PASSAGES


def prompts_for(workload: str, tokenizer, count: int, offset: int = 0) -> list[str]:
    if workload == "grounded":
        raw = [task.format(passage=p) for p in PASSAGES for task in GROUNDED_TASKS]
    elif workload == "open":
        raw = list(OPEN_QUESTIONS)
    elif workload == "code":
        raw = list(CODE_PROMPTS)
    else:
        raise ValueError(f"--workload {workload!r} must be 'grounded', 'open' or 'code'")
    raw = [raw[(offset + i) % len(raw)] for i in range(count)]
    return [tokenizer.apply_chat_template([{"role": "user", "content": r}], tokenize=False, add_generation_prompt=True)
            for r in raw]


_COUNTERS = ("spec_proposed_tokens", "spec_accepted_tokens", "spec_verify_steps", "spec_emitted_tokens")


def measure_round(llm, prompts: list[str], max_tokens: int, sampling: dict | None) -> dict:
    """One timed pass of ``prompts``; ``sampling``: SamplingParams fields, greedy if None."""
    from kvserve import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, **(sampling or {"temperature": 0}))
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)  # warm-up
    before = [getattr(llm.engine.core.stats(), c) for c in _COUNTERS]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    counts = [getattr(llm.engine.core.stats(), c) - was for c, was in zip(_COUNTERS, before)]
    # The decode phase: from the first token out to the last one (the prompts' prefill is the same work
    # with or without speculation).
    decode_span = max(o.metrics.last_token for o in outs) - min(o.metrics.first_token for o in outs)
    return {"seconds": seconds, "decode_seconds": decode_span, "token_ids": [o.token_ids for o in outs],
            "counts": counts}


def summarize(llm, rounds: list[dict]) -> dict:
    """Output tokens/s over the rounds (and speculation's statistics)."""
    tokens = sum(len(ids) for r in rounds for ids in r["token_ids"])
    seconds = sum(r["seconds"] for r in rounds)
    decode_tokens = tokens - sum(len(r["token_ids"]) for r in rounds)  # all but each request's first
    result = {"output_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
              "decode_tokens_per_s": decode_tokens / sum(r["decode_seconds"] for r in rounds),
              "token_ids": [ids for r in rounds for ids in r["token_ids"]]}
    if llm.engine.config.speculative.method is not None:
        proposed, accepted, steps, emitted = (sum(r["counts"][i] for r in rounds) for i in range(len(_COUNTERS)))
        result.update(acceptance_rate=accepted / proposed if proposed else 0.0,
                      mean_tokens_per_step=emitted / steps if steps else 0.0, proposed=proposed)
    return result


def run(args) -> int:
    from kvserve import LLM, SamplingParams
    from kvserve.entrypoints.cli import engine_kwargs

    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    base = engine_kwargs(args)
    sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
    SamplingParams(**sampling)  # a bad value is an error before any model loads
    plain_opts = {**base, "speculative_method": None}
    spec_opts = {**base, "speculative_method": base.get("speculative_method") or "ngram"}
    plain, fast = LLM(**plain_opts), LLM(**spec_opts)
    rows = []
    for c in args.concurrency:
        plain_rounds, spec_rounds = [], []
        for i in range(args.rounds):  # alternating, so a slow spell of the machine hits both
            prompts = prompts_for(args.workload, plain.get_tokenizer(), c, offset=i * c)
            plain_rounds.append(measure_round(plain, prompts, args.max_tokens, sampling))
            spec_rounds.append(measure_round(fast, prompts, args.max_tokens, sampling))
        a, b = summarize(plain, plain_rounds), summarize(fast, spec_rounds)
        identical = a["token_ids"] == b["token_ids"] if args.temperature == 0 else None  # sampled: other draws
        rows.append({"concurrency": c, "plain_tokens_per_s": a["tokens_per_s"], "spec_tokens_per_s": b["tokens_per_s"],
                     "speedup": b["tokens_per_s"] / a["tokens_per_s"],
                     "plain_decode_tokens_per_s": a["decode_tokens_per_s"], "spec_decode_tokens_per_s": b["decode_tokens_per_s"],
                     "decode_speedup": b["decode_tokens_per_s"] / a["decode_tokens_per_s"], "identical": identical,
                     **{k: b[k] for k in ("acceptance_rate", "mean_tokens_per_step", "proposed") if k in b}})
    summary = {"workload": args.workload, "method": spec_opts["speculative_method"],
               "k": fast.engine.config.speculative.num_speculative_tokens, "rounds": args.rounds,
               "sampling": sampling, "results": rows}
    if args.report:
        print(f"report: {write_report(summary, fast.engine.config.dtype, Path(args.report))}", file=sys.stderr)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(f"workload {args.workload}, method {spec_opts['speculative_method']}, k={fast.engine.config.speculative.num_speculative_tokens}, "
          f"dtype {fast.engine.config.dtype}, temperature {args.temperature}, top_p {args.top_p}, top_k {args.top_k}")
    for r in rows:
        print(f"  concurrency {r['concurrency']:3d}: plain {r['plain_tokens_per_s']:7.1f} tok/s, spec "
              f"{r['spec_tokens_per_s']:7.1f} tok/s, x{r['speedup']:.2f} (decode phase x{r['decode_speedup']:.2f}), acceptance {r.get('acceptance_rate', 0):.2f}, "
              f"tokens/step {r.get('mean_tokens_per_step', 0):.2f}, identical "
              f"{'n/a (sampled)' if r['identical'] is None else r['identical']}")
    return 0


def write_report(summary: dict, dtype: str, out: Path) -> Path:
    from kvserve.bench.report import Page, Table, fmt, line_chart, write_page

    rows = summary["results"]
    xs = [r["concurrency"] for r in rows]
    line_chart(out / "throughput.png", "Output throughput against the concurrency", "concurrent requests", "tokens/s",
               {"plain": (xs, [r["plain_tokens_per_s"] for r in rows]),
                summary["method"]: (xs, [r["spec_tokens_per_s"] for r in rows])}, log2_x=len(xs) > 1)
    line_chart(out / "acceptance.png", "Speculation: acceptance rate and tokens per verifying step",
               "concurrent requests", "rate / tokens",
               {"acceptance rate": (xs, [r.get("acceptance_rate") for r in rows]),
                "tokens per step": (xs, [r.get("mean_tokens_per_step") for r in rows])}, log2_x=len(xs) > 1)
    table = Table(("concurrency", "plain tok/s", "spec tok/s", "speedup", "decode-phase speedup", "acceptance",
                   "tokens/step", "identical"),
                  [(r["concurrency"], fmt(r["plain_tokens_per_s"]), fmt(r["spec_tokens_per_s"]), fmt(r["speedup"], 2),
                    fmt(r["decode_speedup"], 2),
                    fmt(r.get("acceptance_rate"), 2), fmt(r.get("mean_tokens_per_step"), 2),
                    "n/a (sampled)" if r["identical"] is None else r["identical"]) for r in rows])
    s = summary["sampling"]
    described = (f"workload {summary['workload']}, method {summary['method']}, k={summary['k']}, dtype {dtype}, "
                 f"temperature {s['temperature']}, top_p {s['top_p']}, top_k {s['top_k']}")
    return write_page(Page("kvserve bench spec", described, [table],
                           [("throughput.png", "Output throughput"), ("acceptance.png", "Acceptance")], summary), out)


def add_parser(bench_sub) -> None:
    from kvserve.entrypoints.cli import add_engine_args

    p = bench_sub.add_parser("spec", help="speculative vs plain decoding on grounded / open-ended prompts")
    add_engine_args(p)
    p.add_argument("--workload", choices=["grounded", "open", "code"], default="grounded")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5,
                   help="alternating plain / speculative rounds, each on the next prompts (default 5)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling")
    p.add_argument("--top-k", type=int, default=0, help="top-k sampling (0: off)")
    p.add_argument("--json", action="store_true")
    add_report_argument(p, "plain and speculative tokens/s, acceptance, against the concurrency")
    p.set_defaults(func=run)
