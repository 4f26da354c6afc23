"""Every failure leaves as OpenAI's error JSON: ``{"error": {"message", "type", "param", "code"}}``.

Bad input is a 4xx whose message names the field; only a bug in kvserve can make a 500.
"""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve.engine.core import RequestFailedError
from kvserve.frontend.client import EngineDeadError, EngineNotReadyError, QueueFullError

logger = logging.getLogger("kvserve.server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          503: "service_unavailable_error", 500: "internal_server_error"}


class APIError(Exception):
    """An error with its HTTP status and the request field (``param``) it is about."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": code or status}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


_FIELD = re.compile(r"^(?:prompts\[\d+\]: )?([a-z_]+)(?:[=\[ ])")


def from_value_error(error: ValueError, renames: dict[str, str] | None = None) -> APIError:
    """An engine ValueError ("top_p=1.5 must be ...") as a 400, its leading field name as ``param``."""
    message = str(error)
    match = _FIELD.match(message)
    param = match.group(1) if match else None
    if param is not None and renames:
        param = renames.get(param, param)
    return APIError(400, message, param)


# Pydantic puts the member of a union it tried into the error location ("prompt", "list[int]", 0).
_UNION_TAG = re.compile(r"^(str|int|float|bool|none)$|\[")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _UNION_TAG.search(str(p))]
    param = ".".join(loc) or None
    more = len(errors) - 1
    suffix = f" (and {more} more problem{'s' if more > 1 else ''})" if more else ""
    return f"{param or 'request body'}: {first.get('msg')}{suffix}", param


def install_error_handlers(app: FastAPI) -> None:
    """Map every exception class a request can raise to its status and error JSON."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(ValueError)
    async def _value_error(_: Request, exc: ValueError) -> JSONResponse:
        err = from_value_error(exc)
        return error_response(400, err.message, err.param)

    @app.exception_handler(QueueFullError)
    async def _queue_full(_: Request, exc: QueueFullError) -> JSONResponse:
        return error_response(429, str(exc), code="rate_limit_exceeded", headers={"Retry-After": "1"})

    @app.exception_handler(RequestFailedError)
    async def _request_failed(_: Request, exc: RequestFailedError) -> JSONResponse:
        return error_response(500, str(exc))

    @app.exception_handler(EngineNotReadyError)
    @app.exception_handler(EngineDeadError)
    async def _unavailable(_: Request, exc: Exception) -> JSONResponse:
        return error_response(503, str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}")
