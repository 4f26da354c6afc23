"""Seeded random JSON schemas (nested objects and arrays, enums, bounded numbers, required fields,
string patterns), kept small enough that a 135M model finishes them within a few hundred tokens."""

from __future__ import annotations

import random

_PATTERNS = [r"^[a-z]{2,6}$", r"^[0-9]{3}-[0-9]{2}$", r"^[A-Z][a-z]{1,8}$", r"^(yes|no)$"]
_WORDS = ["red", "green", "blue", "cat", "dog", "north", "south", "alpha", "beta", "x1"]


def _leaf(rng: random.Random) -> dict:
    kind = rng.choice(["string", "pattern", "integer", "number", "boolean", "enum"])
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(3, 16)}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(_PATTERNS)}
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 200)}
    if kind == "number":
        lo = rng.uniform(-10, 10)
        return {"type": "number", "minimum": round(lo, 2), "maximum": round(lo + rng.uniform(0.5, 100), 2)}
    if kind == "boolean":
        return {"type": "boolean"}
    return {"enum": rng.sample(_WORDS, rng.randint(2, 4))}


def _node(rng: random.Random, depth: int) -> dict:
    roll = rng.random()
    if depth > 0 and roll < 0.3:
        return _object(rng, depth - 1)
    if depth > 0 and roll < 0.5:
        return {"type": "array", "items": _node(rng, depth - 1), "minItems": rng.randint(0, 1),
                "maxItems": rng.randint(1, 3)}
    return _leaf(rng)


def _object(rng: random.Random, depth: int) -> dict:
    names = rng.sample(["id", "name", "kind", "size", "tags", "owner", "score", "place", "flag", "items"],
                       rng.randint(1, 4))
    props = {n: _node(rng, depth) for n in names}
    required = [n for n in names if rng.random() < 0.7] or names[:1]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def random_schema(seed: int) -> dict:
    """Schema number ``seed``: an object at the top, up to two levels of nesting below it."""
    return _object(random.Random(seed), depth=2)
