"""Request schemas of the OpenAI API (the subset kvserve serves), validated by pydantic.

Types are strict: a string where a number belongs is a 400 naming the field, not a silent cast.
Unknown fields are ignored, as OpenAI-compatible servers commonly do; a request's own top-level ones
are kept (``model_extra``) so that the server can say which it ignored. Every string must be valid
Unicode: JSON can spell a lone UTF-16 surrogate ("\\ud800"), which no tokenizer or response encoder
takes (it made a 500 and a closed connection). Responses are plain dicts built by the endpoint
modules (cheaper than models on the streaming path).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvserve.types import MAX_LOGPROBS


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    @field_validator("*")
    @classmethod
    def _valid_unicode(cls, value):
        if not _valid_text(value):
            raise ValueError("contains a string that is not valid Unicode (a lone UTF-16 surrogate)")
        return value


def _valid_text(value) -> bool:
    """True unless a string in ``value`` (itself, in a list, or a dict's keys and values) has a lone surrogate."""
    if isinstance(value, str):
        if value.isascii():
            return True
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return False
        return True
    if isinstance(value, list):
        return all(_valid_text(v) for v in value)
    if isinstance(value, dict):
        return all(_valid_text(k) and _valid_text(v) for k, v in value.items())
    return True


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, the usage so far on every chunk


class JsonSchemaFormat(_Strict):
    name: str = Field(min_length=1, max_length=64)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Strict):
    """OpenAI's ``response_format``: free text, any JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(_Strict):
    """vLLM's ``structured_outputs``: exactly one of these (checked when the engine's spec is built)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingRequest(_Strict):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    min_tokens: int = Field(0, ge=0)  # vLLM's extension
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # vLLM's: keep the prompt's last k tokens (-1: all that fit)
    priority: int = Field(0, gt=-(1 << 31), lt=1 << 31)  # vLLM's: lower is admitted (and kept) first
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    n: int = Field(1, ge=1, le=128)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0, le=10)
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None  # vLLM's: sample only from these token ids
    bad_words: list[str] | None = None  # vLLM's: words the output must not contain
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs name tokens "token_id:N"
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False  # vLLM's extensions, as SamplingParams has them
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Structured outputs, in the three spellings clients send (at most one of them per request).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _not_zero(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError("must be -1 (as many as the context window holds) or a count of tokens >= 1")
        return value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats


PromptInput = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingRequest):
    prompt: PromptInput
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")  # keep tool_calls etc. for the template

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _valid_unicode_extras(self) -> ChatMessage:
        for name, value in (self.model_extra or {}).items():
            if not _valid_text(value) or not _valid_text(name):
                raise ValueError(f"{name} contains a string that is not valid Unicode (a lone UTF-16 surrogate)")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatTemplateFields(BaseModel):
    """How messages go through the chat template (chat completions and /tokenize). vLLM's extensions:
    end the prompt inside the last (assistant) message so the reply continues it, and further
    variables for the template (e.g. Qwen3's enable_thinking)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class ChatCompletionRequest(SamplingRequest, ChatTemplateFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _continued_message(self) -> ChatCompletionRequest:
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise ValueError("continue_final_message needs add_generation_prompt false: the reply continues the "
                                 "last message instead of starting a new one")
            if self.messages[-1].role != "assistant":
                raise ValueError("continue_final_message needs the last message to be the assistant's")
        return self


class TokenizeRequest(_Strict, ChatTemplateFields):
    """vLLM's ``POST /tokenize``: a ``prompt`` (special tokens added unless asked not to) or chat
    ``messages`` through the model's template (which writes its own), as the engine would see them."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]
