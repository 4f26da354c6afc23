"""Tensor parallelism A/B: step time of TP=N against one process on the same cores, and the share
of a TP step that rank 0 spends in all-reduce (waiting for the other ranks included).

All engines stay loaded and are measured in alternating rounds, so load from other processes
falls on each alike; medians over rounds. A bare all-reduce between idle processes (the collective's own cost, no waiting for a rank
still computing) is timed last. The one-process engine runs with every thread
(``--threads``), each TP rank with ``threads / N``; a one-process engine without the fused C++
decode step (which TP cannot use: the all-reduces sit between its layers) is a third column.

    python benchmarks/tensor_parallel.py --tp 2 --threads 2 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from kvserve import LLM, SamplingParams
from kvserve.bench.random_model import write_random_model

SHAPE = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=4, head_dim=64, max_position_embeddings=2048)


class StepTimer:
    """Wraps a runner's ``execute``: wall time per step, split into decode-only and prefill steps."""

    def __init__(self, runner) -> None:
        self.runner, self.inner = runner, runner.execute
        self.decode: list[float] = []
        self.prefill: list[float] = []
        runner.execute = self

    def __call__(self, out):
        start = time.perf_counter()
        result = self.inner(out)
        elapsed = time.perf_counter() - start
        (self.decode if all(len(s.token_ids) == 1 for s in out.scheduled) else self.prefill).append(elapsed)
        return result

    def reset(self) -> None:
        self.decode, self.prefill = [], []


def measure(llm: LLM, timer: StepTimer, batch: int, prompt_len: int, new_tokens: int) -> dict:
    """One round: ``batch`` prompts of ``prompt_len`` tokens each (one prefill step each at this
    budget), then ``new_tokens`` decode steps."""
    reduce = getattr(timer.runner, "all_reduce", None)
    if reduce is not None:
        reduce.timed, reduce.calls, reduce.seconds = True, 0, 0.0
    timer.reset()
    prompts = [[(7 * i + 13 * j) % 31000 + 3 for j in range(prompt_len)] for i in range(batch)]
    llm.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True))
    total = sum(timer.decode) + sum(timer.prefill)
    return {"decode": statistics.median(timer.decode), "prefill": statistics.median(timer.prefill),
            "reduce_share": None if reduce is None else reduce.seconds / total}


def _reduce_loop(store_path: str, rank: int, world: int, hidden: int, calls: int, out) -> None:
    import torch

    from kvserve.worker.tensor_parallel import _process_group

    torch.set_num_threads(1)
    group = _process_group(store_path, rank, world, torch.device("cpu"))
    x = torch.ones(1, hidden)
    for _ in range(20):
        group.allreduce([x]).wait()
    start = time.perf_counter()
    for _ in range(calls):
        group.allreduce([x]).wait()
    if out is not None:
        out.put((time.perf_counter() - start) / calls)


def bare_all_reduce_seconds(world: int, hidden: int, calls: int = 2000) -> float:
    """One all-reduce of a decode step's [1, hidden] float32 between idle processes: the collective's own cost."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    store = os.path.join(tempfile.mkdtemp(prefix="kvserve-tp-bench-"), "store")
    out = ctx.Queue()
    procs = [ctx.Process(target=_reduce_loop, args=(store, r, world, hidden, calls, out if r == 0 else None))
             for r in range(world)]
    for p in procs:
        p.start()
    seconds = out.get(timeout=300)
    for p in procs:
        p.join(30)
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="threads of the one-process engine; each rank gets / tp")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=24)
    args = ap.parse_args()
    path = write_random_model(tempfile.mkdtemp(prefix="kvserve-tp-bench-"), "LlamaForCausalLM", **SHAPE)
    common = dict(model=str(path), dtype="float32", kv_cache_memory_bytes=512 * 1024**2, max_model_len=1024)
    engines = {"tp1": LLM(**common, num_threads=args.threads)}
    os.environ["KVSERVE_FUSED_DECODE"] = "0"  # read when a runner is built
    engines["tp1-eager"] = LLM(**common, num_threads=args.threads)
    del os.environ["KVSERVE_FUSED_DECODE"]
    engines[f"tp{args.tp}"] = LLM(**common, num_threads=max(1, args.threads // args.tp),
                                  tensor_parallel_size=args.tp)
    timers = {name: StepTimer(llm.engine.core.runner) for name, llm in engines.items()}
    for name, llm in engines.items():  # warm-up round, not counted
        measure(llm, timers[name], 1, 32, 4)
    for batch in args.batch:
        rounds: dict[str, list[dict]] = {name: [] for name in engines}
        for _ in range(args.rounds):
            for name, llm in engines.items():
                rounds[name].append(measure(llm, timers[name], batch, args.prompt_len, args.new_tokens))
        med = {name: {k: statistics.median(r[k] for r in rs) if rs[0][k] is not None else None for k in rs[0]}
               for name, rs in rounds.items()}
        tp = med[f"tp{args.tp}"]
        print(f"batch {batch}, prompt {args.prompt_len} tokens:")
        for name, m in med.items():
            print(f"  {name:10s} decode step {m['decode'] * 1e3:7.2f} ms   prefill step {m['prefill'] * 1e3:8.1f} ms"
                  + ("" if m["reduce_share"] is None else f"   all-reduce share {m['reduce_share']:.1%}"))
        for base in ("tp1", "tp1-eager"):
            print(f"  tp{args.tp}/{base}: decode {tp['decode'] / med[base]['decode']:.2f}x, "
                  f"prefill {tp['prefill'] / med[base]['prefill']:.2f}x")
    bare = bare_all_reduce_seconds(args.tp, SHAPE["hidden_size"])
    per_step = 2 * SHAPE["num_hidden_layers"]
    print(f"bare all-reduce of [1, {SHAPE['hidden_size']}] float32 between {args.tp} idle processes: "
          f"{bare * 1e6:.0f} us; x{per_step} per step = {bare * per_step * 1e3:.2f} ms")
    for llm in engines.values():
        runner = llm.engine.core.runner
        if hasattr(runner, "close"):
            runner.close()


if __name__ == "__main__":
    main()
