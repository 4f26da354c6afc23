"""Digit limits for a JSON schema's numbers, so that constrained decoding always ends.

llguidance turns ``{"type": "number", "minimum": 0, "maximum": 1}`` into a grammar that allows any
number of decimals (and an unbounded integer any number of digits): a model that keeps choosing a
digit never reaches the closing brace and runs on until max_tokens. ``bounded_numbers`` returns a
copy of the schema where every numeric subschema is narrowed to finitely many digits:

- a number gets ``multipleOf: 10**-d``: at most ``d`` decimals, where ``d`` is
  ``DEFAULT_DECIMALS`` or the decimals its own bounds are written with, up to ``MAX_DECIMALS``;
  a schema with its own ``multipleOf`` keeps it (that already fixes the decimals);
- a number or integer without a lower or upper bound gets one at ``MAX_INTEGER`` (15 digits:
  every such integer is exact in a double, so any JSON parser reads back what the model wrote).

Only narrowing, in positions where narrowing a subschema narrows the whole (never under ``not``
or ``if``): whatever the grammar allows still validates against the caller's schema, and every
valid value within those limits is still allowed. Exponent forms (``1e3``) are not generated.
"""

from __future__ import annotations

import copy
import decimal

DEFAULT_DECIMALS = 6
MAX_DECIMALS = 10  # llguidance reads multipleOf as a double: 1e-11 no longer converts to an exact decimal
MAX_INTEGER = 10**15 - 1

_ONE_SCHEMA = ("items", "additionalItems", "additionalProperties", "unevaluatedItems", "unevaluatedProperties",
               "propertyNames", "contains", "then", "else")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def bounded_numbers(schema: dict | bool) -> dict | bool:
    """A copy of ``schema`` with every number and integer limited to finitely many digits."""
    if not isinstance(schema, dict):
        return schema
    out = copy.deepcopy(schema)
    _visit(out)
    return out


def _visit(node) -> None:
    if not isinstance(node, dict):
        return
    _bound(node)
    for key in _ONE_SCHEMA:
        if isinstance(node.get(key), dict):
            _visit(node[key])
    for key in _SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            for sub in node[key]:
                _visit(sub)
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            for sub in node[key].values():
                _visit(sub)


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _bound(node: dict) -> None:
    types = node.get("type")
    types = set(types) if isinstance(types, list) else {types}
    if not types & {"number", "integer"} or "enum" in node or "const" in node:  # a listed value is finite already
        return
    low = [node[k] for k in ("minimum", "exclusiveMinimum") if _is_number(node.get(k))]
    high = [node[k] for k in ("maximum", "exclusiveMaximum") if _is_number(node.get(k))]
    if not low:  # wide enough to keep any upper bound satisfiable
        node["minimum"] = -_beyond(high)
    if not high:
        node["maximum"] = _beyond(low)
    if "number" in types and "multipleOf" not in node:
        decimals = max([DEFAULT_DECIMALS] + [_decimals(v) for v in low + high])
        node["multipleOf"] = float(f"1e-{min(decimals, MAX_DECIMALS)}")  # exact as written, unlike 10.0 ** -d


def _beyond(bounds: list) -> int | float:
    """``MAX_INTEGER``, or ten times the given bound where that is larger (a float past 2**62:
    llguidance takes no Python int beyond 64 bits)."""
    limit = max([MAX_INTEGER] + [10 * int(abs(b)) for b in bounds])
    return limit if limit < 2**62 else float(limit)


def _decimals(value: int | float) -> int:
    """How many decimals ``value`` is written with (1.25 -> 2, 3 -> 0, 1e-7 -> 7)."""
    exponent = decimal.Decimal(repr(value)).normalize().as_tuple().exponent
    return max(0, -exponent) if isinstance(exponent, int) else 0
