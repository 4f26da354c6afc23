"""The `kvserve` command: generate, serve, bench, plan. Each subcommand registers itself here."""

from __future__ import annotations

import argparse
import sys

from kvserve.config import CUDA_TOKEN_BUDGET, SCHEDULING_POLICIES, SchedulerConfig


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine options shared by every command that loads a model (mirrors `LLM(...)`)."""
    p.add_argument("--model", default=None, help="HF model folder or .gguf file (default: bundled SmolLM2-135M)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto (default): bfloat16 for a 16-bit or GGUF checkpoint where the device computes it "
                        "natively, else float32")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--kv-cache-memory", type=float, default=1.0, help="KV-cache budget in GiB")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help=f"tokens per step (default {SchedulerConfig.max_num_batched_tokens} on the CPU, "
                        f"{CUDA_TOKEN_BUDGET} on CUDA)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--scheduling-policy", choices=list(SCHEDULING_POLICIES), default="shortest-first",
                   help="admission order within a priority: fewest tokens to compute first (shortest-first, the "
                        "default: lower time to first token under bursts, bounded wait for long prompts), or "
                        "arrival order (fcfs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--attention-backend", choices=["auto", "torch", "triton"], default="auto",
                   help="auto = C++ kernels on the CPU, Triton on CUDA; torch = the PyTorch reference path")
    p.add_argument("--enforce-eager", action="store_true", help="CUDA: no CUDA graphs for decode steps")
    p.add_argument("--no-prefix-caching", action="store_true", help="turn off automatic prefix caching")
    p.add_argument("--speculative-method", choices=["ngram", "draft"], default=None)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--speculative-model", default=None, help="draft model (same tokenizer) for --speculative-method draft")
    p.add_argument("--speculative-ngram-min", type=int, default=1)
    p.add_argument("--speculative-ngram-max", type=int, default=4)
    p.add_argument("--speculative-max-batch-size", type=int, default=8,
                   help="speculate only while at most this many requests are decoding")
    p.add_argument("--quantization", choices=["none", "int8", "int4"], default=None,
                   help="weights: unset keeps a GGUF file's own 4/8-bit blocks; none = dense dtype; int8/int4 at load")
    p.add_argument("--quantization-group-size", type=int, default=None, choices=[-1, 32, 64, 128],
                   help="inputs per scale for int8/int4 (default 32); -1 = one scale per output channel (int8)")
    p.add_argument("--kv-cache-dtype", choices=["auto", "int8", "fp8"], default="auto",
                   help="KV cache values: auto = model dtype; int8 / fp8 (e4m3) with a scale per token and head")
    p.add_argument("--num-threads", type=int, default=None,
                   help="torch threads (default: $KVSERVE_NUM_THREADS, else available cores - 1; see worker/threads.py)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(model=args.model, dtype=args.dtype, block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                kv_cache_memory_bytes=int(args.kv_cache_memory * 1024**3), max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                scheduling_policy=args.scheduling_policy, seed=args.seed, device=args.device,
                attention_backend=args.attention_backend, enforce_eager=args.enforce_eager,
                enable_prefix_caching=not args.no_prefix_caching,
                speculative_method=args.speculative_method, num_speculative_tokens=args.num_speculative_tokens,
                speculative_model=args.speculative_model, speculative_ngram_min=args.speculative_ngram_min,
                speculative_ngram_max=args.speculative_ngram_max,
                speculative_max_batch_size=args.speculative_max_batch_size, quantization=args.quantization,
                quantization_group_size=args.quantization_group_size, kv_cache_dtype=args.kv_cache_dtype)


def _generate(args: argparse.Namespace) -> int:
    from kvserve import LLM, SamplingParams

    llm = LLM(**engine_kwargs(args))
    prompt = args.prompt
    if args.chat:
        prompt = llm.get_tokenizer().apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.sampling_seed, ignore_eos=args.ignore_eos)
    out = llm.generate([prompt], params)[0]
    print(out.text)
    print(f"[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}, ttft={out.ttft * 1000:.0f} ms, "
          f"total={out.e2e_latency:.2f} s]", file=sys.stderr)
    return 0


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt (offline)")
    p.add_argument("prompt")
    add_engine_args(p)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sampling-seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="wrap the prompt in the model's chat template (default on)")
    p.set_defaults(func=_generate)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description="LLM inference serving engine")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    for module in ("kvserve.entrypoints.serve_cli", "kvserve.bench.cli", "kvserve.planner.cli",
                   "kvserve.eval.cli"):
        try:
            mod = __import__(module, fromlist=["add_parser"])
        except ImportError:
            continue
        mod.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "num_threads", None) is not None:
            from kvserve.worker.threads import configure_threads

            configure_threads(args.num_threads)
        return args.func(args)
    except ValueError as e:
        print(f"kvserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
