"""The HTTP edge, before any route runs: the API key is checked before a byte of the body is read,
and a body is read whole (within a size limit and a deadline) before the app sees it.

A request without the key was read in full before (a 300 MB body cost 0.6 GB of memory that was
never returned), and a Content-Length with no body behind it held a connection open with no reply.
"""

from __future__ import annotations

import asyncio
import hmac
import json

DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20  # --max-request-bytes
BODY_TIMEOUT_S = 30.0  # the whole body must arrive within this, or the request gets 408
_BODY_METHODS = ("POST", "PUT", "PATCH")
TOKEN_PATHS = ("/tokenize", "/detokenize")  # vLLM's paths (not under /v1), behind the key all the same


class RequestGuard:
    """ASGI middleware: 401 without the key on protected paths, 413 for a body over ``max_bytes``
    (by its Content-Length at once, or as it arrives), 408 for a body that does not arrive."""

    def __init__(self, app, api_key: str | None, max_bytes: int, protect_metrics: bool = False) -> None:
        self.app, self.api_key, self.max_bytes, self.protect_metrics = app, api_key, max_bytes, protect_metrics

    def protects(self, path: str) -> bool:
        return self.api_key is not None and (path == "/v1" or path.startswith("/v1/") or path in TOKEN_PATHS
                                             or (self.protect_metrics and path == "/metrics"))

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.protects(scope["path"]):
            problem = _key_problem(headers.get("authorization", ""), self.api_key)
            if problem is not None:
                await _reply(send, 401, problem, code="invalid_api_key")
                return
        if scope["method"] in _BODY_METHODS:
            length = headers.get("content-length")
            if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
                status = 400 if not length.isdigit() else 413
                await _reply(send, status, _too_large(self.max_bytes) if status == 413
                             else f"Content-Length {length[:40]!r} is not a number of bytes")
                return
            try:
                body = await asyncio.wait_for(_read_body(receive, self.max_bytes), BODY_TIMEOUT_S)
            except asyncio.TimeoutError:
                await _reply(send, 408, f"the request body did not arrive within {BODY_TIMEOUT_S:.0f} s")
                return
            if body is None:
                await _reply(send, 413, _too_large(self.max_bytes))
                return
            receive = _replay(body, receive)
        await self.app(scope, receive, send)


def _key_problem(header: str, key: str) -> str | None:
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return "missing API key: send the header 'Authorization: Bearer <key>'"
    if not hmac.compare_digest(token.strip().encode("utf-8", "surrogateescape"), key.encode()):
        return "invalid API key"
    return None


def _too_large(limit: int) -> str:
    return f"the request body is larger than this server accepts ({limit} bytes, --max-request-bytes)"


async def _read_body(receive, limit: int) -> bytes | None:
    """The whole body, or None as soon as it grows past ``limit`` (or the client leaves: b'')."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b""
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive):
    """A receive that hands the app the body already read, then whatever the client sends next."""
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


async def _reply(send, status: int, message: str, code: str | None = None) -> None:
    """An OpenAI error JSON; the connection closes after it (the body may be unread)."""
    from kvserve.entrypoints.openai.errors import error_body  # lazily: serve_cli imports this module

    payload = json.dumps(error_body(status, message, code=code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
               (b"connection", b"close")]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
