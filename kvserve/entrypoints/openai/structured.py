"""Structured outputs as the API spells them -> the engine's ``StructuredOutputs``.

Clients send one of: OpenAI's ``response_format`` (``json_object``, or ``json_schema`` with or
without ``strict``: kvserve always enforces the schema), vLLM's ``structured_outputs`` object, or
the older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` fields. More
than one is a 400, as is a spec that does not compile; either names the field the client used.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.entrypoints.openai.errors import APIError, bad_request
from kvserve.entrypoints.openai.protocol import SamplingRequest
from kvserve.types import StructuredOutputs

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_ENGINE_PREFIX = "structured_outputs "


@dataclass(frozen=True)
class Requested:
    """A request's constraint and the API field it came from (for error messages)."""

    spec: StructuredOutputs
    field: str


def requested_structure(req: SamplingRequest) -> Requested | None:
    """The request's structured-output constraint, or None for free text."""
    given: list[tuple[str, dict]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        given.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise bad_request("response_format of type json_schema needs json_schema.schema", "response_format")
        given.append(("response_format", {"json": fmt.json_schema.schema_}))
    if req.structured_outputs is not None:
        fields = req.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        if fields.get("json_object") is False:
            del fields["json_object"]
        given.append(("structured_outputs", fields))
    for name, kind in _GUIDED.items():
        value = getattr(req, name)
        if value is not None:
            given.append((name, {kind: value}))
    if not given:
        return None
    if len(given) > 1:
        names = [name for name, _ in given]
        raise bad_request(f"give at most one of {', '.join(names)}", names[1])
    field, fields = given[0]
    try:
        return Requested(StructuredOutputs(**fields), field)
    except ValueError as e:
        raise as_api_error(e, field) from None


def as_api_error(error: ValueError, field: str) -> APIError:
    """An engine error about structured outputs, worded with the field the client used."""
    message = str(error)
    message = message.split(": ", 1)[1] if message.startswith("prompts[") and ": " in message else message
    message = message.removeprefix(_ENGINE_PREFIX) if field != "structured_outputs" else message
    return bad_request(f"{field}: {message}", field)


def is_structure_error(error: ValueError) -> bool:
    return str(error).startswith("structured_outputs")
