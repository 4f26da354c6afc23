"""W1 throughput with a quiet machine vs with one busy-looping process pinned to one core.

W1: 32 requests at once, prompt 128, output 128, greedy, EOS ignored, dense bf16 weights, no prefix
caching (each run prefills again), through the offline engine. The busy loop is what ``taskset -c 1 sh -c 'while :; do :; done'`` does.

One worker process per OpenMP setting (OMP_WAIT_POLICY / GOMP_SPINCOUNT must be in the environment
before torch loads OpenMP) loads the engine once; the parent then asks the workers for runs in an interleaved
order, every (policy, threads, quiet|busy) once per round, so drift in what other processes
do to the machine hits every setting alike. The table shows the median and range per setting and
the busy/quiet ratio of the medians.

    .venv/bin/python benchmarks/thread_contention.py --threads 1,2 --wait-policy default,GOMP_SPINCOUNT=300000
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

# Spins until its parent (the worker) is gone, so a killed run leaves no busy loop behind.
BUSY_LOOP = "import os, sys; os.sched_setaffinity(0, {int(sys.argv[1])}); parent = os.getppid()\nwhile os.getppid() == parent: pass"


def start_busy_loop(core: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(core)])


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(timeout=10)


# ---- the worker: loads once, then runs W1 on request ----------------------------------------------

def worker(args: argparse.Namespace) -> None:
    """Read '<threads> <quiet|busy>' lines from stdin; answer each with one JSON line."""
    # kvserve first (isort would put torch first): it sets the OpenMP wait policy before torch loads.
    from kvserve import LLM, SamplingParams  # noqa: I001
    from kvserve.bench.workloads import random_requests
    from kvserve.runtime.threads import openmp_waits_passively

    import torch

    # No prefix caching: every run repeats the same prompts and must prefill them again.
    llm = LLM(dtype=args.dtype, quantization="none", kv_cache_memory_bytes=1024**3, enable_prefix_caching=False)
    vocab = llm.engine.core.model_config.vocab_size
    reqs = random_requests(args.num_requests, (args.prompt_len,) * 2, (args.output_len,) * 2, vocab, seed=0)
    prompts = [r.prompt_token_ids for r in reqs]
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    print("ready", flush=True)
    for line in sys.stdin:
        threads, condition = line.split()
        torch.set_num_threads(int(threads))
        busy = start_busy_loop(args.busy_core) if condition == "busy" else None
        try:
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            rate = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)
        finally:
            if busy is not None:
                stop(busy)
        print(json.dumps({"tokens_per_s": rate, "load": os.getloadavg()[0], "passive": openmp_waits_passively()}),
              flush=True)


def openmp_env(policy: str) -> dict[str, str]:
    """'default' (nothing set), a bare OMP_WAIT_POLICY value, or 'KEY=VALUE;KEY=VALUE' (e.g. GOMP_SPINCOUNT=10000)."""
    if policy == "default":
        return {}
    if "=" not in policy:
        return {"OMP_WAIT_POLICY": policy}
    return dict(item.split("=", 1) for item in policy.split(";"))


def start_worker(policy: str, args: argparse.Namespace) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(openmp_env(policy))
    cmd = [sys.executable, __file__, "--worker", "--dtype", args.dtype, "--busy-core", str(args.busy_core),
           "--num-requests", str(args.num_requests), "--prompt-len", str(args.prompt_len),
           "--output-len", str(args.output_len)]
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    while (line := proc.stdout.readline()) and line.strip() != "ready":
        pass
    if not line:
        raise RuntimeError(f"worker for OMP_WAIT_POLICY={policy} exited before it was ready")
    return proc


def ask(proc: subprocess.Popen, threads: int, condition: str) -> dict:
    proc.stdin.write(f"{threads} {condition}\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError("a worker exited mid-run")
    return json.loads(line)


# ---- the parent ----------------------------------------------------------------------------------

def schedule(policies: list[str], threads: list[int], rounds: int) -> list[tuple[str, int, str]]:
    """Every (policy, threads, condition) once per round; each round rotated so no setting always goes first."""
    cells = [(p, t, c) for p in policies for t in threads for c in ("quiet", "busy")]
    return [cells[(i + r) % len(cells)] for r in range(rounds) for i in range(len(cells))]


def measure(args: argparse.Namespace) -> dict[tuple[str, int], dict[str, list[float]]]:
    policies, threads = args.wait_policy.split(","), [int(t) for t in args.threads.split(",")]
    workers = {p: start_worker(p, args) for p in policies}
    rates: dict[tuple[str, int], dict[str, list[float]]] = {(p, t): {"quiet": [], "busy": []}
                                                            for p in policies for t in threads}
    try:
        for policy, n, condition in schedule(policies, threads, args.rounds):
            row = ask(workers[policy], n, condition)
            rates[(policy, n)][condition].append(row["tokens_per_s"])
            print(f"  threads={n} wait={policy:8} {condition:5} {row['tokens_per_s']:7.1f} tok/s "
                  f"(load avg {row['load']:.1f}; idle threads {'soon sleep' if row['passive'] else 'spin'})",
                  file=sys.stderr, flush=True)
    finally:
        for proc in workers.values():
            proc.stdin.close()
            proc.wait(timeout=60)
    return rates


def summary_rows(rates: dict[tuple[str, int], dict[str, list[float]]]) -> list[dict]:
    rows = []
    for (policy, threads), r in rates.items():
        quiet, busy = statistics.median(r["quiet"]), statistics.median(r["busy"])
        rows.append({"threads": threads, "wait_policy": policy, "quiet_median": quiet, "busy_median": busy,
                     "busy_over_quiet": busy / quiet, "quiet": r["quiet"], "busy": r["busy"]})
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'threads':>7} {'wait policy':>11} {'quiet tok/s':>11} {'(range)':>15} {'busy tok/s':>10} "
          f"{'(range)':>15} {'busy/quiet':>10}")
    for r in rows:
        q, b = r["quiet"], r["busy"]
        print(f"{r['threads']:7d} {r['wait_policy']:>11} {r['quiet_median']:11.1f} {min(q):7.1f}-{max(q):<7.1f} "
              f"{r['busy_median']:10.1f} {min(b):7.1f}-{max(b):<7.1f} {r['busy_over_quiet']:10.2f}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", default="1,2", help="comma-separated torch thread counts to try")
    p.add_argument("--wait-policy", default="default,GOMP_SPINCOUNT=300000",
                   help="comma-separated OpenMP settings: 'default' (none: kvserve's own choice, GOMP_SPINCOUNT=3000), an "
                        "OMP_WAIT_POLICY value (ACTIVE, PASSIVE) or KEY=VALUE pairs joined by ';'; "
                        "GOMP_SPINCOUNT=300000 is GNU OpenMP's own default (spin ~3 ms, then sleep)")
    p.add_argument("--rounds", type=int, default=3, help="runs of every setting, interleaved")
    p.add_argument("--busy-core", type=int, default=max(os.sched_getaffinity(0)), help="core the busy loop takes")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--json", action="store_true")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    rows = summary_rows(measure(args))
    print(json.dumps(rows, indent=2) if args.json else "", end="")
    if not args.json:
        print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
