"""The FastAPI app: thin routes over the endpoint modules, one engine client per app.

The app binds its port before the model loads: /health answers 503 until the engine thread is
ready (seconds), then 200. If the engine loop dies (a failure that is not one request's), every
waiting request gets an error and ``kvserve serve`` exits non-zero, for its supervisor to restart.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvserve.config import EngineConfig
from kvserve.entrypoints.openai.chat import create_chat_completion
from kvserve.entrypoints.openai.completions import create_completion
from kvserve.entrypoints.openai.errors import error_response, install_error_handlers
from kvserve.entrypoints.openai.guard import DEFAULT_MAX_REQUEST_BYTES, RequestGuard
from kvserve.entrypoints.openai.models import list_models
from kvserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from kvserve.entrypoints.openai.reasoning import REASONING_PARSERS
from kvserve.entrypoints.openai.schema import install_openapi
from kvserve.entrypoints.openai.serving import ClientDisconnected, ServerState
from kvserve.entrypoints.openai.tokenize import detokenize, tokenize
from kvserve.entrypoints.openai.tool_parsers import PARSERS as TOOL_PARSERS
from kvserve.entrypoints.web import routes as web
from kvserve.frontend.client import AsyncEngineClient, IncomingRequests
from kvserve.metrics.prometheus import CONTENT_TYPE, PrometheusMetrics
from kvserve.metrics.stats import StatsCollector
from kvserve.metrics.totals import FanOut, Totals
from kvserve.types import VERSION

logger = logging.getLogger("kvserve.server")


@dataclass(frozen=True)
class ServerOptions:
    """HTTP-side options (the engine's live in EngineConfig)."""

    model_names: tuple[str, ...]
    api_key: str | None = None
    max_queue: int = 1024
    address: str = ""  # for the ready log line only
    freeze_gc: bool = False  # the process is this server's alone: see AsyncEngineClient
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    metrics_require_key: bool = False  # /metrics needs the API key too
    tool_call_parser: str | None = None  # None: chosen from the model's chat template
    reasoning_parser: str | None = None  # "think": <think>...</think> goes to reasoning_content

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"--tool-call-parser {self.tool_call_parser!r} must be one of {', '.join(TOOL_PARSERS)}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser {self.reasoning_parser!r} must be one of "
                             f"{', '.join(REASONING_PARSERS)}")
        if not self.model_names or any(not n for n in self.model_names):
            raise ValueError(f"served model names {self.model_names!r} must be non-empty strings")
        if self.max_queue < 1:
            raise ValueError(f"max_queue={self.max_queue} must be >= 1")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes={self.max_request_bytes} must be >= 1024")


def _state(request: Request) -> ServerState:
    return request.app.state.kvserve


v1 = APIRouter(prefix="/v1")  # the key is checked by RequestGuard, before the body is read
plain = APIRouter()


@v1.post("/completions")
async def completions(req: CompletionRequest, request: Request) -> Response:
    try:
        return await create_completion(req, _state(request), request)
    except ClientDisconnected:
        return Response(status_code=499)


@v1.post("/chat/completions")
async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
    try:
        return await create_chat_completion(req, _state(request), request)
    except ClientDisconnected:
        return Response(status_code=499)


@v1.get("/models")
async def models(request: Request) -> JSONResponse:
    state = _state(request)
    info = state.client.info
    return JSONResponse(list_models(state.model_names, state.created, info.max_model_len if info else None))


@plain.post("/tokenize")
async def tokenize_route(req: TokenizeRequest, request: Request) -> JSONResponse:
    return JSONResponse(await tokenize(req, _state(request)))


@plain.post("/detokenize")
async def detokenize_route(req: DetokenizeRequest, request: Request) -> JSONResponse:
    return JSONResponse(await detokenize(req, _state(request)))


@plain.get("/health")
async def health(request: Request) -> Response:
    client = _state(request).client
    if client.is_healthy:
        return JSONResponse({"status": "ok"})
    reason = "the model is loading" if client.error is None and not client.is_ready else "the engine is not running"
    return error_response(503, reason)


@plain.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE)


@plain.get("/version")
async def version() -> JSONResponse:
    return JSONResponse({"version": VERSION})


class CountIncoming:
    """ASGI middleware: counts each generation request from the moment the server takes it in until
    its handler has submitted it (serving.submit_all) or it is answered, so that an idle engine can
    wait for the rest of a burst whose bodies are still being parsed (frontend/client.py)."""

    PATHS = ("/v1/completions", "/v1/chat/completions")

    def __init__(self, app, incoming: IncomingRequests) -> None:
        self.app = app
        self.incoming = incoming

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in self.PATHS:
            await self.app(scope, receive, send)
            return
        arrival = self.incoming.arrived()
        scope.setdefault("state", {})["arrival"] = arrival
        try:
            await self.app(scope, receive, send)
        finally:
            arrival.handed_over()


def build_app(config: EngineConfig, options: ServerOptions,
              on_fatal: Callable[[BaseException], None] | None = None) -> FastAPI:
    """An app with its own engine client and metrics registry; the engine starts with the app.
    ``on_fatal``: see AsyncEngineClient (``kvserve serve`` stops the server and exits non-zero)."""
    metrics = PrometheusMetrics(options.model_names[0])
    totals = Totals()  # for the live dashboard
    client = AsyncEngineClient(config, options.max_queue, StatsCollector(FanOut(metrics, totals)), options.freeze_gc,
                               on_fatal)
    state = ServerState(client, list(options.model_names), metrics,
                        tool_call_parser=options.tool_call_parser, reasoning_parser=options.reasoning_parser)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        client.start()
        ready_log = asyncio.ensure_future(_log_when_ready(client, options))
        yield
        ready_log.cancel()
        state.close()
        await asyncio.to_thread(client.shutdown)

    app = FastAPI(title="kvserve", version=VERSION, lifespan=lifespan)
    app.state.kvserve = state
    install_error_handlers(app)
    install_openapi(app, options.api_key is not None, options.metrics_require_key)
    # Added last, so outermost: a request is counted while its body is being read.
    app.add_middleware(RequestGuard, api_key=options.api_key, max_bytes=options.max_request_bytes,
                       protect_metrics=options.metrics_require_key)
    app.add_middleware(CountIncoming, incoming=client.incoming)
    app.include_router(v1)
    app.include_router(plain)
    app.state.kvserve_web = web.WebState(client, totals)
    app.include_router(web.pages)
    app.include_router(web.api)  # under /v1: RequestGuard checks the key
    app.mount("/static", web.static_files(), name="static")
    return app


async def _log_when_ready(client: AsyncEngineClient, options: ServerOptions) -> None:
    try:
        info = await client.wait_ready()
    except Exception as e:  # noqa: BLE001 - already logged by the engine thread; health says the rest
        logger.error("the engine failed to start: %s", e)
        return
    logger.info("kvserve ready on %s: model %s, context %d tokens, KV cache %d tokens (%d blocks x %d)",
                options.address, options.model_names[0], info.max_model_len, info.kv_cache_tokens,
                info.kv_cache_blocks, info.block_size)
