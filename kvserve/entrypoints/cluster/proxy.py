"""The front end of a set of replicas: one OpenAI-compatible address, each request sent to one replica.

A request is routed by its prompt's leading tokens (router.py) and relayed as the replica sends it,
so streams come back token by token and a client that goes away closes the replica's connection,
which aborts the request there. A replica that fails before it has sent anything is marked down
and the request is tried once more elsewhere; one that fails mid-stream ends the stream with an
error event and ``[DONE]``. A health loop marks replicas down and up again as /health answers.
Every answer names its replica in ``x-kvserve-replica``; each replica's KV pool size, read from
its /metrics at start and again whenever it comes back up (restarted, perhaps with another pool),
sizes the router's picture of its cache.
``/metrics`` merges the replicas' metrics under a ``replica`` label, with the router's own; the
playground and the dashboard are served here too, the dashboard with one panel per replica (events.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvserve.entrypoints.cluster.events import EventsRelay
from kvserve.entrypoints.cluster.router import Router
from kvserve.entrypoints.openai.errors import error_body, error_response
from kvserve.entrypoints.openai.guard import DEFAULT_MAX_REQUEST_BYTES, RequestGuard
from kvserve.entrypoints.web.routes import pages, static_files
from kvserve.entrypoints.web.sampler import MAX_INTERVAL_S, MIN_INTERVAL_S
from kvserve.types import VERSION

logger = logging.getLogger("kvserve.cluster")

HEALTH_INTERVAL_S = 1.0
ROUTING_TEXT_CHARS = 32_768  # the prompt's head is all prefix routing needs; bounds the tokenizing
REPLICA_HEADER = "x-kvserve-replica"  # on every relayed answer: which replica served it
_HOP_HEADERS = {"host", "content-length", "connection", "transfer-encoding"}


class Cluster:
    """The replicas as the front end sees them: URLs, health, the router, routed-request counters."""

    def __init__(self, replicas: list, router: Router, tokenizer, api_key: str | None) -> None:
        self.replicas, self.router, self.tokenizer, self.api_key = replicas, router, tokenizer, api_key
        self.routed = [0] * len(replicas)
        self.kv_blocks: list[int | None] = [None] * len(replicas)  # each replica's KV pool, from its /metrics
        self.retries = 0
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))

    # ---- routing --------------------------------------------------------------------------------
    def routing_tokens(self, path: str, payload: dict) -> list[int]:
        """The prompt's leading token ids, as the replica will see them (approximately, for chat)."""
        try:
            if path.endswith("/chat/completions"):
                messages = payload.get("messages") or []
                try:
                    text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
                except Exception:  # a template that rejects these messages: the replica will say why
                    text = json.dumps(messages)
                return self.tokenizer.encode(text[:ROUTING_TEXT_CHARS], add_special_tokens=False)
            prompt = payload.get("prompt")
            if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
                prompt = prompt[0]  # several prompts: route by the first
            if isinstance(prompt, str):
                return self.tokenizer.encode(prompt[:ROUTING_TEXT_CHARS], add_special_tokens=False)
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                return prompt
        except Exception:  # routing is a preference: a malformed body is the replica's to reject
            logger.debug("no routing tokens", exc_info=True)
        return []

    def mark_down(self, replica: int, why: str) -> None:
        if self.router.healthy[replica]:
            logger.warning("replica %d (%s) is down: %s", replica, self.replicas[replica].url, why)
        self.router.mark_down(replica)

    async def replica_metrics(self, replica: int) -> str | None:
        """A replica's /metrics text (with the API key, for replicas that protect it), or None."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            response = await self.client.get(self.replicas[replica].url + "/metrics", headers=headers, timeout=5.0)
        except httpx.HTTPError:
            return None
        return response.text if response.status_code == 200 else None

    async def learn_pools(self) -> None:
        await asyncio.gather(*(self.learn_pool(i) for i in range(len(self.replicas))))

    async def learn_pool(self, replica: int) -> None:
        """Read a replica's KV pool size (blocks) from its /metrics and tell the router."""
        text = await self.replica_metrics(replica)
        blocks = pool_blocks(text) if text is not None else None
        self.kv_blocks[replica] = blocks
        if blocks:
            self.router.set_capacity(replica, blocks)

    # ---- health ---------------------------------------------------------------------------------
    async def check(self, replica: int) -> bool:
        r = self.replicas[replica]
        if not await asyncio.to_thread(r.alive):
            return False
        try:
            return (await self.client.get(r.url + "/health", timeout=2.0)).status_code == 200
        except httpx.HTTPError:
            return False

    async def refresh_health(self) -> None:
        """One round of /health calls: replicas marked down, or up again with their pool read anew."""
        results = await asyncio.gather(*(self.check(i) for i in range(len(self.replicas))))
        for i, ok in enumerate(results):
            if ok and not self.router.healthy[i]:
                logger.info("replica %d is healthy again", i)
                self.router.mark_up(i)
                await self.learn_pool(i)
            elif not ok:
                self.mark_down(i, "/health failed")

    async def health_loop(self) -> None:
        while True:
            await self.refresh_health()
            await asyncio.sleep(HEALTH_INTERVAL_S)

    # ---- relaying -------------------------------------------------------------------------------
    async def forward(self, request: Request, path: str) -> Response:
        body = await request.body()
        try:
            payload = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return error_response(400, f"the request body is not valid JSON: {e}")
        if not isinstance(payload, dict):
            return error_response(400, "the request body must be a JSON object")
        tokens = await asyncio.to_thread(self.routing_tokens, path, payload)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        tried: set[int] = set()
        for attempt in range(2):
            try:
                replica = self.router.choose(tokens, frozenset(tried))
            except LookupError:
                return error_response(503, "no healthy replica to serve the request; retry shortly")
            if attempt:
                self.retries += 1
            tried.add(replica)
            self.routed[replica] += 1
            response = await self._try(replica, path, body, headers, bool(payload.get("stream")))
            if response is not None:
                return response
        return error_response(503, "the replicas that took the request failed before answering; retry")

    async def _try(self, replica: int, path: str, body: bytes, headers: dict, stream: bool) -> Response | None:
        """The replica's answer, or None if it failed before sending anything (the caller retries)."""
        self.router.started(replica)
        url = self.replicas[replica].url + path
        try:
            upstream = await self.client.send(self.client.build_request("POST", url, content=body, headers=headers),
                                              stream=True)
        except httpx.TransportError as e:
            self.router.finished(replica)
            self.mark_down(replica, repr(e))
            return None
        if upstream.status_code == 503:  # the replica's engine is loading or dead
            await upstream.aclose()
            self.router.finished(replica)
            self.mark_down(replica, "it answered 503")
            return None
        media_type = upstream.headers.get("content-type")
        chunks = upstream.aiter_raw()
        try:
            first = await anext(chunks, b"")
            if not stream or not media_type or not media_type.startswith("text/event-stream"):
                rest = [first] + [c async for c in chunks]
                await upstream.aclose()
                self.router.finished(replica)
                return Response(b"".join(rest), status_code=upstream.status_code, media_type=media_type,
                                headers={REPLICA_HEADER: str(replica)})
        except httpx.TransportError as e:  # nothing has reached the client yet
            await upstream.aclose()
            self.router.finished(replica)
            self.mark_down(replica, repr(e))
            return None
        return StreamingResponse(self._relay(replica, upstream, first, chunks), status_code=upstream.status_code,
                                 media_type=media_type, headers={REPLICA_HEADER: str(replica)})

    async def _relay(self, replica: int, upstream: httpx.Response, first: bytes,
                     chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        try:
            yield first
            try:
                async for chunk in chunks:
                    yield chunk
            except httpx.TransportError as e:
                self.mark_down(replica, repr(e))
                error = error_body(503, f"replica {replica} failed mid-stream; the answer is incomplete")
                yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
        finally:
            await upstream.aclose()  # closing early (the client left) aborts the request on the replica
            self.router.finished(replica)

    # ---- metrics --------------------------------------------------------------------------------
    async def metrics_text(self) -> str:
        async def fetch(i: int) -> str:
            return (await self.replica_metrics(i) or "") if self.router.healthy[i] else ""

        texts = await asyncio.gather(*(fetch(i) for i in range(len(self.replicas))))
        return merge_metrics(texts) + self._own_metrics()

    def _own_metrics(self) -> str:
        lines = ["# HELP kvserve:router_requests_total Requests the front end sent to each replica.",
                 "# TYPE kvserve:router_requests_total counter"]
        lines += [f'kvserve:router_requests_total{{replica="{i}"}} {n}' for i, n in enumerate(self.routed)]
        lines += ["# HELP kvserve:router_retries_total Requests retried on another replica after a failure.",
                  "# TYPE kvserve:router_retries_total counter", f"kvserve:router_retries_total {self.retries}",
                  "# HELP kvserve:replica_up Whether each replica answers /health.", "# TYPE kvserve:replica_up gauge"]
        lines += [f'kvserve:replica_up{{replica="{i}"}} {int(ok)}' for i, ok in enumerate(self.router.healthy)]
        lines += ["# HELP kvserve:replica_requests_in_flight Requests the front end is relaying to each replica.",
                  "# TYPE kvserve:replica_requests_in_flight gauge"]
        lines += [f'kvserve:replica_requests_in_flight{{replica="{i}"}} {n}' for i, n in enumerate(self.router.load)]
        return "\n".join(lines) + "\n"


def pool_blocks(metrics_text: str) -> int | None:
    """The blocks in a replica's KV pool, from its Prometheus text (None if it does not say)."""
    for line in metrics_text.splitlines():
        if line.startswith(("kvserve:kv_cache_blocks{", "kvserve:kv_cache_blocks ")):
            return int(float(line.rsplit(" ", 1)[1]))
    return None


def merge_metrics(texts: list[str]) -> str:
    """Prometheus texts of several replicas as one: each sample labelled ``replica="i"``, every
    family's samples together under its HELP/TYPE lines (which the format requires)."""
    families: dict[str, tuple[list[str], list[str]]] = {}
    for i, text in enumerate(texts):
        family = None
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                family = line.split(" ", 3)[2]
                header, _ = families.setdefault(family, ([], []))
                if line not in header:
                    header.append(line)
            elif line and not line.startswith("#") and family is not None:
                families[family][1].append(_with_replica(line, i))
    return "".join("\n".join(header + samples) + "\n" for header, samples in families.values())


def _with_replica(sample: str, replica: int) -> str:
    name_end = min((p for p in (sample.find("{"), sample.find(" ")) if p >= 0), default=len(sample))
    name, rest = sample[:name_end], sample[name_end:]
    label = f'replica="{replica}"'
    if rest.startswith("{}"):
        return f"{name}{{{label}}}{rest[2:]}"
    if rest.startswith("{"):
        return f"{name}{{{label},{rest[1:]}"
    return f"{name}{{{label}}}{rest}"


def build_cluster_app(cluster: Cluster, model_names: tuple[str, ...], max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                      metrics_require_key: bool = False) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await cluster.learn_pools()
        task = asyncio.create_task(cluster.health_loop())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await cluster.client.aclose()

    app = FastAPI(title="kvserve (replicas)", version=VERSION, lifespan=lifespan)

    # the replicas' own edge, in front: the key before the body is read, the body within its limit
    app.add_middleware(RequestGuard, api_key=cluster.api_key, max_bytes=max_request_bytes,
                       protect_metrics=metrics_require_key)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await cluster.forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await cluster.forward(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models() -> Response:
        data = [{"id": name, "object": "model", "owned_by": "kvserve"} for name in model_names]
        return JSONResponse({"object": "list", "data": data})

    @app.get("/v1/engine/events", include_in_schema=False)
    async def engine_events(request: Request, interval: float = Query(0.5, gt=0, le=MAX_INTERVAL_S)) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        relay = EventsRelay(cluster, max(interval, MIN_INTERVAL_S), headers)
        return StreamingResponse(relay.stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    app.include_router(pages)
    app.mount("/static", static_files(), name="static")

    @app.get("/health")
    async def health() -> Response:
        replicas = [{"replica": i, "url": r.url, "healthy": cluster.router.healthy[i],
                     "in_flight": cluster.router.load[i], "kv_blocks": cluster.kv_blocks[i]}
                    for i, r in enumerate(cluster.replicas)]
        return JSONResponse({"replicas": replicas}, status_code=200 if any(cluster.router.healthy) else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await cluster.metrics_text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": VERSION})

    return app
