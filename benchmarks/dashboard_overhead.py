"""W1 throughput with the live dashboard open against closed, A/B on one `kvserve serve` process.

    .venv/bin/python benchmarks/dashboard_overhead.py                    # the page in headless Chromium
    .venv/bin/python benchmarks/dashboard_overhead.py --watcher stream   # only the event stream, read by a client
    .venv/bin/python benchmarks/dashboard_overhead.py --rounds 5

Rounds alternate closed / open (ABAB...), so drift on a shared machine falls on both; the figure is
the ratio of the median output throughputs. ``browser`` counts Chromium's own CPU too (it runs on
the same cores); ``stream`` isolates what the server pays: the sampler and the KV block map. The
median of each round's open/closed ratio is printed too: it cancels drift slower than a round.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import threading
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.compare_engines import WORKLOADS, bench_serve, kvserve_server, stop, wait_healthy  # noqa: E402
from kvserve.bench.launch import free_port  # noqa: E402


@contextlib.contextmanager
def stream_watcher(base_url: str):
    """Reads /v1/engine/events as the dashboard does, until the block ends."""
    done = threading.Event()
    samples = []

    def read() -> None:
        with httpx.Client(timeout=None) as http, http.stream("GET", base_url + "/v1/engine/events?interval=0.5") as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    samples.append(line)
                if done.is_set():
                    return

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        done.set()


@contextlib.contextmanager
def browser_watcher(base_url: str):
    from tests.e2e.browser import chrome

    driver = chrome()
    try:
        driver.get(base_url + "/dashboard")
        yield None
    finally:
        driver.quit()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--watcher", choices=["browser", "stream"], default="browser")
    p.add_argument("--rounds", type=int, default=3, help="runs of each condition")
    p.add_argument("--workload", default="W1", choices=sorted(WORKLOADS))
    p.add_argument("--vocab-size", type=int, default=49152)
    p.add_argument("--kvserve-args", type=str.split, default=[])
    args = p.parse_args(argv)
    workload = WORKLOADS[args.workload]
    server = kvserve_server(args, workload, free_port())
    proc = subprocess.Popen(server.cmd, env={**os.environ, **server.env}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{server.port}"
    watcher = browser_watcher if args.watcher == "browser" else stream_watcher
    runs: dict[str, list[float]] = {"closed": [], "open": []}
    try:
        wait_healthy(server, proc)
        bench_serve(server, WORKLOADS["W3"], args.vocab_size, [])  # warm: first requests pay one-time costs
        for i in range(args.rounds):
            for condition in ("closed", "open") if i % 2 == 0 else ("open", "closed"):
                with watcher(base) if condition == "open" else contextlib.nullcontext():
                    result = bench_serve(server, workload, args.vocab_size, [])
                runs[condition].append(result["output_throughput"])
                print(f"round {i + 1} {condition:6} {result['output_throughput']:8.1f} output tokens/s", flush=True)
    finally:
        stop(proc)
    closed, opened = statistics.median(runs["closed"]), statistics.median(runs["open"])
    paired = statistics.median(o / c for o, c in zip(runs["open"], runs["closed"]))
    print(f"{args.workload} median output tokens/s: closed {closed:.1f}, open ({args.watcher}) {opened:.1f}: "
          f"{100 * opened / closed:.1f}%; median of the rounds' open/closed ratios {100 * paired:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
