"""`kvserve bench soak`: run a server for N minutes under a steady mixed load (finished requests,
streams the client leaves, bad payloads) and report its memory over time, the errors seen and
anything left behind (KV blocks in use, requests running or waiting once the load stops).

The server is started here (``--model`` and ``--serve-args``), so its RSS can be read from /proc;
without ``--model`` a tiny random-weight model is written to a temporary folder.
"""

from __future__ import annotations

import asyncio
import json
import random
import shlex
import sys
import tempfile
import time
from pathlib import Path

import httpx

from kvserve.bench.launch import ServerProcess

API_KEY = "soak-key"
GAUGES = ("kvserve:num_requests_running", "kvserve:num_requests_waiting", "kvserve:kv_cache_usage_perc")
# Answers a bad payload may get; anything else (a 5xx above all) counts as an error.
BAD = [({"prompt": "w5", "top_p": 5e-324, "max_tokens": 4}, 200), ({"prompt": "w5 \ud800"}, 400),
       ({"prompt": "", "max_tokens": 2}, 400), ({"prompt": "w5", "max_tokens": "2"}, 400),
       ({"prompt": "w5", "n": 10**6}, 400), ({"prompt": [99999999]}, 400), ({"prompt": "w5", "temperature": -1}, 400)]


def rss_bytes(pid: int) -> int:
    """Resident memory of ``pid`` (VmRSS from /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


async def _load(server: ServerProcess, until: float, concurrency: int, seed: int, tally: dict[str, int]) -> None:
    rng = random.Random(seed)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(base_url=server.base_url, headers=headers, timeout=120) as http:
        async def one() -> None:
            kind = rng.random()
            prompt = " ".join(f"w{rng.randrange(5, 400)}" for _ in range(rng.randrange(4, 48)))
            try:
                if kind < 0.15:
                    body, want = rng.choice(BAD)
                    r = await http.post("/v1/completions", content=json.dumps(body),
                                        headers={"Content-Type": "application/json"})
                    tally["bad"] += 1
                    tally["errors"] += r.status_code != want
                elif kind < 0.45:  # a stream the client leaves after a few chunks
                    body = {"prompt": prompt, "max_tokens": 64, "ignore_eos": True, "stream": True}
                    async with http.stream("POST", "/v1/completions", json=body) as r:
                        if r.status_code != 200:
                            tally["errors" if r.status_code != 429 else "429"] += 1
                            return
                        seen = 0
                        async for line in r.aiter_lines():
                            seen += line.startswith("data:")
                            if seen >= rng.randrange(1, 6):
                                break
                    tally["left"] += 1
                else:
                    body = {"prompt": prompt, "max_tokens": rng.choice([8, 32, 96]), "ignore_eos": True,
                            "n": rng.choice([1, 1, 1, 2]), "temperature": rng.choice([0, 0.8])}
                    r = await http.post("/v1/completions", json=body)
                    key = "ok" if r.status_code == 200 else "429" if r.status_code == 429 else "errors"
                    tally[key] += 1
            except httpx.HTTPError:
                tally["errors"] += 1

        async def worker() -> None:
            while time.monotonic() < until:
                await one()

        await asyncio.gather(*(worker() for _ in range(concurrency)))


def _gauges(server: ServerProcess, timeout: float = 30.0) -> dict[str, float | None]:
    """The running/waiting/KV-usage gauges, waited on until all are 0 (or ``timeout``)."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(server.url("/metrics"), headers=headers, timeout=5).text
        values = {}
        for name in GAUGES:
            values[name] = next((float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                                 if line.startswith((name + "{", name + " "))), None)
        if all(v == 0 for v in values.values()) or time.monotonic() > deadline:
            return values
        time.sleep(0.1)


def soak(server: ServerProcess, minutes: float, concurrency: int, sample_s: float, seed: int) -> dict:
    tally = dict.fromkeys(("ok", "left", "bad", "429", "errors"), 0)
    samples: list[tuple[float, int]] = []
    start = time.monotonic()
    until = start + minutes * 60

    async def run() -> None:
        load = asyncio.ensure_future(_load(server, until, concurrency, seed, tally))
        while not load.done():
            samples.append((time.monotonic() - start, rss_bytes(server.proc.pid)))
            print(f"  {samples[-1][0]:7.0f} s  RSS {samples[-1][1] / 2**20:7.1f} MiB  {tally}", flush=True)
            await asyncio.wait([load], timeout=sample_s)
        await load

    asyncio.run(run())
    samples.append((time.monotonic() - start, rss_bytes(server.proc.pid)))
    left = _gauges(server)
    healthy = httpx.get(server.url("/health"), timeout=5).status_code == 200
    warm = next((rss for t, rss in samples if t >= min(60.0, minutes * 60 / 5)), samples[0][1])
    return {"minutes": minutes, "requests": tally, "rss_mib": [(round(t), round(r / 2**20, 1)) for t, r in samples],
            "rss_start_mib": round(samples[0][1] / 2**20, 1), "rss_warm_mib": round(warm / 2**20, 1),
            "rss_end_mib": round(samples[-1][1] / 2**20, 1),
            "growth_after_warmup_pct": round(100 * (samples[-1][1] - warm) / warm, 2),
            "left_after_load": left, "healthy_after": healthy}


def run(args) -> int:
    with tempfile.TemporaryDirectory(prefix="kvserve-soak-") as tmp:
        model = args.model
        if model is None:
            from kvserve.bench.random_model import write_random_model

            model = str(write_random_model(Path(tmp) / "tiny"))
        serve_args = [model, *shlex.split(args.serve_args), "--api-key", API_KEY, "--max-queue", str(args.max_queue)]
        print(f"kvserve bench soak: {args.minutes:g} min, {args.concurrency} clients, serve {shlex.join(serve_args)}")
        with ServerProcess(serve_args) as server:
            report = soak(server, args.minutes, args.concurrency, args.sample_seconds, args.seed)
            code = server.stop()
        report["exit_code"] = code
    print(json.dumps(report, indent=None if args.json else 1))
    leaked = any(v != 0 for v in report["left_after_load"].values())
    failed = report["requests"]["errors"] or leaked or not report["healthy_after"] or code != 0
    if failed:
        print("soak FAILED: errors, leaked KV blocks / requests, or an unhealthy server", file=sys.stderr)
    return 1 if failed else 0


def add_parser(bench_sub) -> None:
    p = bench_sub.add_parser("soak", help="a server under mixed load for N minutes: RSS over time, errors, leaks")
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--model", default=None, help="model path (default: a tiny random-weight model)")
    p.add_argument("--serve-args", default="--max-model-len 256 --dtype float32",
                   help="more `kvserve serve` arguments, as one string")
    p.add_argument("--concurrency", type=int, default=16, help="clients sending one request after another")
    p.add_argument("--max-queue", type=int, default=64)
    p.add_argument("--sample-seconds", type=float, default=15.0, help="seconds between RSS samples")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="the report on one line")
    p.set_defaults(func=run)

