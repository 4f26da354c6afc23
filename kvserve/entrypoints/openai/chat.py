"""``POST /v1/chat/completions``: messages -> the model's chat template -> an assistant reply."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import jinja2
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvserve.entrypoints.openai import serving
from kvserve.entrypoints.openai.errors import bad_request
from kvserve.entrypoints.openai.models import resolve_model
from kvserve.entrypoints.openai.protocol import ChatCompletionRequest
from kvserve.entrypoints.openai.serving import ServerState, TokenText
from kvserve.frontend.client import ModelInfo
from kvserve.types import RequestOutput, TokenLogprob

# Engine field names as the chat API calls them, for 400s that name the right field.
_RENAMES = {"logprobs": "top_logprobs", "max_tokens": "max_completion_tokens"}


@dataclass
class _Job:
    request_id: str
    model: str
    created: int
    req: ChatCompletionRequest


async def create_chat_completion(req: ChatCompletionRequest, state: ServerState, request: Request) -> Response:
    model = resolve_model(req.model, state.model_names)
    info = state.client.ready_info()
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs=true", "top_logprobs")
    prompt = await render_prompt(req, info, state)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = serving.resolve_max_tokens(requested, None, len(prompt), info.max_model_len, "messages", field)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = serving.build_params(req, info, max_tokens, logprobs=logprobs, renames=_RENAMES)
    job = _Job(serving.new_id("chatcmpl"), model, int(time.time()), req)
    streams = serving.submit_all(state.client, job.request_id, [prompt], params, request)
    text_of = state.token_text()
    if req.stream:
        return StreamingResponse(_stream(job, streams, text_of), media_type="text/event-stream")
    out = (await serving.results_unless_disconnected(request, streams))[0]
    return JSONResponse(_response(job, out, text_of))


async def render_prompt(req: ChatCompletionRequest, info: ModelInfo, state: ServerState) -> list[int]:
    """The messages through the model's own chat template, as token ids (the template adds any BOS).
    Their text is checked against the context window first; a long one is rendered off the event loop."""
    if not getattr(info.tokenizer, "chat_template", None):
        raise bad_request("this model has no chat template; use /v1/completions", "messages")
    messages = [{**m.model_dump(exclude_none=True), "content": m.text()} for m in req.messages]
    size = sum(len(m["content"]) for m in messages)
    serving.check_text(info, "".join(m["content"] for m in messages), "messages")

    def render(tokenizer) -> list[int]:
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=req.add_generation_prompt)
        except jinja2.TemplateError as e:
            raise bad_request(f"messages do not fit the model's chat template: {e}", "messages") from None
        return tokenizer.encode(text, add_special_tokens=False)

    ids = await serving.encode_text(state, render, size)
    serving.check_prompt(info, ids, "messages")
    return ids


def _response(job: _Job, out: RequestOutput, text_of: TokenText) -> dict:
    choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                "logprobs": _logprobs(c.logprobs, text_of) if job.req.logprobs else None,
                "finish_reason": c.finish_reason} for c in out.outputs]
    return {"id": job.request_id, "object": "chat.completion", "created": job.created, "model": job.model,
            "choices": choices, "usage": serving.output_usage([out])}


def _logprobs(lps: list[TokenLogprob] | None, text_of: TokenText) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        text = text_of(token_id)
        return {"token": text, "logprob": serving.finite(logprob), "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in lps or []]}


def _stream(job: _Job, streams, text_of: TokenText) -> AsyncIterator[str]:
    """OpenAI's chat stream: a role delta first, content deltas, a closing chunk with finish_reason."""
    tracker = serving.DeltaTracker()

    def chunks_for(_: int, out: RequestOutput):
        for c in out.outputs:
            delta = tracker.take(c.index, c)
            if delta.text or delta.logprobs:
                logprobs = _logprobs(delta.logprobs, text_of) if job.req.logprobs else None
                yield _chunk(job, c.index, {"content": delta.text}, logprobs)
            if delta.finish_reason is not None:
                yield _chunk(job, c.index, {}, finish_reason=delta.finish_reason)

    def usage(final: list[RequestOutput]) -> dict:
        return {**_chunk(job, 0, {}), "choices": [], "usage": serving.output_usage(final)}

    roles = [_chunk(job, index, {"role": "assistant", "content": ""}) for index in range(job.req.n)]
    return serving.event_stream(streams, chunks_for, roles, usage if job.req.include_usage else None)


def _chunk(job: _Job, index: int, delta: dict, logprobs: dict | None = None, finish_reason: str | None = None) -> dict:
    return {"id": job.request_id, "object": "chat.completion.chunk", "created": job.created, "model": job.model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}
