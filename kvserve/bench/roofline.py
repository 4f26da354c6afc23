"""`kvserve bench roofline`: how close the engine runs to what this machine's memory and matmuls allow.

Measures the machine (``planner.hardware.measure_local``: a large copy, a matmul in the dtype, with
every available core), prices the model with the planner's arithmetic (``planner.roofline``), then
runs the engine with dense weights in the dtype (``quantization="none"``: a GGUF file's blocks are
dequantized) over seeded token-id prompts, greedy, EOS ignored:

* single-stream decode: one request; decode tokens/s (after the first token) against the
  memory bound ``bandwidth / bytes per decode step`` (all weights + that request's KV), in
  ``--single-rounds`` rounds, each with the copy bandwidth measured just before and after it: on a
  shared machine the bandwidth moves by a third from minute to minute, and a bound measured once,
  in another minute, gave fractions of 51-81% for the same code. The round of median fraction is
  reported;
* batched: ``--batch-sizes`` requests at once; output tokens/s, and the FLOP/s achieved (prefill
  and decode FLOPs of the whole run over its wall time) against the matmul peak: the best rate of
  a few matmul shapes (``planner.hardware``), since one square size can understate it by half.
  Decode steps also read every sequence's KV, so even a perfect engine is held below the peak:
  the report gives that ceiling too (the run's FLOPs over its roofline time, prefill and every
  decode step at max(compute, memory)), and how close the engine came to it;
* with ``--shipped``, single streams of the model as it ships too (a GGUF file's own 4/8-bit blocks,
  or ``--shipped-quantization``), against the bound of the bytes that engine keeps (what its kernels
  read per step), and their speed over the dense single stream of the same run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from kvserve.bench.report import add_report_argument
from kvserve.planner.capacity import Setup, kv_bytes_per_user
from kvserve.planner.roofline import decode_step, prefill, prefill_batch, weight_bytes_read


def bytes_per_decode_step(setup: Setup, users: int, context: int) -> float:
    """Bytes one decode step reads: the weights it touches once, plus each user's KV at ``context``."""
    return weight_bytes_read(setup, users) + users * kv_bytes_per_user(setup, context)


def flops_per_token(setup: Setup, context: int) -> float:
    """FLOPs to decode one token at ``context``: 2 per weight it multiplies, plus attention over the context."""
    return decode_step(setup, 1, context).flops


def request_flops(setup: Setup, prompt_len: int, output_len: int) -> float:
    """FLOPs of one request: the prefill (which yields the first token), then ``output_len - 1`` decodes."""
    decodes = sum(flops_per_token(setup, prompt_len + i) for i in range(1, output_len))
    return prefill(setup, prompt_len).flops + decodes


def run_roofline_seconds(setup: Setup, batch_size: int, prompt_len: int, output_len: int) -> float:
    """The fastest a batched run could go: each prefill, then each decode step, at its roofline time."""
    decodes = sum(decode_step(setup, batch_size, prompt_len + i).seconds for i in range(1, output_len))
    return prefill_batch(setup, batch_size, prompt_len).seconds + decodes


def memory_bound_tokens_per_s(setup: Setup, context: int) -> float:
    """Single-stream decode ceiling: one token per full read of the weights and the KV."""
    return setup.hardware.bandwidth / bytes_per_decode_step(setup, 1, context)


def decode_bound_tokens_per_s(setup: Setup, users: int, context: int) -> float:
    """Batched decode ceiling: ``users`` tokens per roofline step time (memory or compute, whichever is slower)."""
    return users / decode_step(setup, users, context).seconds


@dataclass(frozen=True)
class SingleStream:
    prompt_len: int
    output_len: int
    decode_tokens_per_s: float
    bytes_per_step: float
    bound_tokens_per_s: float
    bandwidth: float = 0.0  # the copy bandwidth the bound was computed from

    def at_bandwidth(self, bandwidth: float) -> SingleStream:
        return replace(self, bandwidth=bandwidth, bound_tokens_per_s=bandwidth / self.bytes_per_step)

    @property
    def fraction(self) -> float:
        return self.decode_tokens_per_s / self.bound_tokens_per_s

    @property
    def effective_bandwidth(self) -> float:
        """Bytes/s the decode would need from memory at the measured rate (above the bound: caches help)."""
        return self.decode_tokens_per_s * self.bytes_per_step


@dataclass(frozen=True)
class Batched:
    batch_size: int
    output_tokens_per_s: float
    achieved_flops: float
    decode_bound_tokens_per_s: float
    peak_flops: float
    ceiling_fraction: float  # of the matmul peak, the most this run's roofline time allows

    @property
    def flops_fraction(self) -> float:
        return self.achieved_flops / self.peak_flops

    @property
    def of_ceiling(self) -> float:
        """Roofline time over wall time: how close the engine came to what this machine allows."""
        return self.flops_fraction / self.ceiling_fraction


def measure_machine(dtype: str, copy_mib: int, seconds: float, device: str = "cpu"):
    """``measure_local`` on ``device``; on the CPU with torch using every available core (the
    machine's ceiling, not the engine's)."""
    from kvserve.planner.hardware import measure_local

    with _all_cores():
        return measure_local(dtype, copy_bytes=copy_mib * 2**20, seconds=seconds, device=device)


def measure_bandwidth(copy_mib: int, seconds: float, device: str = "cpu") -> float:
    """The copy bandwidth alone, as ``measure_machine`` measures it."""
    from kvserve.planner.hardware import measure_copy_bandwidth

    with _all_cores():
        return measure_copy_bandwidth(copy_mib * 2**20, seconds, device)


@contextmanager
def _all_cores():
    import torch

    from kvserve.runtime.threads import available_cpus

    before = torch.get_num_threads()
    torch.set_num_threads(available_cpus())
    try:
        yield
    finally:
        torch.set_num_threads(before)


def model_setup(model_path, hardware, dtype: str, block_size: int, kv_cache_dtype: str = "auto") -> Setup:
    from kvserve.planner.models import resolve_model
    from kvserve.planner.shape import ModelShape

    name, cfg = resolve_model(str(model_path))
    return Setup(model=ModelShape.from_hf(cfg, name), hardware=hardware, dtype=dtype, block_size=block_size,
                 kv_cache_dtype=kv_cache_dtype)


def _requests(llm, num: int, prompt_len: int, output_len: int, seed: int):
    from kvserve import SamplingParams
    from kvserve.bench.workloads import random_requests

    vocab = llm.engine.core.model_config.vocab_size
    reqs = random_requests(num, (prompt_len, prompt_len), (output_len, output_len), vocab, seed=seed)
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    return [r.prompt_token_ids for r in reqs], params


def run_single_stream(llm, setup: Setup, prompt_len: int, output_len: int, seed: int) -> SingleStream:
    """One request's decode rate, against the bound at the setup's machine bandwidth."""
    prompts, params = _requests(llm, 1, prompt_len, output_len, seed)
    out = llm.generate(prompts, params, use_tqdm=False)[0]
    rate = (len(out.token_ids) - 1) / (out.e2e_latency - out.ttft)
    mid_context = prompt_len + output_len // 2
    return SingleStream(prompt_len, output_len, rate, bytes_per_decode_step(setup, 1, mid_context),
                        memory_bound_tokens_per_s(setup, mid_context), setup.hardware.bandwidth)


def run_single_rounds(llm, setup: Setup, args, device: str) -> list[SingleStream]:
    """``args.single_rounds`` single streams, each against the mean of the copy bandwidth measured
    just before and just after it."""
    rounds = []
    for _ in range(args.single_rounds):
        before = measure_bandwidth(args.copy_mib, args.measure_seconds / 2, device)
        single = run_single_stream(llm, setup, args.prompt_len, args.single_output_len, args.seed)
        after = measure_bandwidth(args.copy_mib, args.measure_seconds / 2, device)
        rounds.append(single.at_bandwidth((before + after) / 2))
    return rounds


def shipped_bytes_per_step(llm, setup: Setup, context: int) -> float:
    """Bytes a quantized engine's decode step reads: every weight it keeps (an untied input table
    only by the looked-up row) plus the request's KV, priced as for the dense run."""
    from kvserve.model.layers.linear import VocabEmbedding

    core = llm.engine.core
    total = core.memory.weight_bytes
    if not core.model_config.tie_word_embeddings:  # the table's own bytes: the weights share one arena
        total -= sum(t.numel() * t.element_size() for m in core.runner.model.modules()
                     if isinstance(m, VocabEmbedding) for t in m.state_dict().values())
    return total + kv_bytes_per_user(setup, context)


def run_shipped_rounds(llm, setup: Setup, args, device: str) -> list[SingleStream]:
    """``run_single_rounds`` for the model as shipped: the same requests, its own bytes per step."""
    per_step = shipped_bytes_per_step(llm, setup, args.prompt_len + args.single_output_len // 2)
    return [replace(r, bytes_per_step=per_step).at_bandwidth(r.bandwidth)
            for r in run_single_rounds(llm, setup, args, device)]


def median_round(rounds: list[SingleStream]) -> SingleStream:
    """The round of median fraction (the lower middle one of an even number)."""
    return sorted(rounds, key=lambda r: r.fraction)[(len(rounds) - 1) // 2]


def run_batched(llm, setup: Setup, batch_size: int, prompt_len: int, output_len: int, seed: int) -> Batched:
    prompts, params = _requests(llm, batch_size, prompt_len, output_len, seed)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    flops = batch_size * request_flops(setup, prompt_len, output_len)
    peak = setup.hardware.peak_flops(setup.dtype)
    bound = decode_bound_tokens_per_s(setup, batch_size, prompt_len + output_len // 2)
    ceiling = flops / (run_roofline_seconds(setup, batch_size, prompt_len, output_len) * peak)
    return Batched(batch_size, tokens / wall, flops / wall, bound, peak, ceiling)


_BLOCK_SIZE = 16


def kv_blocks_for(batch_size: int, tokens_per_request: int, block_size: int = _BLOCK_SIZE) -> int:
    """KV blocks that hold ``batch_size`` requests of ``tokens_per_request`` at once (no preemption)."""
    return batch_size * -(-tokens_per_request // block_size) + 1


def run(args) -> int:
    import torch

    from kvserve import LLM
    from kvserve.runtime.threads import configure_threads

    if args.single_rounds < 1:
        raise SystemExit(f"--single-rounds must be at least 1, got {args.single_rounds}")
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    hardware = measure_machine(args.dtype, args.copy_mib, args.measure_seconds, device.split(":")[0])
    threads = configure_threads(args.num_threads)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    # Dense weights in the dtype (GGUF blocks dequantized), as the planner prices them here; no prefix
    # caching, since the runs share prompts and every prefill FLOP is counted.
    cache = {"kv_cache_memory_bytes": int(args.kv_cache_memory * 1024**3)} if args.kv_cache_memory else {
        "num_kv_blocks": kv_blocks_for(max(batch_sizes), args.prompt_len + max(args.output_len, args.single_output_len))}
    llm = LLM(model=args.model, dtype=args.dtype, device=device, enforce_eager=args.enforce_eager,
              async_scheduling=args.async_scheduling, max_num_seqs=max(batch_sizes), quantization="none", enable_prefix_caching=False,
              block_size=_BLOCK_SIZE, kv_cache_dtype=args.kv_cache_dtype, **cache)
    setup = model_setup(llm.engine.core.model_path, hardware, args.dtype, llm.engine.core.kv_info.block_size,
                        args.kv_cache_dtype)
    llm.generate(*_requests(llm, 1, 16, 4, args.seed), use_tqdm=False)  # warm-up: kernels, allocator
    rounds = run_single_rounds(llm, setup, args, device.split(":")[0])
    batched = [run_batched(llm, setup, b, args.prompt_len, args.output_len, args.seed) for b in batch_sizes]
    shipped = None
    if args.shipped:
        del llm
        quantized = LLM(model=args.model, dtype=args.dtype, device=device, enforce_eager=args.enforce_eager,
                        max_num_seqs=1, quantization=args.shipped_quantization, enable_prefix_caching=False,
                        block_size=_BLOCK_SIZE, kv_cache_dtype=args.kv_cache_dtype,
                        num_kv_blocks=kv_blocks_for(1, args.prompt_len + args.single_output_len))
        quantized.generate(*_requests(quantized, 1, 16, 4, args.seed), use_tqdm=False)
        shipped = Shipped(quantized.engine.core.memory.quantization,
                          run_shipped_rounds(quantized, setup, args, device.split(":")[0]))
    if args.report:
        print(f"report: {write_report(setup, threads.num_threads, rounds, batched, Path(args.report), shipped)}",
              file=sys.stderr)
    report(setup, threads.num_threads, rounds, batched, args.json, shipped)
    return 0


@dataclass(frozen=True)
class Shipped:
    """The single streams of the model as shipped (``--shipped``)."""

    quantization: str  # as the engine describes its layers, e.g. "int4-g32 x210, int8-g32 x1"
    rounds: list[SingleStream]

    def over_dense(self, dense: list[SingleStream]) -> float:
        """Median shipped decode rate over the median dense one."""
        return median_round(self.rounds).decode_tokens_per_s / _median_rate(dense)


def _median_rate(rounds: list[SingleStream]) -> float:
    rates = sorted(r.decode_tokens_per_s for r in rounds)
    return rates[(len(rates) - 1) // 2]


def _single_json(single: SingleStream) -> dict:
    return {**asdict(single), "fraction": single.fraction, "effective_bandwidth": single.effective_bandwidth}


def summary(setup: Setup, threads: int, rounds: list[SingleStream], batched: list[Batched],
            shipped: Shipped | None = None) -> dict:
    """The figures, as `--json` prints them."""
    hw, best, single = setup.hardware, max(batched, key=lambda b: b.output_tokens_per_s), median_round(rounds)
    context = single.prompt_len + single.output_len // 2
    extra = {} if shipped is None else {"shipped": {
        "quantization": shipped.quantization, "single_stream": _single_json(median_round(shipped.rounds)),
        "single_stream_rounds": [_single_json(r) for r in shipped.rounds],
        "over_dense_single_stream": shipped.over_dense(rounds)}}
    return {
        "machine": {"name": hw.name, "bandwidth": hw.bandwidth, "matmul_flops": hw.peak_flops(setup.dtype)},
        "model": setup.model.name, "dtype": setup.dtype, "kv_cache_dtype": setup.kv_cache_dtype,
        "engine_threads": threads,
        "weight_bytes_per_step": weight_bytes_read(setup, 1), "flops_per_token": flops_per_token(setup, context),
        "single_stream": _single_json(single),
        "single_stream_rounds": [_single_json(r) for r in rounds],
        "batched": [{**asdict(b), "flops_fraction": b.flops_fraction, "of_ceiling": b.of_ceiling} for b in batched],
        "best_batch_size": best.batch_size, **extra}


def write_report(setup: Setup, threads: int, rounds: list[SingleStream], batched: list[Batched], out: Path,
                 shipped: Shipped | None = None) -> Path:
    from kvserve.bench.report import Page, Table, bar_chart, fmt, line_chart, write_page

    sizes = [b.batch_size for b in batched]
    line_chart(out / "batched.png", "Batched output throughput against the decode memory bound", "batch size",
               "tokens/s", {"measured": (sizes, [b.output_tokens_per_s for b in batched]),
                            "decode memory bound": (sizes, [b.decode_bound_tokens_per_s for b in batched])},
               log2_x=len(sizes) > 1)
    line_chart(out / "flops.png", "Achieved FLOP/s as a share of the matmul peak", "batch size", "% of peak",
               {"achieved": (sizes, [100 * b.flops_fraction for b in batched]),
                "roofline allows": (sizes, [100 * b.ceiling_fraction for b in batched])}, log2_x=len(sizes) > 1)
    bar_chart(out / "single.png", "Single-stream decode against its memory bound, per round", "tokens/s",
              [f"round {i + 1}" for i in range(len(rounds))],
              {"measured": [r.decode_tokens_per_s for r in rounds], "memory bound": [r.bound_tokens_per_s for r in rounds]})
    single = Table(("round", "decode tok/s", "copy GB/s", "memory bound tok/s", "of the bound"),
                   [(f"round {i + 1}", fmt(r.decode_tokens_per_s), fmt(r.bandwidth / 1e9), fmt(r.bound_tokens_per_s),
                     f"{100 * r.fraction:.0f}%") for i, r in enumerate(rounds)], "Single stream")
    table = Table(("batch", "out tok/s", "decode bound", "achieved TFLOP/s", "of matmul peak", "roofline allows",
                   "of that"),
                  [(b.batch_size, fmt(b.output_tokens_per_s), fmt(b.decode_bound_tokens_per_s),
                    fmt(b.achieved_flops / 1e12, 3), f"{100 * b.flops_fraction:.1f}%", f"{100 * b.ceiling_fraction:.1f}%",
                    f"{100 * b.of_ceiling:.1f}%") for b in batched], "Batched")
    tables = [single, table]
    if shipped is not None:
        tables.append(Table(("round", "decode tok/s", "copy GB/s", "memory bound tok/s", "of the bound"),
                            [(f"round {i + 1}", fmt(r.decode_tokens_per_s), fmt(r.bandwidth / 1e9),
                              fmt(r.bound_tokens_per_s), f"{100 * r.fraction:.0f}%")
                             for i, r in enumerate(shipped.rounds)],
                            f"Single stream as shipped ({shipped.quantization}): "
                            f"{shipped.over_dense(rounds):.2f}x the dense one"))
    hw = setup.hardware
    described = (f"machine {hw.name}: copy bandwidth {hw.bandwidth / 1e9:.1f} GB/s, {setup.dtype} matmul "
                 f"{hw.peak_flops(setup.dtype) / 1e12:.2f} TFLOP/s, engine threads {threads}; model "
                 f"{setup.model.name} {setup.dtype} (KV cache {setup.kv_cache_dtype})")
    return write_page(Page("kvserve bench roofline", described, tables,
                           [("single.png", "Single stream"), ("batched.png", "Batched throughput"),
                            ("flops.png", "Batched FLOP/s")], summary(setup, threads, rounds, batched, shipped)), out)


def report(setup: Setup, threads: int, rounds: list[SingleStream], batched: list[Batched], as_json: bool,
           shipped: Shipped | None = None) -> None:
    hw, best, single = setup.hardware, max(batched, key=lambda b: b.output_tokens_per_s), median_round(rounds)
    context = single.prompt_len + single.output_len // 2
    if as_json:
        print(json.dumps(summary(setup, threads, rounds, batched, shipped), indent=2))
        return
    print(f"machine: {hw.name}: copy bandwidth {hw.bandwidth / 1e9:.1f} GB/s, "
          f"{setup.dtype} matmul {hw.peak_flops(setup.dtype) / 1e12:.2f} TFLOP/s; engine threads {threads}")
    print(f"model: {setup.model.name} {setup.dtype} (KV cache {setup.kv_cache_dtype}): "
          f"{weight_bytes_read(setup, 1) / 1e6:.1f} MB of weights read per "
          f"decode step, {flops_per_token(setup, context) / 1e6:.1f} MFLOP per token at context {context}")
    for i, r in enumerate(rounds):
        print(f"single-stream round {i + 1}: {r.decode_tokens_per_s:.1f} tok/s; copy {r.bandwidth / 1e9:.1f} GB/s "
              f"around it, memory bound {r.bound_tokens_per_s:.1f} tok/s: {100 * r.fraction:.0f}%")
    print(f"single-stream decode (median round): {single.decode_tokens_per_s:.1f} tok/s; memory bound "
          f"{single.bound_tokens_per_s:.1f} tok/s ({single.bytes_per_step / 1e6:.1f} MB per step at "
          f"{single.bandwidth / 1e9:.1f} GB/s): {100 * single.fraction:.0f}% of the bound "
          f"(reads {single.effective_bandwidth / 1e9:.1f} GB/s)")
    print(f"{'batch':>5} {'out tok/s':>9} {'decode bound':>12} {'achieved TFLOP/s':>16} {'of matmul peak':>14} "
          f"{'roofline allows':>15} {'of that':>7}")
    for b in batched:
        mark = "  <- best" if b is best else ""
        print(f"{b.batch_size:5d} {b.output_tokens_per_s:9.1f} {b.decode_bound_tokens_per_s:12.1f} "
              f"{b.achieved_flops / 1e12:16.3f} {100 * b.flops_fraction:13.1f}% {100 * b.ceiling_fraction:14.1f}% "
              f"{100 * b.of_ceiling:6.1f}%{mark}")
    if shipped is not None:
        for i, r in enumerate(shipped.rounds):
            print(f"as shipped ({shipped.quantization}) round {i + 1}: {r.decode_tokens_per_s:.1f} tok/s; copy "
                  f"{r.bandwidth / 1e9:.1f} GB/s, memory bound {r.bound_tokens_per_s:.1f} tok/s "
                  f"({r.bytes_per_step / 1e6:.1f} MB per step): {100 * r.fraction:.0f}%")
        mid = median_round(shipped.rounds)
        print(f"as shipped, median round: {mid.decode_tokens_per_s:.1f} tok/s, {100 * mid.fraction:.0f}% of its "
              f"bound; {shipped.over_dense(rounds):.2f}x the dense {setup.dtype} single stream")


def add_parser(bench_sub) -> None:
    p = bench_sub.add_parser("roofline", help="memory-bandwidth and matmul bounds vs measured decode speed")
    p.add_argument("--model", default=None, help="HF model folder or .gguf file (default: the bundled model)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="cpu, cuda[:N], or auto (cuda when torch sees a GPU)")
    p.add_argument("--enforce-eager", action="store_true", help="CUDA: no CUDA graphs for decode steps")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule a step while the previous one runs (default: the engine's, on for CUDA)")
    p.add_argument("--num-threads", type=int, default=None, help="engine threads (default: kvserve's choice)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--single-output-len", type=int, default=256, help="output tokens of the single stream")
    p.add_argument("--single-rounds", type=int, default=3,
                   help="single streams, each against the copy bandwidth measured around it; the median is reported")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per request of the batched runs")
    p.add_argument("--batch-sizes", default="8,32,64,128,256", help="comma-separated concurrent requests to try")
    p.add_argument("--kv-cache-memory", type=float, default=None,
                   help="KV-cache budget in GiB (default: blocks for the largest batch at full length)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8"],
                   help="KV cache format of the runs and of the bound (int8 / fp8: one byte per value)")
    p.add_argument("--copy-mib", type=int, default=256, help="size of the bandwidth test's copy")
    p.add_argument("--measure-seconds", type=float, default=1.0, help="time per machine measurement")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shipped", action="store_true",
                   help="also single streams of the model as shipped (a GGUF file's own blocks), against its bytes")
    p.add_argument("--shipped-quantization", default=None, choices=["int8", "int4"],
                   help="with --shipped: quantize at load instead of keeping the checkpoint's own format")
    p.add_argument("--json", action="store_true")
    add_report_argument(p, "single-stream and batched speed against their bounds")
    p.set_defaults(func=run)
