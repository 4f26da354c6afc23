"""A decode step of a random mixture-of-experts model against a dense one with the same active
parameters, and the MoE model's two expert paths on the CPU, A/B in one process.

MoE: Mixtral's layout, 8 experts of intermediate size I, top 2. Dense: Llama, same attention and
vocabulary, one MLP of intermediate 2 I (the two experts a token runs). Both models serve their
decode steps in the fused C++ step ("dense", "moe_cpp": the MoE layers' router, top k and experts'
C++ call inside it, models/llama_decode.py). For comparison both also run eagerly, one call per op
("dense_eager", "moe_cpp_eager"), and the MoE model with one torch call per active expert
("moe_torch", KVSERVE_MOE_CPU_KERNEL=0); all on the same loaded models, switched per round. A
step's time is the difference between generating ``--long`` and ``--short`` tokens for ``--batch``
requests with the same prompts (the prefill cancels), over rounds that alternate the variants; the
ratios of the medians are printed, with the least the MoE step could cost on this machine as it is
(``memory_bound``). Then each MoE block call of a few eager steps is checked to read every active
expert's weights exactly once and no idle expert's (``SparseMoeBlock.bytes_read``).

    python benchmarks/moe_decode.py --dtype bfloat16 --batch 32 --num-threads 2 [--quantization int4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", default=None, help="the models' weights (LLM's quantization option)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--expert-inter", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--short", type=int, default=4)
    parser.add_argument("--long", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--num-threads", type=int, default=None,
                        help="a fixed thread count (default: the engine's, which drops one while others keep a core busy)")
    parser.add_argument("--experts", default="cpp,torch", help="the MoE expert paths to time: cpp, torch or both")
    parser.add_argument("--json", type=Path, default=None, help="write the figures to this file")
    args = parser.parse_args()

    import kvserve  # noqa: F401  (first: it sets the OpenMP wait policy before torch loads)

    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="moe-bench-") as tmp:
        result = run_ab(args, Path(tmp))
    # other processes on the machine: a shared one moves the medians; the fastest rounds less so
    result["load_average"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


def build(args: argparse.Namespace, tmp: Path) -> dict:
    import torch

    from kvserve import LLM
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
                   enable_prefix_caching=False, quantization=args.quantization, num_threads=args.num_threads)
    return {"moe": LLM(model=str(moe_path), **options), "dense": LLM(model=str(dense_path), **options)}


def moe_blocks(llm) -> list:
    return [layer.mlp for layer in llm.engine.core.runner.model.model.layers]


def run_ab(args: argparse.Namespace, tmp: Path) -> dict:
    from kvserve import SamplingParams

    llms = build(args, tmp)
    for name, llm in llms.items():
        model = llm.engine.core.runner.model
        params = sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers())
        print(f"{name}: {params / 1e6:.1f}M stored parameters, fused decoder: "
              f"{llm.engine.core.runner.fused_decoder is not None}")
    paths = [p for p in args.experts.split(",") if p]
    # name: (model, C++ experts or not, the fused decode step or not). "moe_cpp" is the MoE model as
    # it serves: its decode steps in the fused C++ step, experts in their C++ call (MoeSpec);
    # "moe_cpp_eager" and "moe_torch" run its layers eagerly, one call per op, the experts in one C++
    # call or one torch call each; "dense_eager" runs the dense model eagerly too.
    fused = {name: llm.engine.core.runner.fused_decoder for name, llm in llms.items()}
    variants = {"dense": ("dense", None, True), "dense_eager": ("dense", None, False)}
    if "cpp" in paths:
        variants.update(moe_cpp=("moe", True, True), moe_cpp_eager=("moe", True, False))
    if "torch" in paths:
        variants["moe_torch"] = ("moe", False, False)
    prompts = [[3 + (i * 7 + j) % 4000 for j in range(8)] for i in range(args.batch)]

    def run(variant: str, tokens: int) -> float:
        name, cpp, use_fused = variants[variant]
        llm = llms[name]
        if cpp is not None:
            for block in moe_blocks(llm):
                block.use_cpu_kernel = cpp
        llm.engine.core.runner.fused_decoder = fused[name] if use_fused else None
        start = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True),
                            use_tqdm=False)
        assert all(len(o.token_ids) == tokens for o in outs)
        return time.perf_counter() - start

    for variant in variants:
        run(variant, args.short)  # warm up
    steps = {variant: [] for variant in variants}
    machine = {"dense_mlp": [], "expert_read": []}
    for _ in range(args.rounds):
        for variant in variants:
            steps[variant].append((run(variant, args.long) - run(variant, args.short)) / (args.long - args.short))
        for name, seconds in time_parts(llms, args.batch).items():
            machine[name].append(seconds)
    for variant, values in steps.items():
        print(f"{variant}: decode step at batch {args.batch}: median {statistics.median(values) * 1e3:.2f} ms "
              f"(range {min(values) * 1e3:.2f}-{max(values) * 1e3:.2f})")
    pairs = [(v, base) for v in variants if v.startswith("moe") for base in ("dense", "dense_eager")]
    if "moe_cpp_eager" in steps and "moe_torch" in steps:
        pairs.append(("moe_cpp_eager", "moe_torch"))
    # and of the fastest rounds: the least disturbed ones, on a shared machine
    ratios = {f"{a}/{b}": statistics.median(steps[a]) / statistics.median(steps[b]) for a, b in pairs}
    fastest = {f"{a}/{b}": min(steps[a]) / min(steps[b]) for a, b in pairs}
    for name, ratio in ratios.items():
        print(f"{name} step time: {ratio:.2f}x of the medians, {fastest[name]:.2f}x of the fastest rounds")
    bound = memory_bound(llms, steps, machine)
    llms["moe"].engine.core.runner.fused_decoder = None  # every block call through SparseMoeBlock, counted
    reads = {p: check_reads(llms["moe"], prompts, p == "cpp") for p in paths}
    return {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "bound": bound,
            "step_ms": {v: [round(s * 1e3, 3) for s in values] for v, values in steps.items()},
            "median_ms": {v: round(statistics.median(values) * 1e3, 3) for v, values in steps.items()},
            "ratios": {k: round(v, 3) for k, v in ratios.items()},
            "ratios_fastest": {k: round(v, 3) for k, v in fastest.items()}, "weight_reads": reads}


def expert_bytes(llm) -> int:
    from kvserve.model.layers.moe_kernel import weight_bytes

    return sum(weight_bytes(e.gate_up_proj) + weight_bytes(e.down_proj) for b in moe_blocks(llm) for e in b.experts)


def time_parts(llms: dict, batch: int) -> dict:
    """Seconds for the dense model's MLP layers on ``batch`` rows (what its step spends there), and for
    one row through every expert of the MoE model: W streamed once by the kernels' fastest reader (one
    row of x, all strips side by side), the fastest this machine reads the experts right now."""
    import torch

    dense_mlps = [layer.mlp for layer in llms["dense"].engine.core.runner.model.model.layers]
    experts = [e for b in moe_blocks(llms["moe"]) for e in b.experts]
    up, down = experts[0].gate_up_proj, experts[0].down_proj
    x = torch.randn(batch, up.in_features, dtype=up.dtype)
    one, inner = x[:1].contiguous(), torch.randn(1, down.in_features, dtype=down.dtype)

    def timed(fn) -> float:  # the fastest of three (after a first pass that may fault pages in)
        fn()
        seconds = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            seconds.append(time.perf_counter() - start)
        return min(seconds)

    with torch.inference_mode():
        return {"dense_mlp": timed(lambda: [mlp(x) for mlp in dense_mlps]),
                "expert_read": timed(lambda: [(e.gate_up_proj(one), e.down_proj(inner)) for e in experts])}


def memory_bound(llms: dict, steps: dict, machine: dict) -> dict:
    """The least a MoE step can cost against the dense one on this machine: the dense step's work
    outside its MLPs (attention, norms, head, host: the same in both models) plus every expert's W
    read once at the rate one row reads them, the kernels' fastest. At batch 32 all experts are
    active, so the MoE/dense ratio stays above this unless the experts are read faster than that."""
    dense = statistics.median(steps["dense"])
    rest = dense - statistics.median(machine["dense_mlp"])
    nbytes = expert_bytes(llms["moe"])
    read_rate = nbytes / statistics.median(machine["expert_read"])
    least = rest + nbytes / read_rate
    out = {"expert_bytes": nbytes, "read_gb_s": round(read_rate / 1e9, 2),
           "dense_mlp_ms": round(statistics.median(machine["dense_mlp"]) * 1e3, 3),
           "dense_rest_ms": round(rest * 1e3, 3), "least_moe_step_ms": round(least * 1e3, 3),
           "least_ratio": round(least / dense, 3)}
    print(f"bound: the experts hold {nbytes / 1e6:.0f} MB, read by one row at {read_rate / 1e9:.1f} GB/s; the dense "
          f"step spends {out['dense_mlp_ms']:.2f} ms in its MLPs and {out['dense_rest_ms']:.2f} ms elsewhere, so a "
          f"MoE step takes at least {least * 1e3:.2f} ms: {out['least_ratio']:.2f}x the dense step")
    if "moe_cpp" in steps:
        moe_experts = statistics.median(steps["moe_cpp"]) - rest
        out["moe_expert_gb_s"] = round(nbytes / moe_experts / 1e9, 2)
        print(f"bound: the MoE step reads its experts at {out['moe_expert_gb_s']:.1f} GB/s "
              f"({100 * out['moe_expert_gb_s'] / out['read_gb_s']:.0f}% of the one-row read)")
    return out


def check_reads(llm, prompts: list[list[int]], cpp: bool) -> dict:
    """Every MoE block call of a few steps: how many times each expert's W was read (bytes read over
    its size), which must be exactly once for the active experts and zero for the others."""
    import torch

    from kvserve import SamplingParams
    from kvserve.model.layers.moe_kernel import weight_bytes

    calls: list[tuple[int, list[float]]] = []  # (tokens, reads per expert)
    hooks = []
    for block in moe_blocks(llm):
        block.use_cpu_kernel = cpp
        block.bytes_read = torch.zeros(len(block.experts), 2, dtype=torch.long)
        sizes = torch.tensor([[weight_bytes(e.gate_up_proj), weight_bytes(e.down_proj)] for e in block.experts])

        def record(module, inputs, output, sizes=sizes):
            calls.append((inputs[0].shape[0], (module.bytes_read / sizes).flatten().tolist()))
            module.bytes_read.zero_()
        hooks.append(block.register_forward_hook(record))
    llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)
    for h in hooks:
        h.remove()
    for block in moe_blocks(llm):
        block.bytes_read = None
    path = "C++ call" if cpp else "torch calls"
    active = [sum(r > 0 for r in reads) // 2 for _, reads in calls]
    print(f"{path}: {len(calls)} MoE block calls over {sorted({t for t, _ in calls})} tokens, "
          f"{min(active)}-{max(active)} active experts each")
    assert all(r in (0.0, 1.0) for _, reads in calls for r in reads), "an expert's weights were read more or less than once"
    assert all(reads[2 * e] == reads[2 * e + 1] for _, reads in calls for e in range(len(reads) // 2))
    print(f"{path}: every active expert's gate_up and down read exactly once per block call, idle ones not at all")
    return {"block_calls": len(calls), "active_experts": [min(active), max(active)], "each_read_once": True}


if __name__ == "__main__":
    main()
