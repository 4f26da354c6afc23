"""The public vocabulary every layer shares: sampling parameters and what a request returns
(the engine's internal per-sequence record is request.py's ``Request``)."""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from importlib.metadata import version

VERSION = version("kvserve")  # from pyproject.toml
MAX_LOGPROBS = 20  # the most alternatives returned per token, as in OpenAI's API
FLOAT32_MAX = 3.4028234663852886e38  # the sampling kernels read every value as float32
# Values the kernels would round to 0 (or past float32) are raised to these where parsed, so every
# value that reaches a kernel is valid (top_p=5e-324 became 0.0f and the C++ sampler raised):
# - a top_p below the likeliest token's probability (at least 1 / vocabulary) keeps that token
#   alone, so any top_p under 1e-9 means the same for a vocabulary under 10^9 tokens;
# - a temperature under 1e-5 is greedy (as in vLLM): dividing logits by less overflows float32;
# - a repetition penalty is kept in [1e-6, 1e6], where dividing or multiplying a logit stays finite.
MIN_TOP_P = 1e-9
MIN_TEMPERATURE = 1e-5
REPETITION_PENALTY_RANGE = (1e-6, 1e6)
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_INT_FIELDS = ("max_tokens", "min_tokens", "top_k", "n")
MAX_SEED = 1 << 63  # seeds are taken modulo 2^63 by the sampler; a bound keeps the arithmetic cheap


@dataclass(frozen=True)
class StructuredOutputs:
    """A constraint on what a request may generate, shaped like vLLM's: exactly one of a JSON
    schema (``json``, a dict or its text), ``json_object`` (any JSON object), a ``regex``, a
    ``choice`` of strings, or a ``grammar`` (Lark, as llguidance reads it, or GBNF).

    Only the shape is checked here; whether the schema, regex or grammar compiles is checked where
    the grammar engine lives (sample/grammar.py), which raises ValueError naming the problem.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of json, json_object, regex, choice, grammar; "
                             f"got {given or 'none'}")
        if self.json is not None and not isinstance(self.json, dict | str):
            raise ValueError("structured_outputs json must be a JSON schema (a dict or its JSON text)")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs {name} must be a non-empty string")
        if self.choice is not None:
            if not isinstance(self.choice, list | tuple) or not self.choice or \
                    any(not isinstance(c, str) or not c for c in self.choice):
                raise ValueError("structured_outputs choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", list(self.choice))

    @property
    def kind(self) -> str:
        return next(name for name in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, name))


@dataclass
class SamplingParams:
    """Per-request generation parameters, shaped like vLLM's.

    A ``temperature`` of 0 means greedy. ``top_k`` of 0 or -1 disables top-k; ``top_p`` of 1 and
    ``min_p`` of 0 disable those filters. ``seed`` makes this request's samples reproducible no
    matter what else shares its batch.

    Penalties follow vLLM: ``presence_penalty`` and ``frequency_penalty`` (in [-2, 2]) subtract from
    the logits of tokens already generated; ``repetition_penalty`` (> 0, 1 disables) divides positive
    and multiplies negative logits of tokens seen in the prompt or the output. ``logit_bias`` adds
    a bias in [-100, 100] to the given token ids, and ``allowed_token_ids`` (vLLM's) rules out every
    token not in the list. ``bad_words`` (vLLM's) are never generated: a word's last token is ruled out
    whenever the output so far ends with the tokens before it (the text layer tokenizes each word into
    ``bad_words_token_ids``). ``min_tokens`` (vLLM's) holds back the model's EOS and
    ``stop_token_ids`` until that many tokens are out, and stop strings until they are;
    ``include_stop_str_in_output`` keeps the stop string that ended the text, and
    ``skip_special_tokens`` false writes special tokens (such as ``<|im_end|>``) into it.
    ``truncate_prompt_tokens`` keeps only the prompt's last that many tokens (-1: as many as the
    context window holds with room for one more). ``logprobs`` asks for the chosen token's log
    probability plus that many likeliest alternatives (0 to 20) per generated token;
    ``prompt_logprobs`` the same for every prompt token after the first. ``structured_outputs``
    constrains the output to a JSON schema, regex, choice or grammar (a dict of those fields works too).
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None  # set by the text layer from bad_words
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputs | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputs(**self.structured_outputs)
            except TypeError as e:  # an unknown key
                raise ValueError(f"structured_outputs {e}") from None
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias) if self.logit_bias else None
        if isinstance(self.allowed_token_ids, (list, tuple)):
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.bad_words, (list, tuple)):
            self.bad_words = list(self.bad_words) or None
        self.validate()
        self._clamp_to_kernel_range()

    def _clamp_to_kernel_range(self) -> None:
        """See MIN_TOP_P: values the float32 kernels cannot take, moved to ones that sample the same."""
        if 0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = 0.0
        if self.top_p < MIN_TOP_P:
            self.top_p = MIN_TOP_P
        if self.min_p < MIN_TOP_P:  # 1e-300 would be a filter that keeps everything: none at all
            self.min_p = 0.0
        low, high = REPETITION_PENALTY_RANGE
        self.repetition_penalty = min(max(self.repetition_penalty, low), high)

    def validate(self) -> None:
        """Raise ValueError naming the field and its allowed range."""
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value) or abs(value) > FLOAT32_MAX:
                raise ValueError(f"{name}={value!r} must be a finite number")
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or abs(value) >= 1 << 31:
                raise ValueError(f"{name}={value!r} must be an integer below 2^31")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r} must be an integer >= 1")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must be in [0, max_tokens={self.max_tokens}]")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 means greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < -1:
            raise ValueError(f"top_k={self.top_k} must be -1 or 0 (disabled) or a positive integer")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p={self.min_p} must be in [0, 1]")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not -MAX_SEED <= self.seed < MAX_SEED):
            raise ValueError(f"seed={self.seed!r} must be an integer in [-2^63, 2^63) or None")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop={self.stop!r} must be non-empty strings")
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < 1 << 31 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids={self.stop_token_ids!r} must be non-negative integers")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be true or false")
        k = self.truncate_prompt_tokens
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not (k == -1 or k >= 1)):
            raise ValueError(f"truncate_prompt_tokens={k!r} must be -1 (the context window), a count >= 1, or None")
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n={self.n!r} must be an integer >= 1")
        self._validate_extras()

    def _validate_extras(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name}={getattr(self, name)} must be in [-2, 2]")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty={self.repetition_penalty} must be > 0 (1 disables it)")
        for token, bias in (self.logit_bias or {}).items():
            if not isinstance(token, int) or token < 0:
                raise ValueError(f"logit_bias key {token!r} must be a non-negative token id")
            if not _is_number(bias) or not -100 <= bias <= 100:
                raise ValueError(f"logit_bias[{token}]={bias} must be in [-100, 100]")
        allowed = self.allowed_token_ids
        if allowed is not None and (not isinstance(allowed, list) or not allowed or any(
                not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < 1 << 31 for t in allowed)):
            raise ValueError(f"allowed_token_ids={allowed!r} must be a non-empty list of token ids (or None)")
        if self.bad_words is not None and (not isinstance(self.bad_words, list) or any(
                not isinstance(w, str) or not w.strip() for w in self.bad_words)):
            raise ValueError(f"bad_words={self.bad_words!r} must be a list of words (non-blank strings)")
        ids = self.bad_words_token_ids
        if ids is not None and (not isinstance(ids, list) or any(
                not isinstance(seq, list) or not seq or any(not isinstance(t, int) or t < 0 for t in seq) for seq in ids)):
            raise ValueError("bad_words_token_ids must be lists of token ids, one per bad word's spelling")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name}={value!r} must be an integer in [0, {MAX_LOGPROBS}] or None")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            raise ValueError("structured_outputs must be a StructuredOutputs (or a dict of its fields) or None")

    def truncate(self, prompt_token_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt as ``truncate_prompt_tokens`` leaves it (its last tokens; all of it if unset)."""
        return truncate_prompt(prompt_token_ids, self.truncate_prompt_tokens, max_model_len)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_penalties(self) -> bool:
        """True when the logits must be adjusted from this request's token history, logit_bias,
        allowed_token_ids or bad_words."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.logit_bias or self.allowed_token_ids or self.bad_words)


def truncate_prompt(prompt_token_ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """The last ``keep`` tokens of the prompt (-1: max_model_len - 1, the most that leaves room to
    generate; None or a longer count: all of it)."""
    if keep is None:
        return prompt_token_ids
    keep = max_model_len - 1 if keep == -1 else keep
    return prompt_token_ids[-keep:] if len(prompt_token_ids) > keep else prompt_token_ids


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class TokenLogprob:
    """One token's log probability under the model's raw distribution (before penalties and
    temperature), with the ``top`` likeliest (token id, logprob) pairs at that position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


class FinishReason(str, enum.Enum):
    """Why a request stopped, with OpenAI's wording."""

    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context window
    ABORT = "abort"  # the caller went away or asked to cancel


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.perf_counter) of one request's life."""

    arrival: float = field(default_factory=time.perf_counter)
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2e(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival


@dataclass
class CompletionOutput:
    """One generated sequence of a request (``n`` > 1 gives several)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None  # one per token id, when SamplingParams.logprobs is set
    num_cached_tokens: int = 0  # prompt tokens whose KV was reused (prefix cache or fork), not recomputed

    def merge(self, delta: CompletionOutput) -> None:
        """Append a delta output of the same sequence (``LLMEngine.step(delta=True)``)."""
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(delta.logprobs)
        self.finish_reason = delta.finish_reason
        self.num_cached_tokens = delta.num_cached_tokens


@dataclass
class RequestOutput:
    """What the engine returns for a request: cumulative text and tokens so far, plus timings."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt_logprobs: list[TokenLogprob | None] | None = None  # None for the first prompt token

    def merge(self, delta: RequestOutput) -> None:
        """Add a delta output of the same request to this one, in place: what a stream does with the
        engine's ``step(delta=True)`` outputs to keep one cumulative output per request."""
        for mine, new in zip(self.outputs, delta.outputs, strict=True):
            mine.merge(new)
        self.finished, self.metrics = delta.finished, delta.metrics
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs

    # Shortcuts for the common n == 1 case.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def num_cached_tokens(self) -> int:
        return self.outputs[0].num_cached_tokens

    @property
    def ttft(self) -> float | None:
        return self.metrics.ttft

    @property
    def e2e_latency(self) -> float | None:
        return self.metrics.e2e
