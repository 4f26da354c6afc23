"""Routes of the browser side: the two pages, their static files, and the dashboard's event stream.

``pages`` needs no API key (the pages hold no data; they ask for the key when the API answers 401);
``api`` sits under /v1, where the app's RequestGuard checks the key.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from importlib.resources import files

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles

from kvserve.entrypoints.web.sampler import MAX_INTERVAL_S, MIN_INTERVAL_S, Sampler
from kvserve.frontend.client import AsyncEngineClient
from kvserve.metrics.totals import Totals

STATIC_DIR = files("kvserve.entrypoints.web") / "static"


@dataclass(frozen=True)
class WebState:
    client: AsyncEngineClient
    totals: Totals


pages = APIRouter(include_in_schema=False)
api = APIRouter(prefix="/v1", include_in_schema=False)  # an endless stream: no schema tests


def static_files() -> StaticFiles:
    return StaticFiles(directory=str(STATIC_DIR))


@pages.get("/")
async def playground() -> FileResponse:
    return FileResponse(str(STATIC_DIR / "playground.html"), headers={"Cache-Control": "no-cache"})


@pages.get("/dashboard")
async def dashboard() -> FileResponse:
    return FileResponse(str(STATIC_DIR / "dashboard.html"), headers={"Cache-Control": "no-cache"})


@api.get("/engine/events")
async def engine_events(request: Request, interval: float = Query(0.5, gt=0, le=MAX_INTERVAL_S)) -> StreamingResponse:
    """Server-sent events, one ``data:`` JSON sample per interval (at least MIN_INTERVAL_S) until the
    client goes away; while any stream is open the engine also publishes its KV block map."""
    web: WebState = request.app.state.kvserve_web
    interval = max(interval, MIN_INTERVAL_S)

    async def events():
        client = web.client
        client.watch()
        try:
            sampler = Sampler(client, web.totals)
            info = client.info
            head = {"kv_cache_blocks": info.kv_cache_blocks if info else None,
                    "block_size": info.block_size if info else None, "interval_s": interval}
            yield f"event: info\ndata: {json.dumps(head)}\n\n"
            while True:
                await asyncio.sleep(interval)
                if client.info is not None and head["kv_cache_blocks"] is None:
                    head = {**head, "kv_cache_blocks": client.info.kv_cache_blocks,
                            "block_size": client.info.block_size}
                    yield f"event: info\ndata: {json.dumps(head)}\n\n"
                yield f"data: {json.dumps(sampler.next())}\n\n"
        finally:
            client.unwatch()

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
