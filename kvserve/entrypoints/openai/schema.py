"""The OpenAPI schema as the server really answers: FastAPI's, with the status codes and media types
corrected. FastAPI documents 422 for a body it cannot validate (kvserve answers 400), JSON for every
200 (streams are text/event-stream, /metrics text/plain), and none of the 401/404/413/429/503 that the
guard and the endpoints send."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from kvserve.entrypoints.openai.guard import TOKEN_PATHS

_ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}
ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "integer", "null"]}}}},
}
_WHY = {400: "Invalid request: the message names the field (param)", 401: "Missing or wrong API key",
        404: "No such model (param: model) or route", 405: "Method not allowed", 408: "The body did not arrive",
        413: "Body larger than --max-request-bytes", 429: "More waiting than --max-queue: retry later",
        500: "A step failed for this request alone (the server carries on)",
        503: "The model is loading, or the server is shutting down"}
_GENERATION = ("/v1/completions", "/v1/chat/completions")


def _error(status: int) -> dict:
    return {"description": _WHY[status], "content": {"application/json": {"schema": _ERROR_REF}}}


def truthful_openapi(app: FastAPI, api_key: bool, metrics_require_key: bool) -> dict:
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.setdefault("components", {})
    components.setdefault("schemas", {})["ErrorResponse"] = ERROR_SCHEMA
    for name in ("HTTPValidationError", "ValidationError"):
        components["schemas"].pop(name, None)
    if api_key:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, operations in schema["paths"].items():
        keyed = api_key and (path.startswith("/v1/") or path in TOKEN_PATHS
                             or (path == "/metrics" and metrics_require_key))
        for method, op in operations.items():
            responses = op["responses"]
            responses.pop("422", None)
            codes = [405]
            if keyed:
                op["security"] = [{"bearer": []}]
                codes.append(401)
            if method in ("post", "put", "patch"):
                codes += [400, 408, 413]
            if path in _GENERATION:
                codes += [404, 429, 500, 503]
                responses["200"]["content"]["text/event-stream"] = {
                    "schema": {"type": "string", "description": "server-sent events (stream=true): 'data: "
                               "<chunk JSON>' lines, an error event if the request fails midway, then 'data: [DONE]'"}}
            if path in TOKEN_PATHS:
                codes += [404, 503]
            if path == "/metrics":
                responses["200"]["content"] = {"text/plain": {"schema": {"type": "string"}}}
            if path == "/health":
                codes.append(503)
            for status in codes:
                responses.setdefault(str(status), _error(status))
    return schema


def install_openapi(app: FastAPI, api_key: bool, metrics_require_key: bool) -> None:
    cached: dict = {}

    def openapi() -> dict:
        if not cached:
            cached.update(truthful_openapi(app, api_key, metrics_require_key))
        return cached

    app.openapi = openapi
