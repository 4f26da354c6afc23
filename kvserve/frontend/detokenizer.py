"""Incremental detokenization with stop strings.

Decoding token by token is wrong for byte-level BPE (a character's bytes span tokens) and for
SentencePiece (a token's leading space depends on its neighbours). In general each step decodes a
short window twice, with and without the new tokens, and emits only the difference once it no longer
ends in a partial character (U+FFFD). The two decodes go straight to the Rust tokenizer where that
gives the same text (transformers' wrapper costs more than the decoding).

A byte-level BPE tokenizer (GPT-2, Llama 3, Qwen, SmolLM) needs no window: a token is a fixed byte
string, so the text is an incremental UTF-8 decode of the concatenated bytes: 0.18 ms per step for
256 requests instead of 0.57, the largest share of the host's work per request in a big decode batch.
"""

from __future__ import annotations

import codecs
import functools
from collections.abc import Callable
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase
from transformers.convert_slow_tokenizer import bytes_to_unicode  # GPT-2's byte -> character map

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
        self._max_stop = max((len(s) for s in self.stop), default=0)
        self._token_bytes = token_bytes_table(self.tokenizer, self.skip_special_tokens)
        if self._token_bytes is not None:
            self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
            return
        self._ids = list(self.prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._decode = ids_decoder(self.tokenizer, self.skip_special_tokens)

    def add_tokens(self, token_ids: list[int]) -> str:
        """Feed new tokens; returns the newly decoded text (truncated at a stop string)."""
        if self.stopped:
            return ""
        if self._token_bytes is not None:
            table = self._token_bytes
            data = table[token_ids[0]] if len(token_ids) == 1 else b"".join(table[t] for t in token_ids)
            delta = self._utf8.decode(data)
            return self._append(delta) if delta else ""
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


@functools.lru_cache(maxsize=8)
def token_bytes_table(tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool) -> tuple[bytes, ...] | None:
    """Each token id's bytes, for a fast tokenizer whose decoding is byte-level BPE alone; None for any
    other. The table is checked against the tokenizer's own decode of every token, once per tokenizer
    (0.12 s for 49K tokens), so a tokenizer with any other decoding rule keeps the general path."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(backend.decoder).__name__ != "ByteLevel":
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special} if skip_special_tokens else set()
    decode = ids_decoder(tokenizer, skip_special_tokens)
    table = []
    for token_id in range(backend.get_vocab_size(with_added_tokens=True)):
        piece = backend.id_to_token(token_id)
        if piece is None or token_id in special:
            data = b""
        elif all(c in byte_of for c in piece):
            data = bytes(byte_of[c] for c in piece)
        else:  # an added token written as plain text
            data = piece.encode()
        if data.decode("utf-8", "replace") != decode([token_id]):
            return None
        table.append(data)
    return tuple(table)

