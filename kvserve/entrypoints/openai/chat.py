"""``POST /v1/chat/completions``: messages -> the model's chat template -> an assistant reply."""

from __future__ import annotations

import inspect
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import jinja2
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from transformers import PreTrainedTokenizerBase

from kvserve.entrypoints.openai import serving
from kvserve.entrypoints.openai.errors import bad_request
from kvserve.entrypoints.openai.models import resolve_model
from kvserve.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage, ChatTemplateFields
from kvserve.entrypoints.openai.reasoning import REASONING_PARSERS, ReasoningStream, ThinkParser
from kvserve.entrypoints.openai.serving import ServerState, TokenText
from kvserve.entrypoints.openai.structured import Requested, as_api_error, requested_structure
from kvserve.entrypoints.openai.tool_parsers import ToolCallStream
from kvserve.entrypoints.openai.tools import ToolSetup, tool_call_id
from kvserve.frontend.client import ModelInfo
from kvserve.types import RequestOutput, TokenLogprob

# Engine field names as the chat API calls them, for 400s that name the right field.
_RENAMES = {"logprobs": "top_logprobs", "max_tokens": "max_completion_tokens"}
# apply_chat_template's own arguments: chat_template_kwargs passes template variables, not these.
_TEMPLATE_ARGUMENTS = frozenset(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters)
_TEMPLATE_ARGUMENTS -= {"self", "kwargs"}


@dataclass
class _Job:
    request_id: str
    model: str
    created: int
    req: ChatCompletionRequest
    tools: ToolSetup | None = None
    reasoning: ThinkParser | None = None


async def create_chat_completion(req: ChatCompletionRequest, state: ServerState, request: Request) -> Response:
    model = resolve_model(req.model, state.model_names)
    info = state.client.ready_info()
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs=true", "top_logprobs")
    tools = ToolSetup.of(req, info.tokenizer, state.tool_call_parser)
    prompt_text, prompt = await render_prompt(req, info, state, tools)
    reasoning = REASONING_PARSERS[state.reasoning_parser](prompt_text) if state.reasoning_parser else None
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = serving.resolve_max_tokens(requested, None, len(prompt), info, "messages", field)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    structure = _structure(req, tools, reasoning)
    params = serving.build_params(req, info, max_tokens, logprobs=logprobs, renames=_RENAMES, structure=structure)
    job = _Job(serving.new_id("chatcmpl"), model, int(time.time()), req, tools, reasoning)
    streams = serving.submit_all(state.client, job.request_id, [prompt], params, request, req.priority)
    text_of = state.token_text(as_ids=req.return_tokens_as_token_ids)
    if req.stream:
        return StreamingResponse(_stream(job, streams, text_of, len(prompt)), media_type="text/event-stream")
    out = (await serving.results_unless_disconnected(request, streams))[0]
    return JSONResponse(_response(job, out, text_of))


def _structure(req: ChatCompletionRequest, tools: ToolSetup | None, reasoning: ThinkParser | None) -> Requested | None:
    """The reply's constraint: the client's structured outputs, or the grammar of a forced tool call;
    with a reasoning parser it applies to the answer after the thinking."""
    structure = requested_structure(req)
    forced = tools.forced_structure() if tools is not None else None
    if structure is not None and forced is not None:
        raise bad_request(f"{structure.field} cannot be combined with tool_choice {req.tool_choice!r}: a forced tool "
                          "call is constrained by its own grammar", "tool_choice")
    structure = structure or forced
    if structure is not None and reasoning is not None:
        try:
            structure = Requested(reasoning.constrain(structure.spec), structure.field)
        except ValueError as e:
            raise as_api_error(e, structure.field) from None
    return structure


async def render_prompt(req: ChatCompletionRequest, info: ModelInfo, state: ServerState,
                        tools: ToolSetup | None = None) -> tuple[str, list[int]]:
    """``render_messages``, with the messages' text checked against the context window first (unless
    the request truncates its prompt) and the token ids after."""
    if req.truncate_prompt_tokens is None:
        serving.check_text(info, "".join(m.text() for m in req.messages), "messages")
    text, ids = await render_messages(req, info, state, tools)
    return text, serving.checked_prompt(info, ids, req, "messages")


async def render_messages(req: ChatTemplateFields, info: ModelInfo, state: ServerState,
                          tools: ToolSetup | None = None, add_special_tokens: bool = False) -> tuple[str, list[int]]:
    """The messages through the model's own chat template (with the tools, when the reply may call
    them): the prompt text and its token ids (the template writes any BOS; ``add_special_tokens``
    has the tokenizer add its own too). A long one is rendered off the event loop."""
    if not getattr(info.tokenizer, "chat_template", None):
        raise bad_request("this model has no chat template: use /v1/completions, or start the server with "
                          "--chat-template", "messages")
    messages = [template_message(m) for m in req.messages]
    extra = req.chat_template_kwargs or {}
    if taken := sorted(_TEMPLATE_ARGUMENTS & extra.keys()):
        raise bad_request(f"chat_template_kwargs cannot set {', '.join(taken)}: they are the request's own or the "
                          "renderer's", "chat_template_kwargs")
    kwargs = {**extra, "add_generation_prompt": req.add_generation_prompt,
              "continue_final_message": req.continue_final_message}
    if tools is not None and tools.offered:
        kwargs["tools"] = tools.tools
    rendered: list[str] = []

    def render(tokenizer) -> list[int]:
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        except (jinja2.TemplateError, ValueError) as e:  # ValueError: the final message to continue is not there
            raise bad_request(f"messages do not fit the model's chat template: {e}", "messages") from None
        rendered.append(text)
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)

    ids = await serving.run_tokenizer(state, render, sum(len(m["content"] or "") for m in messages))
    return rendered[0], ids


def template_message(m: ChatMessage) -> dict:
    """A message as chat templates read it: text content, and earlier tool calls' arguments as
    objects (templates write them with ``tojson``; OpenAI sends them as JSON text)."""
    out = {**m.model_dump(exclude_none=True), "content": m.text()}
    calls = out.get("tool_calls")
    if isinstance(calls, list):
        fixed = []
        for call in calls:
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                try:
                    fn = {**fn, "arguments": json.loads(fn["arguments"])}
                except json.JSONDecodeError:
                    raise bad_request("messages: a tool call's function.arguments is not valid JSON",
                                      "messages") from None
                call = {**call, "function": fn}
            fixed.append(call)
        out["tool_calls"] = fixed
    return out


def _message(job: _Job, text: str) -> tuple[dict, bool]:
    """The assistant message of a finished choice, and whether it holds tool calls."""
    message: dict = {"role": "assistant"}
    if job.reasoning is not None:
        split = job.reasoning.split(text, final=True)
        message["reasoning_content"], text = split.reasoning, split.content
    if job.tools is None or not job.tools.parses:
        message["content"] = text
        return message, False
    parsed = job.tools.parser.parse(text, final=True)
    calls = parsed.calls if job.req.parallel_tool_calls else parsed.calls[:1]
    if not calls:
        message["content"] = text
        return message, False
    message["content"] = parsed.content or None
    message["tool_calls"] = [{"id": tool_call_id(), "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
    return message, True


def _response(job: _Job, out: RequestOutput, text_of: TokenText) -> dict:
    choices = []
    for c in out.outputs:
        message, called = _message(job, c.text)
        choices.append({"index": c.index, "message": message,
                        "logprobs": _logprobs(c.logprobs, text_of) if job.req.logprobs else None,
                        "finish_reason": "tool_calls" if called else c.finish_reason})
    return {"id": job.request_id, "object": "chat.completion", "created": job.created, "model": job.model,
            "choices": choices, "usage": serving.output_usage([out])}


def _logprobs(lps: list[TokenLogprob] | None, text_of: TokenText) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        text = text_of(token_id)
        return {"token": text, "logprob": serving.finite(logprob), "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in lps or []]}


class _ChoiceStream:
    """One choice's text -> its message deltas: reasoning first, then content or tool calls."""

    def __init__(self, job: _Job) -> None:
        self.reasoning = ReasoningStream(job.reasoning) if job.reasoning is not None else None
        tools = job.tools if job.tools is not None and job.tools.parses else None
        self.tools = ToolCallStream(tools.parser, job.req.parallel_tool_calls, tool_call_id) if tools else None
        self.sent_content = 0

    def deltas(self, text: str, final: bool) -> list[dict]:
        out = []
        content = text
        if self.reasoning is not None:
            new, content = self.reasoning.update(text, final)
            if new:
                out.append({"reasoning_content": new})
        if self.tools is not None:
            return out + self.tools.update(content, final)
        if len(content) > self.sent_content:
            out.append({"content": content[self.sent_content:]})
            self.sent_content = len(content)
        return out

    @property
    def called(self) -> bool:
        return self.tools is not None and self.tools.has_calls


def _stream(job: _Job, streams, text_of: TokenText, prompt_tokens: int) -> AsyncIterator[str]:
    """OpenAI's chat stream: a role delta first, then reasoning, content or tool-call deltas, a
    closing chunk with finish_reason. Logprobs ride on the chunks of the tokens they belong to."""
    tracker = serving.DeltaTracker()
    choices: dict[int, _ChoiceStream] = {}

    def chunks_for(_: int, out: RequestOutput):
        for c in out.outputs:
            delta = tracker.take(c.index, c)
            choice = choices.setdefault(c.index, _ChoiceStream(job))
            final = delta.finish_reason is not None
            parts = choice.deltas(c.text, final) if delta.text or final else []
            logprobs = _logprobs(delta.logprobs, text_of) if job.req.logprobs and delta.logprobs else None
            if logprobs is not None and not parts:
                parts = [{"content": ""}]
            for j, part in enumerate(parts):
                yield _chunk(job, c.index, part, logprobs if j == 0 else None)
            if final:
                yield _chunk(job, c.index, {}, finish_reason="tool_calls" if choice.called else delta.finish_reason)

    def usage(final: list[RequestOutput]) -> dict:
        return {**_chunk(job, 0, {}), "choices": [], "usage": serving.output_usage(final)}

    roles = [_chunk(job, index, {"role": "assistant", "content": ""}) for index in range(job.req.n)]
    return serving.event_stream(streams, chunks_for, roles, usage if job.req.include_usage else None,
                                prompt_tokens if job.req.continuous_usage else None)


def _chunk(job: _Job, index: int, delta: dict, logprobs: dict | None = None, finish_reason: str | None = None) -> dict:
    return {"id": job.request_id, "object": "chat.completion.chunk", "created": job.created, "model": job.model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}
