"""Plumbing shared by the endpoints: server state, request -> SamplingParams, context-window checks,
running requests while watching for the client to leave, and server-sent events."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request

from kvserve.engine.core import RequestFailedError
from kvserve.entrypoints.openai.errors import APIError, bad_request, error_body, from_value_error
from kvserve.entrypoints.openai.protocol import SamplingRequest
from kvserve.entrypoints.openai.structured import Requested, as_api_error, is_structure_error
from kvserve.frontend.client import AsyncEngineClient, ModelInfo, RequestStream
from kvserve.frontend.tokenizer import bad_words_token_ids
from kvserve.metrics.prometheus import PrometheusMetrics
from kvserve.types import CompletionOutput, RequestOutput, SamplingParams, TokenLogprob, truncate_prompt

logger = logging.getLogger("kvserve.server")
# Ignored field names already logged, each once (bounded: a client inventing names cannot grow it without end).
_IGNORED_SEEN: set[str] = set()
_IGNORED_MAX = 1024
T = TypeVar("T")


@dataclass
class ServerState:
    """Everything a route needs; one per app, so nothing is global."""

    client: AsyncEngineClient
    model_names: list[str]
    metrics: PrometheusMetrics
    created: int = field(default_factory=lambda: int(time.time()))
    tool_call_parser: str | None = None  # None: chosen from the chat template (chat.py)
    reasoning_parser: str | None = None

    _token_text: TokenText | None = None
    _tokenizer_thread: TokenizerThread | None = None

    def token_text(self, as_ids: bool = False) -> TokenText:
        """How logprobs name tokens: their text, or ``token_id:N`` (vLLM's return_tokens_as_token_ids)."""
        if self._token_text is None:
            self._token_text = TokenText(self.client.ready_info().tokenizer)
        return TokenIdText(self._token_text.tokenizer) if as_ids else self._token_text

    def tokenizer_thread(self) -> TokenizerThread:
        if self._tokenizer_thread is None:
            self._tokenizer_thread = TokenizerThread(self.client.ready_info().tokenizer)
        return self._tokenizer_thread

    def close(self) -> None:
        if self._tokenizer_thread is not None:
            self._tokenizer_thread.close()


class ClientDisconnected(Exception):
    """The HTTP client went away before its response was ready."""


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def build_params(req: SamplingRequest, info: ModelInfo, max_tokens: int, logprobs: int | None = None,
                 prompt_logprobs: int | None = None, renames: dict[str, str] | None = None,
                 structure: Requested | None = None) -> SamplingParams:
    """SamplingParams from the request; any engine ValueError becomes a 400 naming the API field
    (``structure``: the request's structured-output constraint, compiled here by validate_params)."""
    new = sorted(set(req.model_extra or ()) - _IGNORED_SEEN)
    if new and len(_IGNORED_SEEN) < _IGNORED_MAX:
        _IGNORED_SEEN.update(new)
        logger.warning("a request sent fields kvserve does not take, ignored: %s", ", ".join(new))
    try:
        params = SamplingParams(
            max_tokens=max_tokens, min_tokens=req.min_tokens, temperature=req.temperature, top_p=req.top_p,
            top_k=req.top_k, min_p=req.min_p, seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos, n=req.n,
            include_stop_str_in_output=req.include_stop_str_in_output, skip_special_tokens=req.skip_special_tokens,
            truncate_prompt_tokens=req.truncate_prompt_tokens,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty, logit_bias=_logit_bias(req.logit_bias),
            allowed_token_ids=req.allowed_token_ids, bad_words=req.bad_words,
            # tokenized here, with the event loop's tokenizer, rather than on the engine thread
            bad_words_token_ids=bad_words_token_ids(info.tokenizer, req.bad_words) if req.bad_words else None,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            structured_outputs=structure.spec if structure is not None else None)
        info.validate_params(params)
    except ValueError as e:
        if structure is not None and is_structure_error(e):
            raise as_api_error(e, structure.field) from None
        raise from_value_error(e, renames) from None
    return params


def _logit_bias(raw: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI sends token ids as JSON object keys, i.e. strings."""
    if not raw:
        return None
    try:
        return {int(k): v for k, v in raw.items()}
    except ValueError:
        raise bad_request(f"logit_bias keys must be token ids (integers as strings); got {list(raw)[:3]}",
                          "logit_bias") from None


def resolve_max_tokens(requested: int | None, default: int | None, num_prompt_tokens: int, info: ModelInfo,
                       prompt_param: str, max_tokens_param: str = "max_tokens") -> int:
    """Check prompt + max_tokens against the context window; without max_tokens, use what is left.
    An engine with attention sinks streams past the window, so only the window bounds the default."""
    max_model_len = info.max_model_len
    if info.streams_past_context:
        if requested is not None:
            return requested
        return max_model_len if default is None else default
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens, but the {prompt_param} "
                          f"has {num_prompt_tokens} tokens, leaving no room for a completion. Please shorten it.",
                          prompt_param)
    if requested is None:
        return room if default is None else min(default, room)
    if num_prompt_tokens + requested > max_model_len:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                          f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the {prompt_param}, "
                          f"{requested} for the completion). Please reduce the length of the {prompt_param} or "
                          f"{max_tokens_param}.", max_tokens_param)
    return requested


# Texts longer than this are tokenized on a thread of their own: a 4 MB prompt held the event loop
# (every stream, /health) for 5.8 s.
LARGE_TEXT_CHARS = 32_768


def check_text(info: ModelInfo, text: str, param: str) -> None:
    """Refuse, before tokenizing, a text that cannot fit the context window: no token is longer than
    ``info.max_token_bytes``, so a text of more than max_model_len x that many bytes is too long."""
    limit = info.max_model_len * info.max_token_bytes
    if len(text) > limit or (len(text) * 4 > limit and len(text.encode("utf-8", "surrogatepass")) > limit):
        raise bad_request(f"{param} is longer than this model's context window can hold in any tokenization: "
                          f"at most {limit} bytes of text ({info.max_model_len} tokens of at most "
                          f"{info.max_token_bytes} bytes); please shorten it", param)


async def run_tokenizer(state: ServerState, fn: Callable[[Any], T], size: int) -> T:
    """Run ``fn(tokenizer)`` (an encode, a decode, a template): on the event loop for a short input, on
    the tokenizer thread for a long one (with that thread's own tokenizer: a fast tokenizer must not be
    used by two threads at once)."""
    if size < LARGE_TEXT_CHARS:
        return fn(state.client.ready_info().tokenizer)
    return await state.tokenizer_thread().run(fn)


class TokenizerThread:
    """One worker thread with its own copy of the tokenizer, for long texts."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = copy.deepcopy(tokenizer)
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvserve-tokenizer")

    async def run(self, fn: Callable[[Any], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, self._tokenizer)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def checked_prompt(info: ModelInfo, token_ids: list[int], req: SamplingRequest, param: str) -> list[int]:
    """The prompt's token ids as the request's truncate_prompt_tokens leaves them, checked (a 400
    naming ``param`` if the engine would refuse them)."""
    token_ids = truncate_prompt(token_ids, req.truncate_prompt_tokens, info.max_model_len)
    try:
        info.validate_prompt(token_ids)
    except ValueError as e:
        raise bad_request(f"{param}: {e}", param) from None
    return token_ids


def submit_all(client: AsyncEngineClient, request_id: str, prompts: list[list[int]], params: SamplingParams,
               request: Request, priority: int = 0) -> list[RequestStream]:
    """Queue one engine request per prompt (``priority``: lower runs first); if any is refused (e.g.
    the queue is full), abort the rest.
    Every one of the n sequences of every prompt counts against --max-queue."""
    streams: list[RequestStream] = []
    try:
        sequences = len(prompts) * params.n
        if sequences > client.max_queue:
            raise bad_request(f"this request asks for {sequences} sequences (n={params.n} x {len(prompts)} "
                              f"prompt{'s' if len(prompts) > 1 else ''}); this server queues at most "
                              f"{client.max_queue} (--max-queue)", "n")
        client.check_room(sequences)
        for i, ids in enumerate(prompts):
            streams.append(client.submit(request_id if len(prompts) == 1 else f"{request_id}-{i}", ids, params,
                                         priority))
    except BaseException:
        close_all(streams)
        raise
    finally:
        arrival = getattr(request.state, "arrival", None)  # counted by the app's CountIncoming middleware
        if arrival is not None:
            arrival.handed_over()
    return streams


def close_all(streams: list[RequestStream]) -> None:
    for stream in streams:
        stream.close()


async def results_unless_disconnected(request: Request, streams: list[RequestStream]) -> list[RequestOutput]:
    """Final outputs of every stream; if the client leaves first, abort them all and raise ClientDisconnected."""
    work = asyncio.ensure_future(asyncio.gather(*(s.result() for s in streams)))
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            return work.result()
        raise ClientDisconnected()
    finally:
        watch.cancel()
        work.cancel()
        work.add_done_callback(_retrieve)  # a cancelled gather's error is expected, not worth a log line
        close_all(streams)


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


async def _disconnected(request: Request) -> None:
    """Returns when the client closes its connection (the body has been read, so only that can come)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream index, output) pairs in arrival order from several streams; closing aborts them all."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
            queue.put_nowait((i, None))
        except Exception as e:  # noqa: BLE001 - re-raised by the consumer below
            queue.put_nowait((i, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        close_all(streams)


async def event_stream(streams: list[RequestStream], chunks_for: Callable[[int, RequestOutput], Iterable[dict]],
                       first: Iterable[dict] = (),
                       usage_chunk: Callable[[list[RequestOutput]], dict] | None = None,
                       running_prompt_tokens: int | None = None) -> AsyncIterator[str]:
    """The SSE body both endpoints share: leading chunks, then each output's chunks as it arrives, a usage
    chunk once every stream has finished, and ``[DONE]``. With ``running_prompt_tokens`` (vLLM's
    continuous_usage_stats) every chunk carries the usage so far: those prompt tokens and the completion
    tokens out. An error after the first byte cannot change the status any more, so it is sent in-band;
    a client that leaves (cancel or close) aborts every stream."""
    final: dict[int, RequestOutput] = {}
    latest: dict[int, RequestOutput] = {}

    def sse_with_usage(chunk: dict) -> str:
        if running_prompt_tokens is not None:
            chunk["usage"] = usage(running_prompt_tokens, sum(len(c.token_ids) for o in latest.values() for c in o.outputs),
                                   sum(o.num_cached_tokens for o in latest.values()))
        return sse(chunk)

    try:
        for chunk in first:
            yield sse_with_usage(chunk)
        async with contextlib.aclosing(merged(streams)) as outputs:
            async for i, out in outputs:
                latest[i] = out
                for chunk in chunks_for(i, out):
                    yield sse_with_usage(chunk)
                if out.finished:  # a stream's output grows in place: it may be seen finished twice
                    final[i] = out
        if usage_chunk is not None:
            yield sse(usage_chunk(list(final.values())))
    except Exception as e:  # noqa: BLE001 - reported to the client as an error event
        yield sse_error(e)
    finally:
        close_all(streams)
    yield SSE_DONE


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_error(exc: Exception) -> str:
    """An error that happens after a stream started cannot change the status code: send it as an event."""
    if isinstance(exc, APIError):
        return sse(error_body(exc.status, exc.message, exc.param, exc.code))
    if isinstance(exc, ValueError):
        err = from_value_error(exc)
        return sse(error_body(400, err.message, err.param))
    if isinstance(exc, RequestFailedError):
        return sse(error_body(500, str(exc)))
    return sse(error_body(503, str(exc)))


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def output_usage(outputs: list[RequestOutput]) -> dict:
    """Token counts; cached_tokens = prompt tokens whose KV was reused from the prefix cache."""
    return usage(sum(len(o.prompt_token_ids) for o in outputs),
                 sum(len(c.token_ids) for o in outputs for c in o.outputs),
                 sum(o.num_cached_tokens for o in outputs))


@dataclass
class Delta:
    """The part of one choice that a stream has not sent yet."""

    first: bool
    text: str
    text_start: int  # offset of ``text`` in the choice's whole text
    logprobs: list[TokenLogprob]
    num_new_tokens: int
    finish_reason: str | None  # set on the first delta that sees the choice finished, None after

    @property
    def is_empty(self) -> bool:
        return not self.text and not self.num_new_tokens and self.finish_reason is None


class DeltaTracker:
    """Remembers how much of each choice a stream has sent, so every chunk carries only what is new."""

    def __init__(self) -> None:
        self._text: dict[int, int] = {}
        self._tokens: dict[int, int] = {}
        self._finished: set[int] = set()

    def take(self, index: int, c: CompletionOutput) -> Delta:
        first = index not in self._text
        text_start, token_start = self._text.get(index, 0), self._tokens.get(index, 0)
        self._text[index], self._tokens[index] = len(c.text), len(c.token_ids)
        finish_reason = None if index in self._finished else c.finish_reason
        if finish_reason is not None:
            self._finished.add(index)
        return Delta(first, c.text[text_start:], text_start, (c.logprobs or [])[token_start:],
                     len(c.token_ids) - token_start, finish_reason)


def finite(logprob: float) -> float:
    """JSON has no -inf: clamp it as vLLM does, so a response can always be encoded."""
    return max(logprob, -9999.0)


class TokenText:
    """Token id -> text for logprobs, cached (the same ids come back over and over)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self.tokenizer.decode([token_id])
        return text


class TokenIdText(TokenText):
    """Tokens named by id, ``token_id:N``: exact where a token's text is not (a piece of a UTF-8
    character, two ids with the same text)."""

    def __call__(self, token_id: int) -> str:
        return f"token_id:{token_id}"
