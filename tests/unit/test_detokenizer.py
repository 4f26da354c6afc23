"""Incremental detokenization: the streamed text equals decoding the whole sequence at once, the
direct Rust decode gives exactly what the transformers wrapper would, and the byte-table path
(byte-level BPE; SentencePiece, from a Llama-2-style tokenizer trained here) streams exactly what the
general one does."""

from __future__ import annotations

import json
import random
from pathlib import Path

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
    assert table is not None and len(table.pieces) == len(tokenizer) and table.first_as_is
    text = "Grüße 東京 🎉"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(table.pieces[t] for t in ids).decode() == text
    special = next(i for i, t in tokenizer.added_tokens_decoder.items() if t.special)
    assert table.pieces[special] == b""
    written = tokenizer.added_tokens_decoder[special].content.encode()
    assert token_bytes_table(tokenizer, False).pieces[special] == written


def test_other_decoders_keep_the_general_path(tokenizer, monkeypatch):
    assert token_bytes_table(word_tokenizer(64), True) is None  # a word-level vocabulary
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", True)  # the wrapper would change spaces
    token_bytes_table.cache_clear()
    try:
        assert token_bytes_table(tokenizer, True) is None
    finally:
        token_bytes_table.cache_clear()


def test_table_is_read_back_from_the_cache_folder(tokenizer, tmp_path, monkeypatch):
    """A second process reads the checked table instead of building it; a damaged file is rebuilt;
    "no table" is remembered too."""
    from kvserve.frontend import detokenizer

    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    token_bytes_table.cache_clear()
    try:
        built = token_bytes_table(tokenizer, True)
        files = list((tmp_path / "token_bytes").glob("*.npz"))
        assert built is not None and len(files) == 1
        token_bytes_table.cache_clear()
        with monkeypatch.context() as m:
            m.setattr(detokenizer, "_build_table", lambda *args: pytest.fail("built again"))
            assert token_bytes_table(tokenizer, True) == built
        files[0].write_bytes(b"PK\x03\x04 not a zip")
        token_bytes_table.cache_clear()
        assert token_bytes_table(tokenizer, True) == built
        assert token_bytes_table(tokenizer, False) != built  # special tokens written: another key
        words = word_tokenizer(64)
        assert token_bytes_table(words, True) is None
        token_bytes_table.cache_clear()
        with monkeypatch.context() as m:
            m.setattr(detokenizer, "_build_table", lambda *args: pytest.fail("built again"))
            assert token_bytes_table(words, True) is None
        assert len(list((tmp_path / "token_bytes").glob("*.npz"))) == 3
    finally:
        token_bytes_table.cache_clear()


def _fed_one_by_one(tokenizer, output: str, stop: list[str], **kwargs) -> str:
    """The text of ``output``'s tokens fed one at a time after a short prompt."""
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Colours:", add_special_tokens=False), stop, **kwargs)
    for token in tokenizer.encode(output, add_special_tokens=False):
        detok.add_tokens([token])
    return detok.text


@pytest.mark.parametrize("general", [False, True])
def test_stop_strings_wait_for_min_tokens(tokenizer, monkeypatch, general):
    """A stop string that the first min_tokens tokens write does not count; a later one does."""
    if general:
        _general_path(monkeypatch)
    output = " red, green, red, blue, red"
    ids = tokenizer.encode(output, add_special_tokens=False)
    second_red = ids.index(tokenizer.encode(" green", add_special_tokens=False)[0]) + 3  # tokens through the 2nd " red"
    assert _fed_one_by_one(tokenizer, output, [" red"]) == ""
    assert _fed_one_by_one(tokenizer, output, [" red"], min_tokens=1) == " red, green,"
    assert _fed_one_by_one(tokenizer, output, [" red"], min_tokens=second_red) == " red, green, red, blue,"


@pytest.mark.parametrize("general", [False, True])
def test_stop_string_kept_and_special_tokens_written_when_asked(tokenizer, monkeypatch, general):
    if general:
        _general_path(monkeypatch)
    output = " red, green<|im_end|> blue, red"
    assert _fed_one_by_one(tokenizer, output, [", g", " blue"]) == " red"
    assert _fed_one_by_one(tokenizer, output, [", g", " blue"], include_stop=True) == " red, g"
    assert _fed_one_by_one(tokenizer, output, []) == " red, green blue, red"
    assert _fed_one_by_one(tokenizer, output, [], skip_special_tokens=False) == " red, green<|im_end|> blue, red"
    assert _fed_one_by_one(tokenizer, output, ["<|im_end|>"], skip_special_tokens=False,
                           include_stop=True) == " red, green<|im_end|>"


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


# ---- SentencePiece: Llama 2 / Mistral / Gemma's decoding, from a tokenizer trained here ---------------

ALICE = Path(__file__).resolve().parents[1] / "data" / "alice29.txt"
SAMPLE = "Grüße aus Köln — 東京タワー 🎉🎉 naïve café, d'accord? \n\tfin. Alice was beginning to get very tired"


def sentencepiece_tokenizer(strip: bool = True, byte_fallback: bool = True, metaspace: bool = False):
    """A Llama-2-style tokenizer.json: BPE over "▁"-marked words with the 256 "<0xNN>" byte pieces in
    its vocabulary, decoded by Replace("▁", " ") + ByteFallback + Fuse + Strip (the first space), as
    transformers converts Llama 2 / Mistral (Gemma: no Strip); or by a Metaspace decoder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    metaspace_pre = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = Tokenizer(models.BPE(unk_token="<unk>"))
    trainer.pre_tokenizer = metaspace_pre
    trainer.train_from_iterator([ALICE.read_text()], trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>"],
                                                                          show_progress=False))
    trained = json.loads(trainer.to_str())["model"]
    specials = ["<unk>", "<s>", "</s>"]
    pieces = specials + ([f"<0x{b:02X}>" for b in range(256)] if byte_fallback else [])
    pieces += [p for p, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]) if p not in pieces]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    tok = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=merges, unk_token="<unk>",
                               byte_fallback=byte_fallback))
    tok.pre_tokenizer = metaspace_pre
    if metaspace:
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    else:
        steps = [decoders.Replace("▁", " ")] + [decoders.ByteFallback()] * byte_fallback + [decoders.Fuse()]
        tok.decoder = decoders.Sequence(steps + [decoders.Strip(content=" ", left=1)] * strip)
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   clean_up_tokenization_spaces=False)


SENTENCEPIECE = {"llama": {}, "gemma": {"strip": False}, "no-byte-fallback": {"byte_fallback": False},
                 "metaspace": {"metaspace": True, "byte_fallback": False}}


@pytest.fixture(scope="module", params=list(SENTENCEPIECE))
def sp_tokenizer(request):
    return sentencepiece_tokenizer(**SENTENCEPIECE[request.param])


def test_sentencepiece_table_matches_the_tokenizer(sp_tokenizer):
    table = token_bytes_table(sp_tokenizer, True)
    assert table is not None and len(table.pieces) == len(sp_tokenizer)
    stripped = sp_tokenizer.decode(sp_tokenizer.encode("hello there"))[:1] != " "
    assert table.first_as_is is not stripped  # the first token keeps its space only without a Strip rule
    ids = sp_tokenizer.encode(SAMPLE, add_special_tokens=False)
    joined = b"".join(table.pieces[t] for t in ids).decode()
    if "<0xE6>" in sp_tokenizer.get_vocab():
        assert joined == " " + SAMPLE  # "▁" marks the first word too; byte pieces spell what the vocabulary lacks
    assert sp_tokenizer.decode(ids, skip_special_tokens=True) == (joined[1:] if stripped else joined)
    assert table.pieces[sp_tokenizer.bos_token_id] == b""
    assert token_bytes_table(sp_tokenizer, False).pieces[sp_tokenizer.bos_token_id] == b"<s>"


def _valid_sequences(tokenizer, count: int, length: int) -> list[list[int]]:
    """Random word pieces mixed with whole runs of a text's byte pieces (valid UTF-8 throughout)."""
    rng = random.Random(1)
    words = tokenizer.encode(SAMPLE, add_special_tokens=False)
    plain = [i for i, p in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))))
             if not p.startswith("<")]
    out = []
    for _ in range(count):
        ids = []
        while len(ids) < length:
            start = rng.randrange(len(words))
            ids += words[start:start + rng.randint(1, 6)] if rng.random() < 0.4 else [rng.choice(plain)]
        out.append(ids)
    return out


def _complete_runs(tokenizer, ids: list[int]) -> list[int]:
    """Drop byte pieces that do not form whole characters (a run cut by the random slicing)."""
    pieces = tokenizer.convert_ids_to_tokens(ids)
    kept, run = [], []
    for t, p in zip(ids, pieces):
        if p.startswith("<0x"):
            run.append(t)
            continue
        if run and tokenizer.decode(run).count("\ufffd") == 0:
            kept += run
        run = []
        kept.append(t)
    return kept


@pytest.mark.parametrize("prompt_text", ["Alice said", ""])
def test_sentencepiece_fast_path_streams_the_whole_decode(sp_tokenizer, monkeypatch, prompt_text):
    """Streamed text = the decode of context + output minus the context's, chunk by chunk; a prompt with
    no text (only BOS) keeps the window where the first output token's leading space is dropped."""
    prompt = [sp_tokenizer.bos_token_id] + sp_tokenizer.encode(prompt_text, add_special_tokens=False)
    table = token_bytes_table(sp_tokenizer, True)
    for seq in _valid_sequences(sp_tokenizer, 30, 30):
        output = _complete_runs(sp_tokenizer, seq)
        context = prompt[-5:]
        want = sp_tokenizer.decode(context + output, skip_special_tokens=True)[
            len(sp_tokenizer.decode(context, skip_special_tokens=True)):]
        for chunk in (1, 4):
            detok = IncrementalDetokenizer(sp_tokenizer, prompt)
            assert (detok._token_bytes is not None) == (table.first_as_is or bool(prompt_text))
            streamed = "".join(detok.add_tokens(output[i:i + chunk]) for i in range(0, len(output), chunk))
            assert streamed == detok.text == want


def test_sentencepiece_stop_strings_match_the_general_path(monkeypatch):
    tokenizer = sentencepiece_tokenizer()
    ids = tokenizer.encode(SAMPLE, add_special_tokens=False)
    prompt = tokenizer.encode("Say it:")

    def stream(stop, fast):
        detok = IncrementalDetokenizer(tokenizer, prompt, stop)
        assert (detok._token_bytes is not None) == fast
        for t in ids:
            detok.add_tokens([t])
        return detok.text, detok.stopped

    stops = [[], ["タワ"], ["fin."], ["very tired"]]
    fast = [stream(stop, True) for stop in stops]
    _general_path(monkeypatch)
    assert fast == [stream(stop, False) for stop in stops]
    assert fast[1] == (" " + SAMPLE[:SAMPLE.index("タワ")], True)  # the output's first word keeps its space
    assert fast[3] == (" " + SAMPLE[:SAMPLE.index("very tired")], True)


def test_sentencepiece_invalid_bytes_become_replacement_characters():
    """A stray byte piece (no whole character) is written as U+FFFD, never dropped or raised on."""
    tokenizer = sentencepiece_tokenizer()
    vocab = tokenizer.get_vocab()
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Alice"))
    text = "".join(detok.add_tokens([t]) for t in [vocab["<0xE6>"], vocab["<0x9D>"], vocab["▁the"],
                                                     vocab["<0xFF>"], vocab["▁the"]])
    assert text == "\ufffd the\ufffd the"


@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece"])
def test_ids_past_the_tokenizer_vocabulary_decode_to_nothing(tokenizer, kind, monkeypatch):
    """A model's vocabulary may be padded past its tokenizer's: such ids write no text on either path,
    as the tokenizer's own decode skips them, and the text around them is unchanged."""
    tok = tokenizer if kind == "byte-level" else sentencepiece_tokenizer()
    prompt = tok.encode("Say it:", add_special_tokens=False)
    ids = tok.encode(" hello there", add_special_tokens=False)
    beyond = len(tok) + 7
    want = tok.decode(ids, skip_special_tokens=True) if kind == "byte-level" else " hello there"
    for fast in (True, False):
        if not fast:
            _general_path(monkeypatch)
        detok = IncrementalDetokenizer(tok, prompt + [beyond])
        assert (detok._token_bytes is not None) == fast
        text = detok.add_tokens([ids[0], beyond]) + "".join(detok.add_tokens([t]) for t in ids[1:] + [beyond])
        assert text == want
