"""`kvserve bench offline`: one seeded workload through kvserve and, in the same process on the same
weights and dtype, through transformers (a) one request at a time and (b) one static padded batch.

Throughput counts only the tokens each request asked for (EOS ignored), so padding work done by
a static batch is not counted as output.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvserve.bench.report import add_report_argument
from kvserve.bench.workloads import BenchRequest, random_requests


@dataclass
class Result:
    name: str
    requests: int
    output_tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def run_kvserve(llm, reqs: list[BenchRequest]) -> Result:
    from kvserve import SamplingParams

    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True) for r in reqs]
    llm.generate([reqs[0].prompt_token_ids], params[0], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate([r.prompt_token_ids for r in reqs], params)
    seconds = time.perf_counter() - start
    return Result("kvserve", len(reqs), sum(len(o.token_ids) for o in outs), seconds)


def _hf_generate(model, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int) -> torch.Tensor:
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                          do_sample=False, pad_token_id=0)


@torch.inference_mode()
def run_hf_sequential(model, reqs: list[BenchRequest]) -> Result:
    one = torch.tensor([reqs[0].prompt_token_ids])
    _hf_generate(model, one, torch.ones_like(one), 2)  # warm-up
    start = time.perf_counter()
    tokens = 0
    for r in reqs:
        ids = torch.tensor([r.prompt_token_ids])
        out = _hf_generate(model, ids, torch.ones_like(ids), r.max_tokens)
        tokens += out.shape[1] - ids.shape[1]
    return Result("transformers (a) one at a time", len(reqs), tokens, time.perf_counter() - start)


@torch.inference_mode()
def run_hf_static_batch(model, reqs: list[BenchRequest]) -> Result:
    """All requests left-padded into one batch, generating the longest requested output for all."""
    width = max(len(r.prompt_token_ids) for r in reqs)
    ids = torch.zeros(len(reqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(reqs):
        ids[i, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
        mask[i, width - len(r.prompt_token_ids):] = 1
    start = time.perf_counter()
    _hf_generate(model, ids, mask, max(r.max_tokens for r in reqs))
    useful = sum(r.max_tokens for r in reqs)
    return Result("transformers (b) static batch", len(reqs), useful, time.perf_counter() - start)


def load_hf_model(path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    if path.is_file():  # GGUF: transformers dequantizes it to the same float weights kvserve uses
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()


def run(args) -> int:
    from kvserve import LLM
    from kvserve.entrypoints.cli import engine_kwargs

    llm = LLM(**engine_kwargs(args))
    vocab = llm.engine.core.model_config.vocab_size
    reqs = random_requests(args.num_requests, (args.prompt_min, args.prompt_max), (args.output_min, args.output_max),
                           vocab, seed=args.workload_seed)
    results = [run_kvserve(llm, reqs)]
    if not args.skip_hf:
        model = load_hf_model(llm.engine.core.model_path, llm.engine.config.torch_dtype)
        results.append(run_hf_sequential(model, reqs[:args.hf_sequential_requests]))
        results.append(run_hf_static_batch(model, reqs))
    report(results, args, llm.engine.config.dtype)
    return 0


def _rows(results: list[Result]) -> list[dict]:
    base = results[0].tokens_per_s
    return [{**asdict(r), "tokens_per_s": r.tokens_per_s, "kvserve_speedup": base / r.tokens_per_s} for r in results]


def write_report(results: list[Result], args, dtype: str) -> Path:
    from kvserve.bench.report import Page, Table, bar_chart, fmt, write_page

    rows, out = _rows(results), Path(args.report)
    bar_chart(out / "throughput.png", "Offline output throughput (EOS ignored)", "tokens/s",
              [r["name"] for r in rows], {"tokens/s": [r["tokens_per_s"] for r in rows]})
    table = Table(("engine", "requests", "output tokens", "seconds", "tokens/s", "kvserve x"),
                  [(r["name"], r["requests"], r["output_tokens"], fmt(r["seconds"], 2), fmt(r["tokens_per_s"]),
                    fmt(r["kvserve_speedup"], 2)) for r in rows])
    described = (f"{args.num_requests} requests, prompts {args.prompt_min}-{args.prompt_max} tokens, outputs "
                 f"{args.output_min}-{args.output_max} tokens, seed {args.workload_seed}, dtype {dtype}")
    return write_page(Page("kvserve bench offline", described, [table], [("throughput.png", "Output throughput")],
                           {"dtype": dtype, "num_requests": args.num_requests, "results": rows}), out)


def report(results: list[Result], args, dtype: str) -> None:
    rows = _rows(results)
    if args.report:
        print(f"report: {write_report(results, args, dtype)}", file=sys.stderr)
    if args.json:
        print(json.dumps({"dtype": dtype, "num_requests": args.num_requests, "results": rows}, indent=2))
        return
    print(f"{'engine':34} {'requests':>8} {'out tokens':>10} {'seconds':>8} {'tok/s':>8} {'kvserve x':>9}")
    for r in rows:
        print(f"{r['name']:34} {r['requests']:8d} {r['output_tokens']:10d} {r['seconds']:8.2f} "
              f"{r['tokens_per_s']:8.1f} {r['kvserve_speedup']:9.2f}")


def add_parser(bench_sub) -> None:
    from kvserve.entrypoints.cli import add_engine_args

    p = bench_sub.add_parser("offline", help="offline throughput: kvserve vs transformers on the same weights")
    add_engine_args(p)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-min", type=int, default=32)
    p.add_argument("--prompt-max", type=int, default=512)
    p.add_argument("--output-min", type=int, default=16)
    p.add_argument("--output-max", type=int, default=256)
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument("--hf-sequential-requests", type=int, default=8,
                   help="transformers (a) runs this many of the requests one at a time (it is slow)")
    p.add_argument("--skip-hf", action="store_true", help="measure kvserve only")
    p.add_argument("--json", action="store_true")
    add_report_argument(p, "output tokens/s of each engine")
    p.set_defaults(func=run)
