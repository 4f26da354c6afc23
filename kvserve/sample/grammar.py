"""Constrained decoding: structured outputs (JSON schema, regex, choice, Lark grammar) by llguidance.

Three parts, each with one job:
- ``GrammarCompiler`` turns a request's ``StructuredOutputs`` into a compiled grammar for the
  model's tokenizer (cached: agents send the same schema over and over) and hands out one
  ``GrammarMatcher`` per sequence; a schema, regex or grammar that does not compile is a ValueError
  naming the field.
- ``GrammarMatcher`` is one sequence's position in its grammar: it advances on every token the
  engine appends and says when the grammar is complete.
- ``MaskFiller`` fills the step's token bitmasks (one bit per vocabulary entry, 1 = allowed) on a
  worker thread, so that the forward pass and the masks run at the same time; ``apply_bitmask``
  then sets the disallowed logits of the constrained rows to -inf before sampling. Rows without a
  grammar are not touched.

Speculative proposals get a mask for every position they are scored at: llguidance advances the
matcher through the proposals, writes one mask per position and rolls the matcher back itself, so
a rejected proposal leaves no trace (the engine then advances it over the tokens actually emitted).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kvserve.sample.number_bounds import bounded_numbers
from kvserve.types import StructuredOutputs

_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_CACHE_SIZE = 256  # compiled grammars kept (a compile of a large schema takes milliseconds)


class GrammarCompiler:
    """Compiles structured-output specs for one tokenizer. Thread-safe: the server validates
    requests on its event loop while the engine thread compiles the same specs."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        """``tokenizer``: the model's Hugging Face fast tokenizer; ``vocab_size``: the width of the
        model's logits (may exceed the tokenizer's: the extra ids are never allowed)."""
        self._hf_tokenizer, self.vocab_size = tokenizer, vocab_size
        self._eos = list(eos_token_ids) or None
        self._ll_tokenizer = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, object] = OrderedDict()  # grammar text -> a fresh LLMatcher to copy

    @property
    def ll_tokenizer(self):
        """Built on first use (~0.4 s for a 49K vocabulary), not at every engine start."""
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                n_vocab = max(self.vocab_size, len(self._hf_tokenizer))
                try:
                    self._ll_tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=n_vocab,
                                                                      eos_token=self._eos)
                except ValueError as e:  # e.g. a WordPiece decoder: llguidance needs every byte string tokenizable
                    raise ValueError(f"structured_outputs are not supported for this model's tokenizer: {e}") from None
            return self._ll_tokenizer

    def matcher(self, spec: StructuredOutputs) -> GrammarMatcher:
        """A new matcher at the start of ``spec``'s grammar; ValueError if it does not compile."""
        return GrammarMatcher(self._compiled(grammar_text(spec), spec).deep_copy())

    def validate(self, spec: StructuredOutputs) -> None:
        self._compiled(grammar_text(spec), spec)

    def _compiled(self, grammar: str, spec: StructuredOutputs):
        from llguidance import LLMatcher

        with self._lock:
            template = self._cache.get(grammar)
            if template is not None:
                self._cache.move_to_end(grammar)
                return template
        tokenizer = self.ll_tokenizer
        error = LLMatcher.validate_grammar(grammar, tokenizer)
        if error:
            raise ValueError(f"structured_outputs {_described(spec)} is invalid: {_first_line(error)}")
        template = LLMatcher(tokenizer, grammar, log_level=0)
        if template.is_error():
            raise ValueError(f"structured_outputs {_described(spec)} is invalid: {_first_line(template.get_error())}")
        with self._lock:
            self._cache[grammar] = template
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return template


def grammar_text(spec: StructuredOutputs) -> str:
    """The llguidance grammar of a spec; ValueError for a schema that is not JSON."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    if spec.json is not None or spec.json_object:
        schema = {"type": "object"} if spec.json_object else spec.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs json schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict | bool):
            raise ValueError("structured_outputs json schema must be a JSON object")
        # Fixed separators, no free whitespace: a small model that keeps emitting newlines inside an
        # object would otherwise never finish it (and ", " / ": " are what models write anyway).
        # Numbers get a digit limit for the same reason (see number_bounds).
        return LLMatcher.grammar_from_json_schema(bounded_numbers(schema), defaults=_JSON_OPTIONS)
    if spec.regex is not None:
        return LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    try:
        return LLMatcher.grammar_from_lark(any_to_lark(spec.grammar))
    except Exception as e:  # noqa: BLE001 - the GBNF converter raises whatever its parser does
        raise ValueError(f"structured_outputs grammar is invalid: {e}") from None


def _described(spec: StructuredOutputs) -> str:
    return {"json": "json schema", "json_object": "json_object", "regex": "regex", "choice": "choice",
            "grammar": "grammar"}[spec.kind]


def _first_line(message: str) -> str:
    lines = [line for line in message.strip().splitlines() if line.strip()]
    return " ".join(lines[:2]) if lines else "unknown error"


class GrammarMatcher:
    """One sequence's state in its grammar."""

    def __init__(self, matcher) -> None:
        self._m = matcher

    def accept(self, token_id: int) -> bool:
        """Advance over a token; False if the grammar does not allow it (the matcher is then dead)."""
        return bool(self._m.consume_token(token_id))

    def num_valid(self, token_ids: list[int]) -> int:
        """How many of ``token_ids`` (a speculative proposal) the grammar allows in a row, from here."""
        return int(self._m.validate_tokens(token_ids)) if token_ids else 0

    @property
    def is_finished(self) -> bool:
        """The grammar is complete and allows nothing more (or the matcher hit an error)."""
        return bool(self._m.is_stopped())

    @property
    def error(self) -> str:
        return self._m.get_error() if self._m.is_error() else ""

    @property
    def raw(self):
        return self._m


@dataclass
class MaskRequest:
    """One constrained sequence's share of a step's masks: ``1 + len(draft_token_ids)`` rows from
    ``first_row`` (the position after the known tokens, then one after each proposal)."""

    matcher: GrammarMatcher
    first_row: int
    draft_token_ids: list[int]


class MaskFiller:
    """Fills bitmasks on one worker thread (llguidance drops the GIL while it computes)."""

    def __init__(self, vocab_size: int) -> None:
        self.words = (vocab_size + 31) // 32
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-grammar")
        self._executor = None

    def start(self, requests: list[MaskRequest], num_rows: int) -> Future:
        """Begin filling a [num_rows, words] int32 bitmask; ``.result()`` returns it."""
        return self._pool.submit(self._fill, requests, num_rows)

    def _fill(self, requests: list[MaskRequest], num_rows: int) -> torch.Tensor:
        from llguidance import LLExecutor
        from llguidance.torch import fill_next_token_bitmask_par, fill_next_token_bitmask_par_with_draft_tokens

        if self._executor is None:
            self._executor = LLExecutor(num_threads=1)  # the forward pass has the cores; this thread overlaps it
        bitmask = torch.zeros((num_rows, self.words), dtype=torch.int32)
        drafted = [(r.matcher.raw, r.first_row, r.draft_token_ids) for r in requests if r.draft_token_ids]
        plain = [(r.matcher.raw, r.first_row) for r in requests if not r.draft_token_ids]
        if drafted:  # llguidance refuses an empty draft here, so the two kinds go in two calls
            fill_next_token_bitmask_par_with_draft_tokens(self._executor, drafted, bitmask)
        if plain:
            fill_next_token_bitmask_par(self._executor, plain, bitmask)
        return bitmask

    def close(self) -> None:
        self._pool.shutdown(wait=False)


_BITS = None  # [256, 8] bool: the bits of every byte value, lowest first


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 bitmask [R, words] -> bool [R, vocab_size], True where a token is allowed."""
    global _BITS
    if _BITS is None:
        _BITS = (torch.arange(256)[:, None] >> torch.arange(8)[None, :]).bitwise_and(1).bool()
    rows = bitmask.shape[0]
    as_bytes = bitmask.contiguous().view(torch.uint8).long()  # little-endian: byte j holds tokens 8j..8j+7
    return _BITS[as_bytes].reshape(rows, -1)[:, :vocab_size]


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``logits`` [B, V] with row ``rows[i]``'s disallowed tokens at -inf, by ``bitmask[i]``; a new
    tensor (the caller's logits are kept for logprobs). A row that allows nothing (the matcher hit
    an error) is left as it is rather than turned into NaNs: the engine ends that request."""
    allowed = unpack_bitmask(bitmask, logits.shape[-1]).to(logits.device)
    allowed |= ~allowed.any(dim=-1, keepdim=True)
    if len(rows) == logits.shape[0] and rows == list(range(len(rows))):
        return logits.masked_fill(~allowed, float("-inf"))
    index = torch.tensor(rows, device=logits.device)
    return logits.index_copy(0, index, logits.index_select(0, index).masked_fill(~allowed, float("-inf")))
