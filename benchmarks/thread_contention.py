"""W1 throughput with a quiet machine vs with one busy-looping process pinned to one core.

For each setting (torch threads x OpenMP wait policy) one child process loads the engine once, then
runs W1 (32 requests at once, prompt 128, output 128, greedy, EOS ignored) alternately quiet and
with a busy loop pinned to ``--busy-core`` (what ``taskset -c 1 sh -c 'while :; do :; done'`` does),
``--repeats`` times, so each busy figure has a quiet figure measured next to it.

    .venv/bin/python benchmarks/thread_contention.py --threads 1,2 --wait-policy default,PASSIVE

The wait policy must be in the environment before torch loads OpenMP, hence one process per
setting. Other processes on the machine add noise: the table shows the median and the range.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

BUSY_LOOP = "import os, sys; os.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True: pass"


def start_busy_loop(core: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(core)])


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(timeout=10)


def run_w1(llm, reqs, params) -> float:
    start = time.perf_counter()
    outs = llm.generate([r.prompt_token_ids for r in reqs], params, use_tqdm=False)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


def child(args: argparse.Namespace) -> None:
    """Load once; print one JSON line per (repeat, condition)."""
    from kvserve import LLM, SamplingParams
    from kvserve.bench.workloads import random_requests
    from kvserve.worker.threads import configure_threads

    configure_threads(args.child_threads)
    llm = LLM(dtype=args.dtype, kv_cache_memory_bytes=1024**3)
    vocab = llm.engine.core.model_config.vocab_size
    reqs = random_requests(args.num_requests, (args.prompt_len,) * 2, (args.output_len,) * 2, vocab, seed=0)
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    llm.generate([reqs[0].prompt_token_ids], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    for r in range(args.repeats):
        for condition in (("quiet", "busy") if r % 2 == 0 else ("busy", "quiet")):
            busy = start_busy_loop(args.busy_core) if condition == "busy" else None
            try:
                rate = run_w1(llm, reqs, params)
            finally:
                if busy is not None:
                    stop(busy)
            print(json.dumps({"condition": condition, "tokens_per_s": rate, "load": os.getloadavg()[0]}), flush=True)


def run_setting(threads: int, policy: str, args: argparse.Namespace) -> dict[str, list[float]]:
    env = dict(os.environ)
    env.pop("OMP_WAIT_POLICY", None)
    if policy != "default":
        env["OMP_WAIT_POLICY"] = policy
    cmd = [sys.executable, __file__, "--child-threads", str(threads), "--dtype", args.dtype, "--repeats",
           str(args.repeats), "--busy-core", str(args.busy_core), "--num-requests", str(args.num_requests),
           "--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len)]
    rates: dict[str, list[float]] = {"quiet": [], "busy": []}
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True) as proc:
        for line in proc.stdout:
            if not line.startswith("{"):
                continue
            row = json.loads(line)
            rates[row["condition"]].append(row["tokens_per_s"])
            print(f"  threads={threads} wait={policy:8} {row['condition']:5} {row['tokens_per_s']:7.1f} tok/s "
                  f"(load avg {row['load']:.1f})", file=sys.stderr, flush=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}")
    return rates


def summary_row(threads: int, policy: str, rates: dict[str, list[float]]) -> dict:
    quiet, busy = statistics.median(rates["quiet"]), statistics.median(rates["busy"])
    return {"threads": threads, "wait_policy": policy, "quiet_median": quiet, "busy_median": busy,
            "busy_over_quiet": busy / quiet, "quiet": rates["quiet"], "busy": rates["busy"]}


def print_table(rows: list[dict]) -> None:
    print(f"{'threads':>7} {'wait policy':>11} {'quiet tok/s':>12} {'range':>15} {'busy tok/s':>11} "
          f"{'range':>15} {'busy/quiet':>10}")
    for r in rows:
        q, b = r["quiet"], r["busy"]
        print(f"{r['threads']:7d} {r['wait_policy']:>11} {r['quiet_median']:12.1f} {min(q):7.1f}-{max(q):<7.1f} "
              f"{r['busy_median']:11.1f} {min(b):7.1f}-{max(b):<7.1f} {r['busy_over_quiet']:10.2f}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", default="1,2", help="comma-separated torch thread counts to try")
    p.add_argument("--wait-policy", default="default,PASSIVE",
                   help="comma-separated OMP_WAIT_POLICY values (default: unset, ACTIVE, PASSIVE)")
    p.add_argument("--repeats", type=int, default=3, help="quiet/busy pairs per setting")
    p.add_argument("--busy-core", type=int, default=max(os.sched_getaffinity(0)), help="core the busy loop takes")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--json", action="store_true")
    p.add_argument("--child-threads", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child_threads is not None:
        child(args)
        return 0
    rows = []
    for threads in (int(t) for t in args.threads.split(",")):
        for policy in args.wait_policy.split(","):
            rows.append(summary_row(threads, policy, run_setting(threads, policy, args)))
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
