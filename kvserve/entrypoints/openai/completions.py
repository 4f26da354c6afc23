"""``POST /v1/completions``: one or many prompts (text or token ids) -> text, whole or streamed."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvserve.entrypoints.openai import serving
from kvserve.entrypoints.openai.errors import bad_request
from kvserve.entrypoints.openai.models import resolve_model
from kvserve.entrypoints.openai.protocol import CompletionRequest
from kvserve.entrypoints.openai.serving import ServerState, TokenText
from kvserve.entrypoints.openai.structured import requested_structure
from kvserve.frontend.client import ModelInfo
from kvserve.types import CompletionOutput, RequestOutput, TokenLogprob

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


@dataclass
class _Job:
    """One validated completion request, ready to run."""

    request_id: str
    model: str
    created: int
    prompts: list[list[int]]
    req: CompletionRequest


async def create_completion(req: CompletionRequest, state: ServerState, request: Request) -> Response:
    model = resolve_model(req.model, state.model_names)
    info = state.client.ready_info()
    _reject_unsupported(req)
    prompts = await tokenize_prompts(req, info, state)
    longest = max(len(p) for p in prompts)
    max_tokens = serving.resolve_max_tokens(req.max_tokens, DEFAULT_MAX_TOKENS, longest, info, "prompt")
    prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
    params = serving.build_params(req, info, max_tokens, logprobs=req.logprobs, prompt_logprobs=prompt_logprobs,
                                  structure=requested_structure(req))
    job = _Job(serving.new_id("cmpl"), model, int(time.time()), prompts, req)
    streams = serving.submit_all(state.client, job.request_id, prompts, params, request, req.priority)
    text_of = state.token_text(as_ids=req.return_tokens_as_token_ids)
    if req.stream:
        return StreamingResponse(_stream(job, streams, text_of), media_type="text/event-stream")
    outputs = await serving.results_unless_disconnected(request, streams)
    return JSONResponse(_response(job, outputs, text_of))


def _reject_unsupported(req: CompletionRequest) -> None:
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request(f"best_of={req.best_of} is not supported; it must equal n ({req.n})", "best_of")
    if req.echo and req.stream and req.logprobs is not None:
        raise bad_request("echo with logprobs is not supported when streaming", "echo")


async def tokenize_prompts(req: CompletionRequest, info: ModelInfo, state: ServerState) -> list[list[int]]:
    """Normalise the four prompt forms (string, strings, token ids, lists of token ids) to token ids.
    Every text is checked against the context window before any is tokenized, unless the request
    truncates its prompts (then only the body's size limit bounds them)."""
    prompt = req.prompt
    if isinstance(prompt, str):
        prompt = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        prompt = [prompt]
    if not prompt:
        raise bad_request("prompt is empty: give a string, a list of strings, or token ids", "prompt")
    for i, p in enumerate(prompt):
        if isinstance(p, str):
            if not p:
                raise bad_request(f"prompt[{i}] is an empty string", "prompt")
            if req.truncate_prompt_tokens is None:
                serving.check_text(info, p, "prompt")
    out = []
    for p in prompt:
        if isinstance(p, str):
            ids = await serving.run_tokenizer(state, lambda tok, p=p: tok.encode(p, add_special_tokens=True), len(p))
        else:
            ids = list(p)
        out.append(serving.checked_prompt(info, ids, req, "prompt"))
    return out


def _choices(job: _Job, index: int, out: RequestOutput) -> list[tuple[int, CompletionOutput]]:
    return [(index * job.req.n + c.index, c) for c in out.outputs]


def _response(job: _Job, outputs: list[RequestOutput], text_of: TokenText) -> dict:
    choices = []
    for i, out in enumerate(outputs):
        prefix = text_of.tokenizer.decode(out.prompt_token_ids) if job.req.echo else ""
        for index, c in _choices(job, i, out):
            logprobs = None
            if job.req.logprobs is not None:
                prompt_lps = out.prompt_logprobs if job.req.echo else None
                logprobs = completion_logprobs(out.prompt_token_ids if job.req.echo else [], prompt_lps,
                                               c.logprobs or [], text_of, 0)
            choices.append({"index": index, "text": prefix + c.text, "logprobs": logprobs,
                            "finish_reason": c.finish_reason})
    choices.sort(key=lambda c: c["index"])
    return {"id": job.request_id, "object": "text_completion", "created": job.created, "model": job.model,
            "choices": choices, "usage": serving.output_usage(outputs)}


def completion_logprobs(prompt_ids: list[int], prompt_lps: list[TokenLogprob | None] | None,
                        lps: list[TokenLogprob], text_of: TokenText, offset: int) -> dict:
    """The legacy completions logprobs object; echoed prompt tokens come first (the very first has none)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    entries: list[tuple[int, TokenLogprob | None]] = list(zip(prompt_ids, prompt_lps or [None] * len(prompt_ids)))
    entries += [(lp.token_id, lp) for lp in lps]
    for token_id, lp in entries:
        text = text_of(token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        token_lps.append(None if lp is None else serving.finite(lp.logprob))
        tops.append(None if lp is None else {text_of(t): serving.finite(v) for t, v in lp.top})
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _stream(job: _Job, streams, text_of: TokenText) -> AsyncIterator[str]:
    """SSE chunks: each choice's new text (prompt first if echo), the finish reason on its last chunk."""
    tracker = serving.DeltaTracker()

    def chunks_for(i: int, out: RequestOutput):
        for index, c in _choices(job, i, out):
            chunk = _delta_chunk(job, out, index, tracker.take(index, c), text_of)
            if chunk is not None:
                yield chunk

    def usage(final: list[RequestOutput]) -> dict:
        return _chunk(job, [], serving.output_usage(final))

    running = sum(len(p) for p in job.prompts) if job.req.continuous_usage else None
    return serving.event_stream(streams, chunks_for, usage_chunk=usage if job.req.include_usage else None,
                                running_prompt_tokens=running)


def _delta_chunk(job: _Job, out: RequestOutput, index: int, delta: serving.Delta, text_of: TokenText) -> dict | None:
    text = delta.text
    if delta.first and job.req.echo:
        text = text_of.tokenizer.decode(out.prompt_token_ids) + text
    if delta.is_empty and not text:
        return None
    logprobs = None
    if job.req.logprobs is not None:
        logprobs = completion_logprobs([], None, delta.logprobs, text_of, delta.text_start)
    return _chunk(job, [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": delta.finish_reason}])


def _chunk(job: _Job, choices: list[dict], usage: dict | None = None) -> dict:
    chunk = {"id": job.request_id, "object": "text_completion", "created": job.created, "model": job.model,
             "choices": choices}
    if usage is not None:
        chunk["usage"] = usage
    return chunk
