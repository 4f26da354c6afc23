"""Quantization figures on the bundled default model (SmolLM2-135M, Q4_1 GGUF): quality, memory, speed.

    .venv/bin/python benchmarks/quantization.py [--sections ppl,memory,parity,speed] [--json out.json]

ppl     perplexity on tests/data/alice29.txt (first --ppl-tokens tokens, sliding window) for the
        dequantized bf16 model, int8, int4 (g32, g128), the native GGUF Q4_1 form, and int8 / fp8
        KV caches; through the engine (kvserve.eval.perplexity), so the kernels are measured.
memory  weight bytes of each form, and KV bytes per token / capacity at one fixed KV budget.
parity  greedy output of int8 (and native, int4, KV int8/fp8) against the dequantized model, in
        --parity-dtype (float32 by default, so bf16 rounding noise does not mask the quantization
        itself): share of prompts whose tokens are identical, the mean first divergence, and the
        teacher-forced top-1 agreement (the quantized model scores the reference's own output: how
        often its best next token is the reference's token, so one early flip is counted once).
speed   decode tokens/s (first token to last; and, for reference, generate tokens/s with the prefill),
        one request and --concurrency requests, for bf16 / native 4-bit / int8, measured
        round-robin in one process (--repeats rounds, median), so load from other processes hits
        every configuration alike.
Other sections use dtype bfloat16 (the AMX compute dtype).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "alice29.txt"
FORMS = {  # name -> engine options
    "bf16 (dequantized)": {"quantization": "none"},
    "int8": {"quantization": "int8"},
    "int8 per channel": {"quantization": "int8", "quantization_group_size": -1},
    "int4 g32": {"quantization": "int4", "quantization_group_size": 32},
    "int4 g128": {"quantization": "int4", "quantization_group_size": 128},
    "native Q4_1": {},
    "bf16 + kv int8": {"quantization": "none", "kv_cache_dtype": "int8"},
    "bf16 + kv fp8": {"quantization": "none", "kv_cache_dtype": "fp8"},
}
SPEED_FORMS = ("bf16 (dequantized)", "native Q4_1", "int8")
PARITY_PROMPTS = [
    "The capital of France is", "Write a short poem about the sea.", "def fibonacci(n):",
    "Explain why the sky is blue.", "1, 2, 3, 4,", "Translate to French: I would like a cup of coffee.",
    "The three primary colors are", "Once upon a time, in a small village,", "import numpy as np\n",
    "The largest planet in the solar system is", "Here is a recipe for pancakes:", "Q: What is 12 * 7?\nA:",
    "The French Revolution began in", "List three benefits of exercise:", "SELECT name FROM users WHERE",
    "My favourite book is", "Water boils at", "The quick brown fox", "In machine learning, overfitting means",
    "Dear Sir or Madam,",
]


def make_llm(options: dict, kv_budget: int = 256 * 2**20, dtype: str = "bfloat16"):
    from kvserve import LLM

    return LLM(dtype=dtype, kv_cache_memory_bytes=kv_budget, **options)


def run_ppl(args) -> dict:
    from kvserve.eval.perplexity import perplexity

    out = {}
    for name, options in FORMS.items():
        llm = make_llm(options)
        ids = llm.get_tokenizer().encode(TEXT.read_text(), add_special_tokens=False)[:args.ppl_tokens]
        r = perplexity(llm, ids, args.window, args.stride)
        out[name] = {"perplexity": r.perplexity, "tokens_scored": r.tokens_scored, "tokens_per_s": r.tokens_per_s,
                     "weight_bytes": llm.engine.core.memory.weight_bytes}
        print(f"ppl  {name:22} {r.perplexity:8.4f}  ({r.tokens_scored} tokens, {r.tokens_per_s:.0f} tok/s)", flush=True)
        del llm
        gc.collect()
    base = out["bf16 (dequantized)"]["perplexity"]
    for row in out.values():
        row["vs_bf16"] = row["perplexity"] / base - 1
    return out


def run_memory(args) -> dict:
    out = {"weights": {}, "kv": {}}
    for name in ("bf16 (dequantized)", "int8", "int8 per channel", "int4 g32", "int4 g128", "native Q4_1"):
        llm = make_llm(FORMS[name], kv_budget=args.kv_budget)
        out["weights"][name] = llm.engine.core.memory.weight_bytes
        if name == "bf16 (dequantized)":
            base = out["weights"][name]
        print(f"mem  {name:22} {out['weights'][name] / 2**20:8.1f} MiB  ({out['weights'][name] / base:.3f}x bf16)  "
              f"{llm.engine.core.memory.quantization}", flush=True)
        del llm
        gc.collect()
    for kv in ("auto", "int8", "fp8"):
        llm = make_llm({"quantization": "none", "kv_cache_dtype": kv}, kv_budget=args.kv_budget)
        m = llm.engine.core.memory
        out["kv"][kv] = {"bytes_per_token": m.kv_bytes_per_token, "capacity_tokens": m.kv_capacity_tokens}
        print(f"kv   {kv:5} {m.kv_bytes_per_token:6d} B/token, {m.kv_capacity_tokens} tokens in "
              f"{args.kv_budget / 2**20:.0f} MiB ({m.kv_capacity_tokens / out['kv']['auto']['capacity_tokens']:.3f}x)",
              flush=True)
        del llm
        gc.collect()
    return out


def run_parity(args) -> dict:
    from kvserve import SamplingParams

    params = SamplingParams(max_tokens=args.parity_tokens, temperature=0, ignore_eos=True)
    base_llm = make_llm(FORMS["bf16 (dequantized)"], dtype=args.parity_dtype)
    tok = base_llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
               if i % 2 else p for i, p in enumerate(PARITY_PROMPTS)]
    outs = base_llm.generate(prompts, params, use_tqdm=False)
    base = [o.token_ids for o in outs]
    forced = [o.prompt_token_ids + o.token_ids for o in outs]
    del base_llm
    out = {}
    for name in ("int8", "int8 per channel", "native Q4_1", "int4 g32", "bf16 + kv int8", "bf16 + kv fp8"):
        llm = make_llm(FORMS[name], dtype=args.parity_dtype)
        got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        same = sum(a == b for a, b in zip(got, base))
        first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(got, base)]
        agree = _forced_agreement(llm, forced, args.parity_tokens)
        out[name] = {"identical": same, "prompts": len(prompts), "mean_first_divergence": statistics.mean(first),
                     "forced_top1_agreement": agree}
        print(f"parity {name:20} {same}/{len(prompts)} prompts identical over {args.parity_tokens} tokens "
              f"({args.parity_dtype}); first divergence at token {statistics.mean(first):.1f} on average; "
              f"teacher-forced top-1 agreement {agree:.3f}", flush=True)
        del llm
        gc.collect()
    return out


def _forced_agreement(llm, sequences: list[list[int]], num_scored: int) -> float:
    """Share of the last ``num_scored`` positions of each sequence where ``llm``'s top-1 is the token there."""
    from kvserve import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    hits = total = 0
    for seq, out in zip(sequences, llm.generate(sequences, params, use_tqdm=False)):
        for token, lp in zip(seq[-num_scored:], out.prompt_logprobs[-num_scored:]):
            hits += lp.top[0][0] == token
            total += 1
    return hits / total


def _rates(llm, num: int, new_tokens: int) -> tuple[float, float]:
    """(decode tokens/s, generate tokens/s) of ``num`` requests at once. Decode: the tokens after each
    request's first, over the time from the first token to the last (the issue's measure); generate:
    every output token over the whole call, the prefill included."""
    from kvserve import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    prompts = [[100 + (7 * i + j) % 5000 for j in range(16)] for i in range(num)]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    first = min(o.metrics.first_token for o in outs)
    last = max(o.metrics.last_token for o in outs)
    decode = sum(len(o.token_ids) - 1 for o in outs) / (last - first)
    return decode, sum(len(o.token_ids) for o in outs) / wall


def run_speed(args) -> dict:
    """Rounds of (one run per form) for each batch size; ratios are taken within a round, so load
    from other processes that drifts over minutes cancels out, and the median round is reported."""
    llms = {name: make_llm(FORMS[name]) for name in SPEED_FORMS}
    sizes = (1, args.concurrency)
    kinds = ("decode", "generate")
    rates = {kind: {name: {n: [] for n in sizes} for name in llms} for kind in kinds}
    for llm in llms.values():
        _rates(llm, 2, 4)  # warm-up
    for _ in range(args.repeats):
        for n in sizes:
            for name, llm in llms.items():
                decode, generate = _rates(llm, n, args.decode_tokens if n == 1 else args.decode_tokens // 2)
                rates["decode"][name][n].append(decode)
                rates["generate"][name][n].append(generate)
    out = {}
    base = SPEED_FORMS[0]
    for name in llms:
        out[name] = {}
        for n in sizes:
            out[name][n] = {}
            for kind in kinds:
                runs = rates[kind][name][n]
                ratios = [r / b for r, b in zip(runs, rates[kind][base][n])]
                med, ratio = statistics.median(runs), statistics.median(ratios)
                out[name][n][kind] = {"tokens_per_s": med, "vs_bf16": ratio, "runs": runs, "round_ratios": ratios}
                print(f"speed {kind:8} {name:20} concurrency {n:3d}: {med:7.1f} tok/s, {ratio:.2f}x bf16 "
                      f"(median of rounds {[round(r, 2) for r in ratios]})", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default="memory,ppl,parity,speed")
    p.add_argument("--ppl-tokens", type=int, default=8192)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--stride", type=int, default=512)
    p.add_argument("--kv-budget", type=int, default=256 * 2**20)
    p.add_argument("--parity-tokens", type=int, default=32)
    p.add_argument("--parity-dtype", default="float32")
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None, help="also write the figures to this file")
    args = p.parse_args()
    sections = {"memory": run_memory, "ppl": run_ppl, "parity": run_parity, "speed": run_speed}
    results = {}
    for name in args.sections.split(","):
        results[name] = sections[name](args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
