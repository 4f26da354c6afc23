"""Served model names: ``GET /v1/models`` and the check that a request names one of them."""

from __future__ import annotations

from pathlib import Path

from kvserve.entrypoints.openai.errors import APIError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_served_name(model: str | None) -> str:
    """What clients call the model when ``--served-model-name`` is not given."""
    if model is None:
        return DEFAULT_MODEL_NAME
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else (path.name or model)


def resolve_model(requested: str | None, served: list[str]) -> str:
    """The served name a request refers to; None means the first one. Unknown names are a 404."""
    if requested is None:
        return served[0]
    if requested not in served:
        raise APIError(404, f"the model {requested!r} does not exist; this server serves {served}", param="model",
                       code="model_not_found")
    return requested


def list_models(served: list[str], created: int, max_model_len: int | None) -> dict:
    data = [{"id": name, "object": "model", "created": created, "owned_by": "kvserve", "root": served[0],
             "parent": None, "max_model_len": max_model_len} for name in served]
    return {"object": "list", "data": data}
