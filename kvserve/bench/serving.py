"""`kvserve bench serve`: an HTTP load generator for any OpenAI-compatible server (kvserve, vLLM, ...).

It sends a seeded synthetic workload (the same one `kvserve bench offline` runs, for equal
``--workload-seed`` and lengths) as streaming requests, so the time to first token and the gaps
between tokens are measured as a client sees them. Requests arrive as a Poisson process at
``--request-rate`` (inf: all at once), at most ``--max-concurrency`` in flight.

Latencies: TTFT = request sent -> first chunk with text; ITL = gaps between chunks with text;
E2E = request sent -> stream ended. Throughput divides by the whole run's wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from tqdm.auto import tqdm

from kvserve.bench.report import Run, add_report_argument, write_report
from kvserve.bench.workloads import BenchRequest, random_requests

_WORDS = ("the of and to in is was for on that with as by at from his her an they which or had are this be not "
          "it have one all were when we there can out more said some time if will up other about into than "
          "them only its new people two first way may down any after most made over did such through").split()


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int
    output_tokens: int = 0
    ttft: float | None = None
    e2e: float | None = None
    itls: list[float] = field(default_factory=list)
    error: str | None = None


@dataclass(frozen=True)
class Target:
    """Where and how to send: the URL of the endpoint, the model name and the request body's shape."""

    url: str
    model: str | None
    chat: bool
    ignore_eos: bool
    headers: dict
    text_prompts: bool
    sampling: dict = field(default_factory=lambda: {"temperature": 0})  # body fields: temperature, top_p, top_k


def arrival_offsets(num: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start at which each request is sent: a Poisson process, or all at 0 for rate inf."""
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(num):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def request_body(req: BenchRequest, target: Target) -> dict:
    prompt = _as_text(req.prompt_token_ids) if target.text_prompts else req.prompt_token_ids
    body: dict = {"max_tokens": req.max_tokens, **target.sampling, "stream": True,
                  "stream_options": {"include_usage": True}}
    if target.model:
        body["model"] = target.model
    if target.ignore_eos:
        body["ignore_eos"] = True  # a vLLM-style extension; kvserve and vLLM accept it
    if target.chat:
        body["messages"] = [{"role": "user", "content": prompt if isinstance(prompt, str) else _as_text(prompt)}]
    else:
        body["prompt"] = prompt
    return body


def _as_text(token_ids: list[int]) -> str:
    """A deterministic text of about one token per id, for servers that take no token-id prompts."""
    return " ".join(_WORDS[t % len(_WORDS)] for t in token_ids)


def chunk_text(chunk: dict) -> str:
    """The text a completions or chat streaming chunk carries ('' for role-only or usage chunks)."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        return (choice["delta"] or {}).get("content") or ""
    return choice.get("text") or ""


async def sse_lines(resp: aiohttp.ClientResponse) -> AsyncIterator[str]:
    """The response body as text lines, however the chunks split them (no limit on a line's length)."""
    pending = b""
    async for data in resp.content.iter_any():
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r").decode()
    if pending:
        yield pending.rstrip(b"\r").decode()


async def send(http: aiohttp.ClientSession, req: BenchRequest, target: Target) -> RequestResult:
    """One streaming request, timed chunk by chunk (from the first attempt: see ``_post``)."""
    result = RequestResult(ok=False, prompt_tokens=len(req.prompt_token_ids))
    start = last = time.perf_counter()
    chunks_with_text = 0
    try:
        async with await _post(http, target, request_body(req, target)) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.read())[:200]!r}"
                return result
            async for line in sse_lines(resp):
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = str(chunk["error"])[:200]
                    return result
                now = time.perf_counter()
                if chunk_text(chunk):
                    chunks_with_text += 1
                    if result.ttft is None:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    last = now
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
    except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError, UnicodeDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.e2e = time.perf_counter() - start
    result.output_tokens = result.output_tokens or chunks_with_text
    result.ok = True
    return result


async def _post(http: aiohttp.ClientSession, target: Target, body: dict, tries: int = 3) -> aiohttp.ClientResponse:
    """POST, again when the pooled connection turns out closed by the server before the request went
    out (cpp-httplib, under llama-server, closes a keep-alive connection after a few requests): the
    server never saw it, and aiohttp drops that connection from the pool."""
    for _ in range(tries - 1):
        try:
            return await http.post(target.url, json=body, headers=target.headers)
        except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError):
            continue
    return await http.post(target.url, json=body, headers=target.headers)


async def open_connections(http: aiohttp.ClientSession, target: Target, count: int) -> None:
    """Open the pool's connections before the clock starts (a GET of /v1/models on each), so that
    no request's time to first token includes a TCP handshake, as a long-running client's would not."""
    models = target.url.rsplit("/v1/", 1)[0] + "/v1/models"

    async def get() -> None:
        async with http.get(models, headers=target.headers) as resp:
            await resp.read()

    await asyncio.gather(*(get() for _ in range(count)), return_exceptions=True)


async def run_load(reqs: list[BenchRequest], target: Target, rate: float, concurrency: int | None, seed: int,
                   timeout: float, progress: bool) -> tuple[list[RequestResult], float]:
    """Send every request on schedule; returns the results (in request order) and the wall time.

    aiohttp rather than httpx: with 64 streams in flight, httpx's connection pool took about 7 ms
    of the client's CPU per request, so a burst of 64 "at once" reached the server over half a
    second (aiohttp: within 10 ms), and that spread showed up in every server's time to first token.
    """
    limit = concurrency or len(reqs)
    gate = asyncio.Semaphore(limit)
    bar = tqdm(total=len(reqs), desc="bench serve", unit="req", disable=not progress, file=sys.stderr)
    connector = aiohttp.TCPConnector(limit=limit)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout)) as http:
        await open_connections(http, target, min(limit, len(reqs)))
        start = time.perf_counter()

        async def one(req: BenchRequest, offset: float) -> RequestResult:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            async with gate:
                result = await send(http, req, target)
            bar.update(1)
            return result

        offsets = arrival_offsets(len(reqs), rate, seed)
        results = await asyncio.gather(*(one(r, t) for r, t in zip(reqs, offsets, strict=True)))
        wall = time.perf_counter() - start
    bar.close()
    return list(results), wall


def percentiles(values: list[float], points: tuple[int, ...] = (50, 90, 99)) -> dict:
    """Mean and the given percentiles (linear interpolation) in milliseconds; empty input gives None."""
    if not values:
        return {"mean_ms": None, **{f"p{p}_ms": None for p in points}}
    ordered = sorted(values)

    def at(p: float) -> float:
        k = (len(ordered) - 1) * p / 100
        lo, hi = math.floor(k), math.ceil(k)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)

    return {"mean_ms": 1000 * sum(ordered) / len(ordered), **{f"p{p}_ms": 1000 * at(p) for p in points}}


def summarize(results: list[RequestResult], wall: float) -> dict:
    done = [r for r in results if r.ok]
    output = sum(r.output_tokens for r in done)
    prompt = sum(r.prompt_tokens for r in done)
    errors = sorted({r.error for r in results if not r.ok and r.error})
    return {
        "completed": len(done), "failed": len(results) - len(done), "errors": errors[:5],
        "duration_s": wall, "prompt_tokens": prompt, "output_tokens": output,
        "request_throughput": len(done) / wall, "output_throughput": output / wall,
        "total_token_throughput": (prompt + output) / wall,
        "ttft": percentiles([r.ttft for r in done if r.ttft is not None]),
        "itl": percentiles([x for r in done for x in r.itls]),
        "e2e": percentiles([r.e2e for r in done if r.e2e is not None]),
    }


def print_report(summary: dict, config: dict) -> None:
    print(f"{config['endpoint']} at {config['base_url']}: {summary['completed']} ok, {summary['failed']} failed, "
          f"concurrency {config['max_concurrency'] or 'unbounded'}, rate {config['request_rate']} req/s")
    print(f"  duration          {summary['duration_s']:10.2f} s")
    print(f"  requests/s        {summary['request_throughput']:10.2f}")
    print(f"  output tokens/s   {summary['output_throughput']:10.1f}")
    print(f"  total tokens/s    {summary['total_token_throughput']:10.1f}")
    for name in ("ttft", "itl", "e2e"):
        s = summary[name]
        if s["mean_ms"] is None:
            continue
        print(f"  {name.upper():5} ms  mean {s['mean_ms']:9.1f}  p50 {s['p50_ms']:9.1f}  p90 {s['p90_ms']:9.1f}  "
              f"p99 {s['p99_ms']:9.1f}")
    for error in summary["errors"]:
        print(f"  error: {error}")


def sampling_fields(args) -> dict:
    """The request body's sampling fields: greedy unless asked; top_k (a vLLM-style extension) only if set."""
    fields = {"temperature": args.temperature}
    if args.top_p is not None:
        fields["top_p"] = args.top_p
    if args.top_k is not None:
        fields["top_k"] = args.top_k
    return fields


def _target(args, base_url: str, model: str | None) -> Target:
    chat = args.endpoint == "chat"
    return Target(url=base_url.rstrip("/") + ("/v1/chat/completions" if chat else "/v1/completions"),
                  model=model, chat=chat, ignore_eos=args.ignore_eos,
                  headers={"Authorization": f"Bearer {args.api_key}"} if args.api_key else {},
                  text_prompts=chat or args.prompt_format == "text", sampling=sampling_fields(args))


def run(args) -> int:
    """Each --base-url at each load point (--max-concurrency values x --request-rate values), in turn."""
    reqs = random_requests(args.num_requests, (args.prompt_min, args.prompt_max), (args.output_min, args.output_max),
                           args.vocab_size, seed=args.workload_seed)
    models = args.model if len(args.model) == len(args.base_url) else args.model * len(args.base_url)
    labels = args.label or [u.split("://", 1)[-1].rstrip("/") for u in args.base_url]
    outputs, runs, failed = [], [], False
    for base_url, model, label in zip(args.base_url, models, labels):
        target = _target(args, base_url, model)
        if args.warmup:
            asyncio.run(run_load(reqs[:1], target, math.inf, 1, 0, args.timeout, False))
        for concurrency in args.max_concurrency:
            for rate in args.request_rate:
                results, wall = asyncio.run(run_load(reqs, target, rate, concurrency, args.workload_seed,
                                                     args.timeout, not args.no_progress))
                summary = summarize(results, wall)
                failed |= summary["failed"] > 0
                point = {**vars(args), "base_url": base_url, "model": model, "max_concurrency": concurrency,
                         "request_rate": rate}
                config = {k: (str(v) if isinstance(v, float) and math.isinf(v) else v) for k, v in point.items()
                          if k not in ("func", "api_key", "command", "bench_command", "report", "label")}
                outputs.append({"config": config, **summary})
                if args.report:
                    runs.append(Run(label, concurrency, rate, summary, [r.ttft for r in results if r.ok and r.ttft],
                                    [x for r in results if r.ok for x in r.itls]))
                if not args.json:
                    print_report(summary, config)
    if args.json:
        print(json.dumps(outputs[0] if len(outputs) == 1 else {"runs": outputs}, indent=2))
    if args.report:
        workload = {"requests": args.num_requests, "prompt tokens": f"{args.prompt_min}-{args.prompt_max}",
                    "output tokens": f"{args.output_min}-{args.output_max}", "seed": args.workload_seed,
                    "endpoint": args.endpoint}
        path = write_report(runs, Path(args.report), workload)
        print(f"report: {path}", file=sys.stderr)
    return 1 if failed else 0


def add_parser(bench_sub) -> None:
    p = bench_sub.add_parser("serve", help="load-test any OpenAI-compatible server over HTTP (streaming)")
    p.add_argument("--base-url", required=True, nargs="+",
                   help="e.g. http://127.0.0.1:8000 (without /v1); several: each is run in turn, side by side in --report")
    p.add_argument("--model", nargs="+", default=[None],
                   help="model name to send (default: none, the server's default); one, or one per --base-url")
    p.add_argument("--label", nargs="+", default=None, help="a name per --base-url for the report (default: host:port)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-min", type=int, default=128)
    p.add_argument("--prompt-max", type=int, default=128)
    p.add_argument("--output-min", type=int, default=128)
    p.add_argument("--output-max", type=int, default=128)
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=32000, help="token ids are drawn below this (token-id prompts)")
    p.add_argument("--prompt-format", choices=["ids", "text"], default="ids",
                   help="send token ids (exact lengths) or words (for servers without token-id prompts)")
    p.add_argument("--request-rate", type=float, nargs="+", default=[math.inf],
                   help="Poisson arrival rate in req/s (inf: all now); several values: one run each")
    p.add_argument("--max-concurrency", type=int, nargs="+", default=[None],
                   help="most requests in flight at once; several values: one run each")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling: send top_p")
    p.add_argument("--top-k", type=int, default=None, help="send top_k (a vLLM-style extension)")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="ask the server to generate exactly max_tokens (default on)")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="send one request before timing")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", action="store_true", help="print the results as JSON (several runs: {\"runs\": [...]})")
    add_report_argument(p, "throughput against the load, TTFT and ITL distributions, the servers side by side")
    p.set_defaults(func=_validated_run)


def _validated_run(args) -> int:
    if args.num_requests < 1:
        raise ValueError(f"--num-requests {args.num_requests} must be >= 1")
    if any(c is not None and c < 1 for c in args.max_concurrency):
        raise ValueError(f"--max-concurrency {args.max_concurrency} must be >= 1")
    if not all(r > 0 for r in args.request_rate):
        raise ValueError(f"--request-rate {args.request_rate} must be > 0 (inf: send all at once)")
    if len(args.model) not in (1, len(args.base_url)):
        raise ValueError(f"--model: give one name or one per --base-url ({len(args.base_url)})")
    if args.label is not None and len(args.label) != len(args.base_url):
        raise ValueError(f"--label: give one per --base-url ({len(args.base_url)})")
    if not args.temperature >= 0:
        raise ValueError(f"--temperature {args.temperature} must be >= 0")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p {args.top_p} must be in (0, 1]")
    return run(args)

