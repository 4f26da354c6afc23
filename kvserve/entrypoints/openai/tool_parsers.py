"""Tool calls in a model's own output format, parsed into OpenAI's ``tool_calls``.

One parser per model family (``--tool-call-parser``): ``hermes`` (Qwen2.5/3, Hermes:
``<tool_call>{json}</tool_call>``), ``llama3_json`` (Llama 3.1+: a bare ``{"name", "parameters"}``
object, several joined by ``;``), ``pythonic`` (Llama 3.2/4: ``[f(a=1), g()]``), ``mistral``
(``[TOOL_CALLS][{...}, ...]``), and ``json`` (``[{"name", "parameters"}, ...]``: forced calls on a
model with none of these formats). Each reads a whole or partial output the same way, so a stream
and a whole response agree: ``parse(text, final)`` gives the text outside calls that is safe to
show (a partial marker is held back) and each call's name (once complete) and argument text so far.
Each also writes a Lark grammar of its format for a given set of tools, which enforces
``tool_choice`` ``required`` or a named function so that the output always parses.
"""

from __future__ import annotations

import ast
import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

# The JSON inside a grammar: fixed separators and no free whitespace, as structured outputs use.
_X_GUIDANCE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass
class CallState:
    """One tool call as far as the text goes: ``arguments`` is its raw JSON text so far."""

    name: str | None
    arguments: str = ""
    complete: bool = False


@dataclass
class Parsed:
    content: str
    calls: list[CallState] = field(default_factory=list)


class ToolParser(ABC):
    name: str = ""

    @abstractmethod
    def parse(self, text: str, final: bool) -> Parsed:
        """``final``: the output is complete; a call that does not parse makes the whole text content."""

    @abstractmethod
    def grammar(self, tools: list[dict], parallel: bool) -> str:
        """A Lark grammar (llguidance's dialect) of one call, or one or more with ``parallel``, of ``tools``."""


# ---- JSON scanning --------------------------------------------------------------------------------------


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def json_value_end(text: str, start: int) -> int | None:
    """End (exclusive) of the JSON value at ``text[start]``; None if the text ends inside it."""
    if start >= len(text):
        return None
    first = text[start]
    if first == '"':
        return _string_end(text, start)
    if first in "{[":
        depth, i = 0, start
        while i < len(text):
            ch = text[i]
            if ch == '"':
                end = _string_end(text, i)
                if end is None:
                    return None
                i = end
                continue
            if ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return None
    m = re.compile(r"-?[0-9.eE+-]+|true|false|null").match(text, start)
    if m is None or m.end() == len(text):  # a number may go on
        return None
    return m.end()


def _string_end(text: str, start: int) -> int | None:
    i = start + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == '"':
            return i + 1
        i += 1
    return None


_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')


def _object_call(text: str, start: int, args_keys: tuple[str, ...]) -> tuple[CallState | None, int | None]:
    """The call object at ``text[start] == '{'``: (its state, its end or None while incomplete).
    (None, end) for a complete object that is not a call."""
    end = json_value_end(text, start)
    body = text[start:end] if end is not None else text[start:]
    name_match = _NAME.search(body)
    name = json.loads(f'"{name_match.group(1)}"') if name_match else None
    args = ""
    key = re.compile(r'"(?:' + "|".join(args_keys) + r')"\s*:\s*').search(body)
    if key is not None:
        a = _skip_ws(body, key.end())
        a_end = json_value_end(body, a)
        args = body[a:a_end] if a_end is not None else body[a:]
    if end is None:
        return CallState(name, args), None
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None, end
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None, end
    value = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(value, str):  # some models send the arguments as a JSON string
        args = value
    elif key is None:
        args = json.dumps(value)
    return CallState(obj["name"], args, complete=True), end


def _held_back(text: str, marker: str) -> str:
    """``text`` without a tail that may be the start of ``marker``, or trailing whitespace (which
    may precede one)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            text = text[:-k]
            break
    return text.rstrip()


def _call_schema(tool: dict, args_key: str) -> dict:
    fn = tool["function"]
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, args_key: params},
            "required": ["name", args_key], "additionalProperties": False, "x-guidance": _X_GUIDANCE}


def _json_calls_grammar(tools: list[dict], args_key: str, prefix: str, separator: str, suffix: str,
                        call_wrap: tuple[str, str], parallel: bool) -> str:
    lines = [f"start: {prefix} call {'(' + separator + ' call)*' if parallel else ''} {suffix}".strip(),
             "call: " + " | ".join(f"call_{i}" for i in range(len(tools)))]
    open_, close = call_wrap
    for i, tool in enumerate(tools):
        lines.append(f"call_{i}: {open_} body_{i} {close}".strip())
        lines.append(f"body_{i}: %json " + json.dumps(_call_schema(tool, args_key)))
    return "\n".join(lines)


def _lark_str(s: str) -> str:
    return json.dumps(s)


# ---- the parsers ----------------------------------------------------------------------------------------


class HermesParser(ToolParser):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool) -> Parsed:
        first = text.find(self.OPEN)
        if first < 0:
            return Parsed(text if final else _held_back(text, self.OPEN))
        calls, i = [], first
        while i >= 0:
            start = _skip_ws(text, i + len(self.OPEN))
            if start >= len(text):
                break
            if text[start] != "{":
                if final:
                    return Parsed(text)
                break
            call, end = _object_call(text, start, ("arguments", "parameters"))
            if call is None:
                if final:
                    return Parsed(text)
                break
            calls.append(call)
            if end is None:
                break
            i = text.find(self.OPEN, end)
        if final and not all(c.complete for c in calls):
            return Parsed(text)
        return Parsed(text[:first].rstrip(), calls)

    def grammar(self, tools: list[dict], parallel: bool) -> str:
        return _json_calls_grammar(tools, "arguments", "", '"\\n"', "",
                                   (_lark_str(self.OPEN + "\n"), _lark_str("\n" + self.CLOSE)), parallel)


class Llama3JsonParser(ToolParser):
    """The whole reply is one or more calls (``;``-separated), after an optional ``<|python_tag|>``."""

    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text: str, final: bool) -> Parsed:
        body = text.lstrip()
        if self.TAG.startswith(body) and not final:
            return Parsed("")
        body = body.removeprefix(self.TAG).lstrip()
        compact = re.sub(r"\s+", "", body)
        if not final and ('{"name"'.startswith(compact) or '{"parameters"'.startswith(compact)):
            return Parsed("")  # may still become a call
        if not body.startswith("{"):
            return Parsed(text if final else text.rstrip())
        offset = len(text) - len(body)
        calls, i = [], offset
        while i < len(text):
            i = _skip_ws(text, i)
            if i < len(text) and text[i] == ";":
                i = _skip_ws(text, i + 1)
            if i >= len(text):
                break
            if text[i] != "{":
                return Parsed(text) if final else Parsed("", calls)
            call, end = _object_call(text, i, ("parameters", "arguments"))
            if call is None:  # a JSON object that is not a call: plain content
                return Parsed(text if final else text.rstrip()) if not calls else Parsed("", calls)
            calls.append(call)
            if end is None:
                break
            i = end
        if final and not all(c.complete for c in calls):
            return Parsed(text)
        return Parsed("", calls)

    def grammar(self, tools: list[dict], parallel: bool) -> str:
        return _json_calls_grammar(tools, "parameters", "", '"; "', "", ("", ""), parallel)


class _JsonListParser(ToolParser):
    """``MARKER`` (if any) then a JSON list of call objects whose arguments sit under ``ARGS_KEY``."""

    MARKER, ARGS_KEY = "", "parameters"

    def parse(self, text: str, final: bool) -> Parsed:
        at = text.find(self.MARKER) if self.MARKER else -1
        if at >= 0:
            content, start = text[:at].rstrip(), _skip_ws(text, at + len(self.MARKER))
        elif re.match(r'\s*\[\s*\{\s*"', text) or (not final and re.fullmatch(r'\s*\[?\s*\{?\s*"?', text)):
            content, start = "", _skip_ws(text, 0)
        elif final:
            return Parsed(text)
        else:
            return Parsed(_held_back(text, self.MARKER) if self.MARKER else text.rstrip())
        if start >= len(text):
            return Parsed(content)
        if text[start] != "[":
            return Parsed(text) if final else Parsed(content)
        calls, i = [], start + 1
        while True:
            i = _skip_ws(text, i)
            if i < len(text) and text[i] == ",":
                i = _skip_ws(text, i + 1)
            if i >= len(text) or text[i] == "]":
                break
            if text[i] != "{":
                return Parsed(text) if final else Parsed(content, calls)
            call, end = _object_call(text, i, ("arguments", "parameters"))
            if call is None:
                return Parsed(text) if final else Parsed(content, calls)
            calls.append(call)
            if end is None:
                break
            i = end
        if final and (not calls or not all(c.complete for c in calls)):
            return Parsed(text)
        return Parsed(content, calls)

    def grammar(self, tools: list[dict], parallel: bool) -> str:
        return _json_calls_grammar(tools, self.ARGS_KEY, _lark_str(self.MARKER + "["), '", "', '"]"', ("", ""),
                                   parallel)


class MistralParser(_JsonListParser):
    """``[TOOL_CALLS]`` then a JSON list of calls. The marker is a special token in Mistral's own
    tokenizers, which the detokenizer drops, so a reply that starts with the list counts too."""

    name = "mistral"
    MARKER, ARGS_KEY = "[TOOL_CALLS]", "arguments"


class JsonParser(_JsonListParser):
    """The whole reply is a JSON list of ``{"name", "parameters"}`` objects: no model's own format,
    but one any model can be held to. ``tool_choice`` required or a named function uses it on a model
    whose chat template shows no format kvserve knows (its grammar enforces it, as vLLM does there)."""

    name = "json"


class PythonicParser(ToolParser):
    """``[f(a=1, b="x"), g()]``: Python call syntax with literal keyword arguments. A call's
    arguments are sent whole once its closing parenthesis arrives (they are not JSON text)."""

    name = "pythonic"
    _HEAD = re.compile(r"\s*([A-Za-z_][\w.]*)\s*\(")

    def parse(self, text: str, final: bool) -> Parsed:
        body = text.lstrip()
        if not final and re.fullmatch(r"(\[\s*([A-Za-z_][\w.]*\s*)?)?", body):
            return Parsed("")  # may still become a call
        if not body.startswith("[") or not self._HEAD.match(body, 1):
            return Parsed(text if final else text.rstrip())
        calls, i = [], len(text) - len(body) + 1
        while True:
            i = _skip_ws(text, i)
            if i < len(text) and text[i] == ",":
                i = _skip_ws(text, i + 1)
            if i >= len(text) or text[i] == "]":
                break
            head = self._HEAD.match(text, i)
            if head is None:
                if not final and re.fullmatch(r"[A-Za-z_][\w.]*\s*", text[i:]):
                    break
                return Parsed(text) if final else Parsed("", calls)
            close = _python_close(text, head.end())
            if close is None:
                calls.append(CallState(head.group(1)))
                break
            arguments = _python_kwargs(text[head.end():close])
            if arguments is None:
                return Parsed(text) if final else Parsed("", calls)
            calls.append(CallState(head.group(1), json.dumps(arguments), complete=True))
            i = close + 1
        if final and (not calls or not all(c.complete for c in calls)):
            return Parsed(text)
        return Parsed("", calls)

    def grammar(self, tools: list[dict], parallel: bool) -> str:
        more = ' (", " call)*' if parallel else ""
        lines = [f'start: "[" call{more} "]"', "call: " + " | ".join(f"call_{i}" for i in range(len(tools)))]
        for i, tool in enumerate(tools):
            fn = tool["function"]
            params = fn.get("parameters") or {}
            props = params.get("properties") or {}
            required = [n for n in params.get("required") or [] if n in props or not props]
            optional = [n for n in props if n not in required]
            kw = {}
            for j, name in enumerate(required + optional):
                schema = {**props.get(name, {}), "x-guidance": _X_GUIDANCE}
                lines.append(f"arg_{i}_{j}: %json " + json.dumps(schema))
                kw[name] = f"{_lark_str(name + '=')} arg_{i}_{j}"
            # required keywords first, in order; then any of the optional ones, in order
            body = ' ", " '.join(kw[n] for n in required)
            tails = []
            for k in range(len(optional)):
                chain = kw[optional[k]] + "".join(f' (", " {kw[n]})?' for n in optional[k + 1:])
                tails.append(chain)
            if tails and required:
                body += "".join(f' (", " {kw[n]})?' for n in optional)
            elif tails:
                body = "(" + " | ".join(f"({t})" for t in tails) + ")?"
            lines.append(f"call_{i}: {_lark_str(fn['name'] + '(')} {body} \")\"")
        return "\n".join(lines)


def _python_close(text: str, start: int) -> int | None:
    """Index of the ``)`` closing a call whose arguments start at ``start``; None if not there yet."""
    depth, i, quote = 0, start, None
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 2
                continue
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                return i if ch == ")" else None
            depth -= 1
        i += 1
    return None


_JSON_NAMES = {"true": True, "false": False, "null": None}


def _python_kwargs(source: str) -> dict | None:
    """Keyword arguments of literal values (JSON's true/false/null accepted too); None if not that."""
    try:
        call = ast.parse(f"f({source})", mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(call, ast.Call) or call.args:
        return None
    out = {}
    for kw in call.keywords:
        if kw.arg is None:
            return None
        try:
            out[kw.arg] = _literal(kw.value)
        except ValueError:
            return None
    return out


def _literal(node: ast.AST):
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.List):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}
    return ast.literal_eval(node)


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, PythonicParser,
                                                             MistralParser, JsonParser)}


def parser_for_template(template: str | None) -> str | None:
    """The parser a chat template's own tool-call format calls for, or None if it shows none."""
    if not template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "[func_name1(" in template or "func_name1(params_name1=" in template:
        return "pythonic"
    if "<|python_tag|>" in template or '"parameters": dictionary of argument name and its value' in template:
        return "llama3_json"
    return None


class ToolCallStream:
    """Turns a choice's growing text into OpenAI's stream deltas: content, then for each call a
    first delta with its id and name (arguments ""), then argument fragments as they arrive."""

    def __init__(self, parser: ToolParser, parallel: bool, new_id) -> None:
        self.parser, self.parallel, self.new_id = parser, parallel, new_id
        self.sent_content = 0
        self.sent_args: list[int] = []  # per call sent: characters of its arguments

    @property
    def has_calls(self) -> bool:
        return bool(self.sent_args)

    def update(self, text: str, final: bool) -> list[dict]:
        parsed = self.parser.parse(text, final)
        deltas = []
        if final and not parsed.calls and self.has_calls:
            return deltas  # the calls sent went bad at the end: nothing more can be taken back
        if len(parsed.content) > self.sent_content and not self.has_calls:
            deltas.append({"content": parsed.content[self.sent_content:]})
            self.sent_content = len(parsed.content)
        for i, call in enumerate(parsed.calls if self.parallel else parsed.calls[:1]):
            if call.name is None:
                break  # later calls wait for this one's name
            if i == len(self.sent_args):
                deltas.append({"tool_calls": [{"index": i, "id": self.new_id(), "type": "function",
                                               "function": {"name": call.name, "arguments": ""}}]})
                self.sent_args.append(0)
            if len(call.arguments) > self.sent_args[i]:
                deltas.append({"tool_calls": [{"index": i, "function": {
                    "arguments": call.arguments[self.sent_args[i]:]}}]})
                self.sent_args[i] = len(call.arguments)
        return deltas


def make_parser(name: str) -> ToolParser:
    if name not in PARSERS:
        raise ValueError(f"tool-call parser {name!r} is not one of {', '.join(PARSERS)}")
    return PARSERS[name]()
