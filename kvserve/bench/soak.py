"""`kvserve bench soak --minutes N`: W2-like rounds against a server for N minutes, reporting the
server's resident memory over time, errors, and leaks (anything still running, waiting or holding
KV blocks once a round has finished).

It starts its own `kvserve serve` (MODEL and --server-args), or drives one given by --base-url and
--pid (the pid is read for RSS). Growth is measured from the end of the warm-up rounds, since the
first rounds fill the allocator's caches and the prefix cache.
"""

from __future__ import annotations

import asyncio
import json
import math
import shlex
import sys
import time
from pathlib import Path

import httpx

from kvserve.bench.launch import ServerProcess
from kvserve.bench.serving import Target, run_load
from kvserve.bench.workloads import random_requests

_GAUGES = ("kvserve:num_requests_running", "kvserve:num_requests_waiting", "kvserve:kv_cache_usage_perc")


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def gauges(base_url: str, headers: dict) -> dict[str, float]:
    """The running/waiting/KV-usage gauges, once they have settled (a finished round's last output
    reaches the client a moment before the engine's snapshot is published)."""
    deadline = time.monotonic() + 5
    while True:
        text = httpx.get(base_url + "/metrics", headers=headers, timeout=10).text
        values = {}
        for line in text.splitlines():
            for name in _GAUGES:
                if line.startswith((name + "{", name + " ")):
                    values[name] = float(line.rsplit(" ", 1)[1])
        if all(v == 0 for v in values.values()) or time.monotonic() > deadline:
            return values
        time.sleep(0.1)


def soak(args, base_url: str, pid: int) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    target = Target(url=base_url + "/v1/completions", model=None, chat=False, ignore_eos=True, headers=headers,
                    text_prompts=False)
    samples, errors, leaks, round_no = [], 0, [], 0
    start = time.monotonic()
    end = start + 60 * args.minutes
    while time.monotonic() < end:
        reqs = random_requests(args.num_requests, (args.prompt_min, args.prompt_max), (args.output_min, args.output_max),
                               args.vocab_size, seed=round_no)
        results, wall = asyncio.run(run_load(reqs, target, math.inf, None, round_no, args.timeout, False))
        failed = [r.error for r in results if not r.ok]
        errors += len(failed)
        left = gauges(base_url, headers)
        if any(v != 0 for v in left.values()):
            leaks.append({"round": round_no, **left})
        sample = {"round": round_no, "t_s": round(time.monotonic() - start, 1), "rss_mib": rss_bytes(pid) / 2**20,
                  "wall_s": round(wall, 2), "failed": len(failed), "tokens": sum(r.output_tokens for r in results)}
        samples.append(sample)
        print(json.dumps(sample), flush=True)
        round_no += 1
    summary = summarize(samples, args.warmup_rounds)
    return {"rounds": len(samples), "requests": len(samples) * args.num_requests, "errors": errors,
            "leaks": leaks, **summary}


def summarize(samples: list[dict], warmup_rounds: int) -> dict:
    """RSS figures of a soak's per-round samples. The baseline is the sample that ends the warm-up
    rounds; a soak with no round after it measured no growth, so growth is None then, not 0."""
    rss = [s["rss_mib"] for s in samples]
    summary = {"rss_first_mib": round(rss[0], 1), "rss_last_mib": round(rss[-1], 1), "rss_max_mib": round(max(rss), 1),
               "rss_after_warmup_mib": None, "growth_after_warmup_pct": None, "rounds_after_warmup": 0}
    base = max(warmup_rounds - 1, 0)  # the round whose end closes the warm-up
    if len(rss) > base + 1:
        warm = rss[base]
        summary.update(rss_after_warmup_mib=round(warm, 1), rounds_after_warmup=len(rss) - 1 - base,
                       growth_after_warmup_pct=round(100 * (rss[-1] - warm) / warm, 2))
    return summary


def run(args) -> int:
    if args.minutes <= 0:
        raise ValueError(f"--minutes {args.minutes} must be > 0")
    if args.base_url:
        if args.pid is None:
            raise ValueError("--base-url needs --pid (the server's process id, for its memory)")
        summary = soak(args, args.base_url.rstrip("/"), args.pid)
    else:
        server_args = ([args.model_path] if args.model_path else []) + shlex.split(args.server_args)
        if args.api_key:
            server_args += ["--api-key", args.api_key]
        with ServerProcess(server_args) as server:
            summary = soak(args, server.base_url, server.proc.pid)
    print(json.dumps({"summary": summary}, indent=2))
    if summary["growth_after_warmup_pct"] is None:
        print(f"no round ran after the {args.warmup_rounds} warm-up rounds: growth not measured; "
              "run longer or lower --warmup-rounds", file=sys.stderr)
    return 0 if summary["errors"] == 0 and not summary["leaks"] else 1


def add_parser(bench_sub) -> None:
    p = bench_sub.add_parser("soak", help="W2-like load for N minutes: server RSS over time, errors, leaked KV blocks")
    p.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                   help="the model a started server serves (default: the bundled one)")
    p.add_argument("--minutes", type=float, required=True)
    p.add_argument("--server-args", default="", help="extra `kvserve serve` flags, as one string")
    p.add_argument("--base-url", default=None, help="drive this server instead of starting one (needs --pid)")
    p.add_argument("--pid", type=int, default=None, help="the --base-url server's process id")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-requests", type=int, default=64, help="requests per round, sent at once (W2: 64)")
    p.add_argument("--prompt-min", type=int, default=32)
    p.add_argument("--prompt-max", type=int, default=512)
    p.add_argument("--output-min", type=int, default=16)
    p.add_argument("--output-max", type=int, default=256)
    p.add_argument("--vocab-size", type=int, default=32000, help="token ids are drawn below this")
    p.add_argument("--warmup-rounds", type=int, default=2, help="rounds before the growth baseline")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per request")
    p.set_defaults(func=run)



