"""Incremental detokenization with stop strings.

Decoding token by token is wrong for byte-level BPE (a character's bytes span tokens) and for
SentencePiece (a token's leading space depends on its neighbours). So each step decodes a short
window twice, with and without the new tokens, and emits only the difference once it no longer
ends in a partial character (U+FFFD). The two decodes go straight to the Rust tokenizer where that
gives the same text (transformers' wrapper costs more than the decoding: a few microseconds per
token, times every request of a large batch, every step).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

_CONTEXT_TOKENS = 5  # prompt tokens decoded before the first output token, for correct spacing


@dataclass
class IncrementalDetokenizer:
    tokenizer: PreTrainedTokenizerBase
    prompt_token_ids: list[int]
    stop: list[str] = field(default_factory=list)
    skip_special_tokens: bool = True
    text: str = ""
    stopped: bool = False

    def __post_init__(self) -> None:
        self._ids = list(self.prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._max_stop = max((len(s) for s in self.stop), default=0)
        self._decode = ids_decoder(self.tokenizer, self.skip_special_tokens)

    def add_tokens(self, token_ids: list[int]) -> str:
        """Feed new tokens; returns the newly decoded text (truncated at a stop string)."""
        if self.stopped:
            return ""
        self._ids.extend(token_ids)
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # a multi-byte character is still incomplete
        delta = full[len(prefix):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return self._append(delta)

    def _append(self, delta: str) -> str:
        before = len(self.text)
        self.text += delta
        if self.stop:
            # A stop string may start in earlier text: search from max_stop - 1 chars back.
            search_from = max(0, before - self._max_stop + 1)
            hits = [i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[:min(hits)]
                self.stopped = True
        return self.text[before:] if len(self.text) > before else ""

    def stream_safe_length(self, finished: bool) -> int:
        """How much of ``text`` may be shown: hold back a tail that could still become a stop string."""
        if finished or self.stopped or not self.stop:
            return len(self.text)
        return max(0, len(self.text) - self._max_stop + 1)


def ids_decoder(tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """``tokenizer.decode`` for a list of ids: the Rust tokenizer's own decode when the wrapper would
    only pass its result through (a fast tokenizer that cleans up no spaces), else the wrapper."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
