"""Digit limits on a JSON schema's numbers (sample/number_bounds.py), checked through llguidance with
a byte-level tokenizer: a walk that always writes a digit when it may (what greedy decoding did on
the bundled model) must still end, and what it writes must validate against the caller's schema."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from kvserve.sample.grammar import _JSON_OPTIONS
from kvserve.sample.number_bounds import MAX_INTEGER, bounded_numbers
from tests.e2e.random_schemas import random_schema

llguidance = pytest.importorskip("llguidance")
EOS = 256


class _Bytes:
    """One token per byte, plus an end token."""

    eos_token_id, bos_token_id, special_token_ids = EOS, None, [EOS]
    tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


TOKENIZER = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))


def _matcher(schema, bounded: bool = True):
    grammar = llguidance.LLMatcher.grammar_from_json_schema(bounded_numbers(schema) if bounded else schema,
                                                           defaults=_JSON_OPTIONS)
    m = llguidance.LLMatcher(TOKENIZER, grammar, log_level=0)
    assert not m.is_error(), m.get_error()
    return m


def _accepts(schema, text: str) -> bool:
    m = _matcher(schema)
    return all(m.consume_token(b) for b in text.encode()) and m.is_accepting()


def _digit_loving_walk(schema, seed: int, limit: int, bounded: bool = True) -> str | None:
    """Bytes chosen by the grammar's mask, a digit whenever one is allowed, else printable ASCII,
    else the end token; None if it has not ended within ``limit`` bytes."""
    m, rng, out = _matcher(schema, bounded), random.Random(seed), bytearray()
    while len(out) < limit:
        mask = m.compute_bitmask()
        allowed = [t for t in range(EOS + 1) if mask[t // 8] >> (t % 8) & 1]
        digits = [t for t in allowed if 0x30 <= t <= 0x39]
        printable = [t for t in allowed if 0x20 <= t <= 0x7E]
        token = rng.choice(digits or printable or allowed)
        assert m.consume_token(token), m.get_error()
        if token == EOS:
            return out.decode()
        out.append(token)
    return None


@pytest.mark.parametrize("seed", range(50))
def test_random_schemas_end_and_validate(seed):
    schema = random_schema(seed)
    text = _digit_loving_walk(schema, seed, limit=4000)
    assert text is not None, schema
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("schema", [{"type": "number", "minimum": 0, "maximum": 1}, {"type": "integer"},
                                    {"type": "number"}])
def test_without_the_limits_a_number_never_ends(schema):
    assert _digit_loving_walk(schema, 0, limit=500, bounded=False) is None
    text = _digit_loving_walk(schema, 0, limit=500)
    assert text is not None and len(text) <= 24
    jsonschema.validate(json.loads(text), schema)


def test_values_within_the_limits_are_all_allowed():
    ranged = {"type": "number", "minimum": 1.5, "maximum": 20}
    for text in ("1.5", "20", "2", "19.999999", "7.25", "20.000000"):
        assert _accepts(ranged, text), text
    for text in ("1.49", "20.1", "3.1415926", "1e1"):  # outside the bounds, past 6 decimals, an exponent
        assert not _accepts(ranged, text), text
    fine = {"type": "number", "minimum": 0.1234567, "maximum": 1}  # its bounds' own decimals are kept
    assert _accepts(fine, "0.1234567") and not _accepts(fine, "0.12345678")
    free = {"type": "integer"}
    for text in (str(MAX_INTEGER), str(-MAX_INTEGER), "0", "-7"):
        assert _accepts(free, text), text
    assert not _accepts(free, str(MAX_INTEGER + 1))
    one_sided = {"type": "integer", "maximum": -10**16}  # the added bound keeps it satisfiable
    assert _accepts(one_sided, str(-10**16 - 5)) and not _accepts(one_sided, "-9")


def test_the_rewrite_only_narrows_numeric_subschemas():
    schema = {"type": "object", "properties": {
        "type": {"type": "number", "multipleOf": 0.5, "minimum": 0},  # a property named "type"
        "n": {"not": {"type": "number", "maximum": 3}},  # narrowing under "not" would widen the schema
        "e": {"type": "number", "enum": [1.23456789]},
        "s": {"type": "string", "maxLength": 4},
        "a": {"type": "array", "items": {"type": ["number", "null"]}},
        "r": {"$ref": "#/$defs/count"}},
        "$defs": {"count": {"type": "integer", "exclusiveMinimum": 0}}}
    original = json.dumps(schema)
    out = bounded_numbers(schema)
    assert json.dumps(schema) == original, "the caller's schema is not changed"
    props = out["properties"]
    assert props["type"] == {"type": "number", "multipleOf": 0.5, "minimum": 0, "maximum": MAX_INTEGER}
    assert props["n"] == schema["properties"]["n"] and props["e"] == schema["properties"]["e"]
    assert props["s"] == schema["properties"]["s"]
    assert props["a"]["items"] == {"type": ["number", "null"], "minimum": -MAX_INTEGER, "maximum": MAX_INTEGER,
                                   "multipleOf": 1e-06}
    assert out["$defs"]["count"] == {"type": "integer", "exclusiveMinimum": 0, "maximum": MAX_INTEGER}
    assert bounded_numbers(True) is True
