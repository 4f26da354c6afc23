"""The front end's /v1/engine/events: every replica's dashboard stream, relayed as one, each event
tagged with its replica so that the dashboard draws one panel per replica.

One reader per replica parses that replica's server-sent events and puts them, with a
``"replica": i`` field added, on one queue that the client's stream drains. A replica that is down,
or whose stream breaks, gets a ``down`` event and is read again when the health loop sees it up;
the client's stream ends only when the client goes away (which closes every replica's stream).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import httpx

RETRY_S = 1.0  # how often a reader looks again at a replica that is down


def sse(event: str | None, data: dict) -> str:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data)}\n\n"


async def parse_sse(lines: AsyncIterator[str]) -> AsyncIterator[tuple[str | None, str]]:
    """(event name or None, data) for each event of a text/event-stream's lines."""
    name, data = None, []
    async for line in lines:
        if not line:
            if data:
                yield name, "\n".join(data)
            name, data = None, []
        elif line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))


class EventsRelay:
    """One client's merged stream of the replicas' events."""

    def __init__(self, cluster, interval: float, headers: dict) -> None:
        self.cluster, self.interval, self.headers = cluster, interval, headers
        self.queue: asyncio.Queue[str] = asyncio.Queue(maxsize=256)

    async def stream(self) -> AsyncIterator[str]:
        n = len(self.cluster.replicas)
        yield sse("replicas", {"replicas": n})
        readers = [asyncio.create_task(self._read(i)) for i in range(n)]
        try:
            while True:
                yield await self.queue.get()
        finally:
            for task in readers:
                task.cancel()
            for task in readers:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    async def _put(self, text: str) -> None:
        if self.queue.full():  # a slow client: drop the oldest sample rather than hold up the readers
            self.queue.get_nowait()
        await self.queue.put(text)

    async def _read(self, replica: int) -> None:
        url = f"{self.cluster.replicas[replica].url}/v1/engine/events"
        up = True
        while True:
            if self.cluster.router.healthy[replica]:
                try:
                    async with self.cluster.client.stream("GET", url, params={"interval": self.interval},
                                                          headers=self.headers) as response:
                        if response.status_code != 200:
                            raise httpx.HTTPStatusError(f"{response.status_code}", request=response.request,
                                                        response=response)
                        up = True
                        async for name, data in parse_sse(response.aiter_lines()):
                            body = json.loads(data)
                            await self._put(sse(name, {**body, "replica": replica} if isinstance(body, dict)
                                                else body))
                except (httpx.HTTPError, json.JSONDecodeError):
                    pass  # reported below; the health loop decides whether the replica is down
            if up:
                await self._put(sse("down", {"replica": replica}))
                up = False
            await asyncio.sleep(RETRY_S)
