"""A decode step of a random mixture-of-experts model against a dense one with the same active
parameters, A/B in one process.

MoE: Mixtral's layout, 8 experts of intermediate size I, top 2. Dense: Llama, same attention and
vocabulary, one MLP of intermediate 2 I (the two experts a token runs). A step's time is taken as
the difference between generating ``--long`` and ``--short`` tokens for ``--batch`` requests with
the same prompts (the prefill cancels), over rounds that alternate the models; the ratio of the
medians is printed. One step of the MoE model is also hooked to count each expert's calls per
layer: every active expert runs once however many tokens chose it.

    python benchmarks/moe_decode.py --dtype bfloat16 --batch 32
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--expert-inter", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--short", type=int, default=4)
    parser.add_argument("--long", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    import kvserve  # noqa: F401  (first: it sets the OpenMP wait policy before torch loads)

    with tempfile.TemporaryDirectory(prefix="moe-bench-") as tmp:
        run_ab(args, Path(tmp))


def run_ab(args: argparse.Namespace, tmp: Path) -> None:
    import torch

    from kvserve import LLM, SamplingParams
    from kvserve.bench.random_model import write_random_model

    shape = dict(vocab_size=4096, hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=16,
                 num_key_value_heads=4, head_dim=args.hidden // 16, max_position_embeddings=1024,
                 initializer_range=0.02, tie_word_embeddings=False)
    dtype = getattr(torch, args.dtype)
    moe_path = write_random_model(tmp / "moe", "MixtralForCausalLM", dtype=dtype, intermediate_size=args.expert_inter,
                                  num_local_experts=8, num_experts_per_tok=2, **shape)
    dense_path = write_random_model(tmp / "dense", "LlamaForCausalLM", dtype=dtype,
                                    intermediate_size=2 * args.expert_inter, **shape)
    options = dict(dtype=args.dtype, num_kv_blocks=64 * args.batch, block_size=16, max_num_seqs=args.batch,
                   enable_prefix_caching=False)
    llms = {"moe": LLM(model=str(moe_path), **options), "dense": LLM(model=str(dense_path), **options)}
    for name, llm in llms.items():
        params = sum(p.numel() for p in llm.engine.core.runner.model.parameters()) + sum(
            b.numel() for b in llm.engine.core.runner.model.buffers())
        print(f"{name}: {params / 1e6:.1f}M stored parameters, fused decoder: "
              f"{llm.engine.core.runner.fused_decoder is not None}")
    prompts = [[3 + (i * 7 + j) % 4000 for j in range(8)] for i in range(args.batch)]

    def run(llm, tokens: int) -> float:
        start = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True),
                            use_tqdm=False)
        assert all(len(o.token_ids) == tokens for o in outs)
        return time.perf_counter() - start

    for llm in llms.values():
        run(llm, args.short)  # warm up
    steps = {name: [] for name in llms}
    for _ in range(args.rounds):
        for name, llm in llms.items():
            steps[name].append((run(llm, args.long) - run(llm, args.short)) / (args.long - args.short))
    for name, values in steps.items():
        print(f"{name}: decode step at batch {args.batch}: median {statistics.median(values) * 1e3:.1f} ms "
              f"(range {min(values) * 1e3:.1f}-{max(values) * 1e3:.1f})")
    ratio = statistics.median(steps["moe"]) / statistics.median(steps["dense"])
    fastest = min(steps["moe"]) / min(steps["dense"])  # the least disturbed rounds, on a shared machine
    print(f"MoE / dense step time: {ratio:.2f}x of the medians, {fastest:.2f}x of the fastest rounds")

    # Every MoE block call (one per layer and step) with its experts hooked: calls per expert.
    model = llms["moe"].engine.core.runner.model
    per_call: list[tuple[int, list[int]]] = []  # (tokens, calls per expert)
    hooks = []
    for layer in model.model.layers:
        block = layer.mlp
        hooks.append(block.register_forward_pre_hook(lambda m, inputs: per_call.append((inputs[0].shape[0], [0] * 8))))
        for e, expert in enumerate(block.experts):
            def count(module, inputs, e=e):
                per_call[-1][1][e] += 1
            hooks.append(expert.register_forward_pre_hook(count))
    llms["moe"].generate(prompts, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)
    for h in hooks:
        h.remove()
    for tokens, counts in per_call:
        print(f"MoE block over {tokens} tokens: expert matmul calls {counts}")
    assert all(c <= 1 for _, counts in per_call for c in counts), "an expert ran more than once in a step"
    print(f"every active expert ran once per block call ({len(per_call)} calls)")

if __name__ == "__main__":
    main()
