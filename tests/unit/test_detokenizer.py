"""Incremental detokenization: the streamed text equals decoding the whole sequence at once, and the
direct Rust decode gives exactly what the transformers wrapper would."""

from __future__ import annotations

import random

import pytest

from kvserve.frontend.detokenizer import IncrementalDetokenizer, ids_decoder


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
