"""Incremental detokenization with stop strings.

Decoding token by token is wrong for byte-level BPE (a character's bytes span tokens) and for
SentencePiece (a token's leading space depends on its neighbours). In general each step decodes a
short window twice, with and without the new tokens, and emits only the difference once it no longer
ends in a partial character (U+FFFD). The two decodes go straight to the Rust tokenizer where that
gives the same text (transformers' wrapper costs more than the decoding).

Where every token after the first is a fixed byte string, no window is needed: the text is an
incremental UTF-8 decode of the concatenated bytes. That holds for byte-level BPE (GPT-2, Llama 3,
Qwen, SmolLM) and for SentencePiece with byte fallback (Llama 2, Mistral, Gemma: "▁" is a space,
"<0xNN>" a byte); only the text's first token is special there (its leading space is dropped), which
the prompt's tokens always precede. Detokenizing is the largest share of the host's work per
request in a big decode batch, and the table takes a third of the window method's time.
"""

from __future__ import annotations

import codecs
import functools
import hashlib
import io
import json
import re
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from transformers import PreTrainedTokenizerBase
from transformers.convert_slow_tokenizer import bytes_to_unicode  # GPT-2's byte -> character map

from kvserve.runtime.disk_cache import cache_dir, write_atomically

_CONTEXT_TOKENS = 5  # prompt tokens decoded before the first output token, for correct spacing
_TABLE_FORMAT = "token-bytes-1"  # part of the cache key: change it when the table's rules change


@dataclass
class IncrementalDetokenizer:
    tokenizer: PreTrainedTokenizerBase
    prompt_token_ids: list[int]
    stop: list[str] = field(default_factory=list)
    skip_special_tokens: bool = True
    min_tokens: int = 0  # stop strings count only once this many tokens are out (SamplingParams.min_tokens)
    include_stop: bool = False  # the text keeps the stop string it ended on (include_stop_str_in_output)
    text: str = ""
    stopped: bool = False

    def __post_init__(self) -> None:
        self._max_stop = max((len(s) for s in self.stop), default=0)
        self._num_tokens = 0
        table = token_bytes_table(self.tokenizer, self.skip_special_tokens)
        context = self.prompt_token_ids[-_CONTEXT_TOKENS:]
        # Text that starts with the output (no prompt text before it) keeps the window: its first token
        # may decode differently from its bytes (SentencePiece drops the leading space there).
        self._token_bytes = None
        if table is not None and (table.first_as_is or any(table.pieces[t] for t in context if t < len(table.pieces))):
            self._token_bytes = table.pieces
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
        self._num_tokens += len(token_ids)
        if self._token_bytes is not None:
            # An id past the tokenizer's vocabulary (a model's padded rows) decodes to nothing, as in the Rust decode.
            table, n = self._token_bytes, len(self._token_bytes)
            if len(token_ids) == 1:
                data = table[token_ids[0]] if token_ids[0] < n else b""
            else:
                data = b"".join(table[t] for t in token_ids if t < n)
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
        if self.stop and self._num_tokens > self.min_tokens:
            # A stop string may start in earlier text: search from max_stop - 1 chars back.
            search_from = max(0, before - self._max_stop + 1)
            hits = [(i, len(s)) for i, s in ((self.text.find(s, search_from), s) for s in self.stop) if i >= 0]
            if hits:
                at, length = min(hits)
                self.text = self.text[:at + length if self.include_stop else at]
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


@dataclass(frozen=True)
class TokenBytes:
    """Each token id's bytes as it decodes after other text (b"" for skipped special tokens), and whether
    a token that starts the text decodes to its bytes too (byte-level BPE: yes; SentencePiece: no)."""

    pieces: tuple[bytes, ...]
    first_as_is: bool


@functools.lru_cache(maxsize=8)
def token_bytes_table(tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool) -> TokenBytes | None:
    """The byte table of a fast tokenizer whose decoder maps each token to fixed bytes (byte-level BPE,
    SentencePiece's pieces); None for any other. The table is checked against the tokenizer's own
    decode of every token, after another token and on its own, so a tokenizer with any other
    decoding rule keeps the general path.

    Invalid UTF-8 (a model's stray byte tokens) becomes one U+FFFD per maximal invalid sequence, as
    Python and the ByteLevel decoder write it; SentencePiece's ByteFallback writes one per byte of a
    run of byte tokens that is invalid anywhere. Valid text is the same either way."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special} if skip_special_tokens else set()
    # Building and checking the table takes 0.3-0.5 s for 49K tokens, so a server start reads it back
    # from the cache folder, keyed by everything it depends on.
    key = hashlib.sha256(f"{_TABLE_FORMAT}\n{sorted(special)}\n{backend.to_str()}".encode()).hexdigest()[:32]
    path = cache_dir() / "token_bytes" / f"{key}.npz"
    try:
        return _read_table(path)
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
        pass  # not cached yet, or a damaged file: build it
    table = _build_table(backend, special, skip_special_tokens)
    try:
        _write_table(path, table)
    except OSError:
        pass  # a read-only cache folder: build it at every start instead
    return table


def _build_table(backend, special: set[int], skip_special_tokens: bool) -> TokenBytes | None:
    to_bytes = _piece_bytes(backend.decoder)
    if to_bytes is None:
        return None
    ids = range(backend.get_vocab_size(with_added_tokens=True))
    pieces = [backend.id_to_token(i) for i in ids]
    table = tuple(b"" if piece is None or i in special else to_bytes(piece) for i, piece in zip(ids, pieces))
    anchor = next((i for i in ids if re.fullmatch(rb" ?[a-z]{2,}", table[i])), None)  # not a byte token
    if anchor is None:
        return None
    decode = functools.partial(backend.decode, skip_special_tokens=skip_special_tokens)  # decode_batch was slower
    head, texts = decode([anchor]), [data.decode("utf-8", "replace") for data in table]
    if any(decode([anchor, i]) != head + text for i, text in zip(ids, texts)):
        return None
    return TokenBytes(table, first_as_is=all(decode([i]) == text for i, text in zip(ids, texts)))


def _write_table(path: Path, table: TokenBytes | None) -> None:
    """One .npz (no pickles): the pieces' lengths and their bytes back to back, or nothing for None."""
    pieces = table.pieces if table is not None else ()
    lengths = np.fromiter(map(len, pieces), dtype=np.int64, count=len(pieces))
    data = np.frombuffer(b"".join(pieces), dtype=np.uint8)
    buffer = io.BytesIO()
    np.savez(buffer, usable=table is not None, first_as_is=table is not None and table.first_as_is,
             lengths=lengths, data=data)
    write_atomically(path, buffer.getvalue())


def _read_table(path: Path) -> TokenBytes | None:
    with np.load(path, allow_pickle=False) as f:
        if not bool(f["usable"]):
            return None
        data, ends = f["data"].tobytes(), np.cumsum(f["lengths"]).tolist()
        first_as_is = bool(f["first_as_is"])
    starts = [0] + ends[:-1]
    if ends and ends[-1] != len(data):
        raise ValueError(f"{path}: lengths and data disagree")
    return TokenBytes(tuple(data[a:b] for a, b in zip(starts, ends)), first_as_is)


def _piece_bytes(decoder) -> Callable[[str], bytes] | None:
    """How ``decoder`` turns one token's piece into bytes, for the decoders that do so token by token:
    ByteLevel (GPT-2's byte -> character map), Metaspace, and SentencePiece's chain of Replace("▁",
    " "), ByteFallback ("<0xNN>" -> the byte), Fuse and Strip (the text's first space)."""
    spec = json.loads(decoder.__getstate__()) if decoder is not None else {}
    kind = spec.get("type")
    if kind == "ByteLevel":
        byte_of = {c: b for b, c in bytes_to_unicode().items()}
        # an added token written as plain text keeps its characters
        return lambda piece: bytes(byte_of[c] for c in piece) if all(c in byte_of for c in piece) else piece.encode()
    if kind == "Metaspace":
        space = spec.get("replacement", "\u2581")
        return lambda piece: piece.replace(space, " ").encode()
    if kind != "Sequence":
        return None
    steps = spec["decoders"]
    names = [d["type"] for d in steps]
    if names not in (["Replace", "ByteFallback", "Fuse"], ["Replace", "ByteFallback", "Fuse", "Strip"],
                     ["Replace", "Fuse"], ["Replace", "Fuse", "Strip"]):
        return None
    space = steps[0].get("pattern", {}).get("String")
    if space is None or steps[0].get("content") != " ":
        return None
    byte_fallback = "ByteFallback" in names

    def to_bytes(piece: str) -> bytes:
        if byte_fallback and re.fullmatch(r"<0x[0-9A-F]{2}>", piece):
            return bytes([int(piece[3:5], 16)])
        return piece.replace(space, " ").encode()

    return to_bytes
