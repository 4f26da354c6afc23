"""`kvserve eval perplexity --model M --file TEXT`: quality measured, not assumed."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _perplexity(args: argparse.Namespace) -> int:
    from kvserve import LLM
    from kvserve.entrypoints.cli import engine_kwargs
    from kvserve.eval.perplexity import perplexity

    text = Path(args.file).read_text(encoding="utf-8")
    llm = LLM(**engine_kwargs(args))
    ids = llm.get_tokenizer().encode(text, add_special_tokens=False)
    if args.max_tokens:
        ids = ids[:args.max_tokens]
    result = perplexity(llm, ids, args.window, args.stride)
    memory = llm.engine.core.memory
    row = {"file": args.file, "dtype": llm.engine.config.dtype, "quantization": memory.quantization,
           "kv_cache_dtype": memory.kv_cache_dtype, "weight_bytes": memory.weight_bytes,
           "window": args.window, "stride": args.stride, "tokens_scored": result.tokens_scored,
           "perplexity": result.perplexity, "tokens_per_s": result.tokens_per_s}
    if args.json:
        print(json.dumps(row))
    else:
        print(f"perplexity {result.perplexity:.4f} over {result.tokens_scored} tokens "
              f"(window {args.window}, stride {args.stride}); {result.tokens_per_s:.0f} tokens/s "
              f"({result.tokens_processed} forward tokens in {result.seconds:.1f} s); weights {memory.quantization}, "
              f"KV cache {memory.kv_cache_dtype}")
    return 0


def add_parser(sub) -> None:
    from kvserve.entrypoints.cli import add_engine_args

    p = sub.add_parser("eval", help="quality evaluations: perplexity")
    eval_sub = p.add_subparsers(dest="eval_command", required=True)
    ppl = eval_sub.add_parser("perplexity", help="sliding-window perplexity of a text file")
    add_engine_args(ppl)
    ppl.add_argument("--file", required=True, help="UTF-8 text file (e.g. tests/data/alice29.txt)")
    ppl.add_argument("--window", type=int, default=1024, help="tokens per window")
    ppl.add_argument("--stride", type=int, default=512, help="tokens between window starts")
    ppl.add_argument("--max-tokens", type=int, default=None, help="score only the first N tokens of the text")
    ppl.add_argument("--json", action="store_true")
    ppl.set_defaults(func=_perplexity)
