"""LLMEngine: text in, text out. Wraps EngineCore with the tokenizer and incremental detokenizers.

A request with ``n`` > 1 becomes ``n`` sequences in the core (ids ``<id>#<i>``) gathered back
into one RequestOutput here.

Outputs are cumulative (all text and tokens so far) or, with ``step(delta=True)``, only what is new
since the request's previous output: a server streaming hundreds of long requests would otherwise
copy every request's whole token list and text on every step, a cost that grows with length.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvserve.config import EngineConfig
from kvserve.engine.core import EngineCore, RequestFailedError
from kvserve.frontend.detokenizer import IncrementalDetokenizer, token_bytes_table
from kvserve.frontend.tokenizer import bad_words_token_ids, load_tokenizer
from kvserve.request import Request
from kvserve.runtime.threads import balance_threads, configure_threads
from kvserve.types import CompletionOutput, FinishReason, RequestOutput, SamplingParams


@dataclass
class _Sequence:
    request: Request
    detokenizer: IncrementalDetokenizer
    sent_tokens: int = 0  # delta outputs: tokens (and logprobs) and characters already handed out
    sent_text: int = 0


@dataclass
class _Tracked:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[_Sequence]
    sent_any: bool = False  # delta outputs: the prompt's logprobs go out with the first one only

    @property
    def finished(self) -> bool:
        if len(self.sequences) == 1:  # n == 1, the common case, without a generator per output
            return self.sequences[0].request.is_finished
        return all(s.request.is_finished for s in self.sequences)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.threads = configure_threads(config.num_threads)  # torch threads for this process: see runtime/threads.py
        self.core = EngineCore(config)
        self.config = self.core.config  # dtype "auto" resolved
        self.tokenizer = load_tokenizer(self.core.model_path, config.chat_template)
        token_bytes_table(self.tokenizer, True)  # built (and checked) at load, not in the first request
        self.core.use_tokenizer(self.tokenizer)  # structured outputs compile grammars against it
        self._tracked: dict[str, _Tracked] = {}
        self._sequences: dict[str, tuple[_Tracked, _Sequence]] = {}  # core sequence id -> its request, itself
        self._failed: list[RequestFailedError] = []  # requests a step took out, until take_failed()

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    def encode(self, prompt: str) -> list[int]:
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, priority: int = 0,
                    encoded: list[int] | None = None) -> None:
        """Tokenize (if text: unless ``encoded`` holds its ids already) and queue; raises ValueError for
        bad input, leaving the engine untouched."""
        if request_id in self._tracked:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        if text is not None and not text:
            raise ValueError("prompt is empty: give a non-empty string or token ids")
        if text is None:
            encoded = list(prompt)
        elif encoded is None:
            encoded = self.encode(text)
        token_ids = params.truncate(encoded, self.core.max_model_len)
        if params.bad_words and params.bad_words_token_ids is None:
            params = dataclasses.replace(params, bad_words_token_ids=bad_words_token_ids(self.tokenizer, params.bad_words))
        self.core.validate_prompt(token_ids)
        self.core.validate_params(params)
        tracked = _Tracked(request_id, text, token_ids, [])
        for i in range(params.n):
            child = params if params.n == 1 else dataclasses.replace(
                params, n=1, seed=None if params.seed is None else params.seed + i)
            seq_id = request_id if params.n == 1 else f"{request_id}#{i}"
            # Siblings after the first fork its prompt KV (copy-on-write) instead of recomputing it.
            fork_of = None if i == 0 else f"{request_id}#0"
            req = self.core.add_request(seq_id, token_ids, child, priority=priority, fork_of=fork_of)
            seq = _Sequence(req, IncrementalDetokenizer(
                self.tokenizer, token_ids, list(params.stop), skip_special_tokens=params.skip_special_tokens,
                min_tokens=params.min_tokens, include_stop=params.include_stop_str_in_output))
            tracked.sequences.append(seq)
            self._sequences[seq_id] = (tracked, seq)
        self._tracked[request_id] = tracked

    def abort_request(self, request_id: str) -> None:
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return
        for seq in tracked.sequences:
            self.core.abort_request(seq.request.request_id)
            self._sequences.pop(seq.request.request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self._tracked)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._tracked

    def request_ids(self) -> list[str]:
        return list(self._tracked)

    def step(self, finished_only: bool = False, delta: bool = False) -> list[RequestOutput]:
        """One engine step; returns an output for every request that produced text or finished
        (only the finished ones with ``finished_only``, which saves copying on long batches).
        With ``delta`` each output holds only what is new since the request's previous one
        (``RequestOutput.merge`` adds them up again)."""
        balance_threads()  # one thread fewer while another process keeps a core busy
        updates = self.core.step()
        for failure in self.core.take_failed():
            self._fail(failure.request_id, failure.cause)
        touched: dict[str, _Tracked] = {}
        for update in updates:
            entry = self._sequences.get(update.request.request_id)
            if entry is None:
                continue
            tracked, seq = entry
            try:
                seq.detokenizer.add_tokens(update.new_token_ids)
            except Exception as e:  # noqa: BLE001 - this request's tokens alone: take it out, go on
                self._fail(update.request.request_id, e)
                touched.pop(tracked.request_id, None)
                continue
            finished = update.finished
            if seq.detokenizer.stopped and not finished:
                self.core.finish(update.request.request_id, FinishReason.STOP)
                finished = True
            if finished or not finished_only:
                touched[tracked.request_id] = tracked
        return [self._output(t, delta) for t in touched.values() if not finished_only or t.finished]

    def take_failed(self) -> list[RequestFailedError]:
        """Requests a step failed since the last call (each already aborted, its KV freed); every
        error names the request as the caller submitted it (the siblings of n > 1 fail together)."""
        failed, self._failed = self._failed, []
        return failed

    def _fail(self, sequence_id: str, cause: BaseException) -> None:
        entry = self._sequences.get(sequence_id)
        if entry is None:
            return
        tracked = entry[0]
        self.abort_request(tracked.request_id)
        self._failed.append(RequestFailedError(tracked.request_id, cause))

    def _output(self, tracked: _Tracked, delta: bool = False) -> RequestOutput:
        finished = tracked.finished
        if finished:
            self._tracked.pop(tracked.request_id, None)
            for s in tracked.sequences:
                self._sequences.pop(s.request.request_id, None)
        outputs = [_completion(i, s, delta) for i, s in enumerate(tracked.sequences)]
        first = tracked.sequences[0].request
        prompt_logprobs = None
        if first.sampling_params.prompt_logprobs is not None and not (delta and tracked.sent_any):
            prompt_logprobs = [None, *first.prompt_logprobs]
        tracked.sent_any = True
        return RequestOutput(tracked.request_id, tracked.prompt, tracked.prompt_token_ids, outputs, finished,
                             first.metrics, prompt_logprobs)


def _completion(index: int, s: _Sequence, delta: bool) -> CompletionOutput:
    """One sequence's output: everything so far, or (``delta``) what its last output did not carry."""
    request = s.request
    # Unfinished text stops short of a tail that may still become a stop string, so a stream never
    # shows text that a later token would cut away.
    text_end = s.detokenizer.stream_safe_length(request.is_finished)
    text_start, token_start = (s.sent_text, s.sent_tokens) if delta else (0, 0)
    s.sent_text, s.sent_tokens = text_end, len(request.output_token_ids)
    return CompletionOutput(
        index=index,
        text=s.detokenizer.text[text_start:text_end],
        token_ids=request.output_token_ids[token_start:],
        finish_reason=request.finish_reason.value if request.finish_reason else None,
        logprobs=None if request.sampling_params.logprobs is None else request.output_logprobs[token_start:],
        num_cached_tokens=request.num_cached_tokens or 0,
    )
