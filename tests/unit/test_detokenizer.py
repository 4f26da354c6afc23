"""Incremental detokenization: the streamed text equals decoding the whole sequence at once, the
direct Rust decode gives exactly what the transformers wrapper would, and the byte-level path streams
exactly what the general one does."""

from __future__ import annotations

import random

import pytest

from kvserve.bench.random_model import word_tokenizer
from kvserve.frontend.detokenizer import IncrementalDetokenizer, ids_decoder, token_bytes_table


@pytest.fixture(scope="module")
def tokenizer(default_llm):
    return default_llm.engine.tokenizer


def _sequences(tokenizer, count: int, length: int) -> list[list[int]]:
    rng = random.Random(0)
    text_ids = tokenizer.encode("Grüße aus Köln — 東京タワー 🎉 naïve café, d'accord? \n\tfin", add_special_tokens=False)
    # Random ids (mostly word pieces) mixed with the pieces of multi-byte characters.
    return [[rng.choice(text_ids) if rng.random() < 0.5 else rng.randrange(tokenizer.vocab_size) for _ in range(length)]
            for _ in range(count)]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_direct_decode_matches_the_wrapper(tokenizer, skip_special_tokens):
    decode = ids_decoder(tokenizer, skip_special_tokens)
    for ids in _sequences(tokenizer, 50, 12):
        assert decode(ids) == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_streamed_text_is_the_whole_decode(tokenizer):
    for ids in _sequences(tokenizer, 20, 40):
        prompt, output = ids[:8], ids[8:]
        detok = IncrementalDetokenizer(tokenizer, prompt)
        streamed = "".join(detok.add_tokens([t]) for t in output)
        context = prompt[-5:]
        want = tokenizer.decode(context + output, skip_special_tokens=True)[
            len(tokenizer.decode(context, skip_special_tokens=True)):]
        assert streamed == detok.text
        assert want.startswith(streamed) and len(want) - len(streamed) <= 1  # at most a held-back partial char


def test_wrapper_is_used_when_it_cleans_up_spaces(tokenizer, monkeypatch):
    calls = []
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", True)
    monkeypatch.setattr(tokenizer, "decode", lambda ids, **kw: calls.append(ids) or "")
    ids_decoder(tokenizer, True)([1, 2])
    assert calls == [[1, 2]]


def _general_path(monkeypatch):
    monkeypatch.setattr("kvserve.frontend.detokenizer.token_bytes_table", lambda *args: None)


def test_byte_level_table_matches_the_tokenizer(tokenizer):
    """The default model's tokenizer is byte-level BPE: every token's bytes, special ones skipped."""
    table = token_bytes_table(tokenizer, True)
    assert table is not None and len(table) == len(tokenizer)
    text = "Grüße 東京 🎉"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(table[t] for t in ids).decode() == text
    special = next(i for i, t in tokenizer.added_tokens_decoder.items() if t.special)
    assert table[special] == b""
    assert token_bytes_table(tokenizer, False)[special] == tokenizer.added_tokens_decoder[special].content.encode()


def test_other_decoders_keep_the_general_path(tokenizer, monkeypatch):
    assert token_bytes_table(word_tokenizer(64), True) is None  # a word-level vocabulary
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", True)  # the wrapper would change spaces
    token_bytes_table.cache_clear()
    try:
        assert token_bytes_table(tokenizer, True) is None
    finally:
        token_bytes_table.cache_clear()


@pytest.mark.parametrize("chunk", [1, 3])
def test_byte_level_path_streams_what_the_general_path_does(tokenizer, monkeypatch, chunk):
    """The same final text and stop; each step's text so far at least the general path's (which holds a
    window back while its last decode is no longer than the one before, e.g. mid-character)."""
    text = "Grüße aus Köln — 東京タワー 🎉🎉 naïve café, d'accord? \n\tfin. <|im_end|> done"
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompt = tokenizer.encode("Say it:", add_special_tokens=False)

    def stream(stop):
        detok, so_far = IncrementalDetokenizer(tokenizer, prompt, stop), []
        for i in range(0, len(ids), chunk):
            detok.add_tokens(ids[i:i + chunk])
            so_far.append(detok.text)
        return so_far, detok.stopped

    stops = [[], ["タワ"], ["fin."]]
    fast = [stream(stop) for stop in stops]
    _general_path(monkeypatch)
    general = [stream(stop) for stop in stops]
    for (fast_text, fast_stopped), (general_text, general_stopped) in zip(fast, general):
        assert fast_text[-1] == general_text[-1] and fast_stopped == general_stopped
        assert all(a.startswith(b) for a, b in zip(fast_text, general_text))
    assert fast[0][0][-1] == tokenizer.decode(ids, skip_special_tokens=True)
    assert fast[1][0][-1].endswith("東京") and fast[1][1]
