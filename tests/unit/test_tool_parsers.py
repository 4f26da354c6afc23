"""Tool-call parsers and the reasoning splitter at the text level: whole and streamed readings
agree, streams send OpenAI's deltas (golden lists), and each parser's grammar accepts its format."""

from __future__ import annotations

import itertools
import json
import re

import pytest

from kvserve.entrypoints.openai.reasoning import ReasoningStream, ThinkParser
from kvserve.entrypoints.openai.tool_parsers import Parsed, ToolCallStream, make_parser, parser_for_template

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
             "required": ["city"]}}},
         {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]

# Two calls, the second without arguments; hermes and mistral with text before them.
REPLIES = {
    "hermes": 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
              '</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
    "llama3_json": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; '
                   '{"name": "now", "parameters": {}}',
    "pythonic": '[get_weather(city="Paris", days=2), now()]',
    "mistral": 'Let me look.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
               '{"name": "now", "arguments": {}}]',
    "json": '[{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}, {"name": "now", "parameters": {}}]',
}
CALLS = [("get_weather", '{"city": "Paris", "days": 2}'), ("now", "{}")]


def _pieces(text: str) -> list[str]:
    """Token-like pieces: words, runs of punctuation, whitespace."""
    return re.findall(r"\s+|\w+|[^\w\s]", text)


def _stream(parser_name: str, text: str, parallel: bool = True) -> list[dict]:
    ids = (f"call_{i}" for i in itertools.count())
    stream = ToolCallStream(make_parser(parser_name), parallel, lambda: next(ids))
    pieces, deltas, seen = _pieces(text), [], ""
    for i, piece in enumerate(pieces):
        seen += piece
        deltas += stream.update(seen, final=i == len(pieces) - 1)
    return deltas


def _assembled(deltas: list[dict]) -> tuple[str, list[tuple[str, str]]]:
    content, calls = "", {}
    for d in deltas:
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            call = calls.setdefault(tc["index"], ["", ""])
            call[0] += tc["function"].get("name", "")
            call[1] += tc["function"]["arguments"]
    return content, [tuple(c) for c in calls.values()]


@pytest.mark.parametrize("name", sorted(REPLIES))
def test_whole_and_streamed_readings_agree(name):
    parsed = make_parser(name).parse(REPLIES[name], final=True)
    assert [(c.name, c.arguments) for c in parsed.calls] == CALLS
    expected_content = "Let me look." if name in ("hermes", "mistral") else ""
    assert parsed.content == expected_content
    deltas = _stream(name, REPLIES[name])
    assert _assembled(deltas) == (expected_content, CALLS)
    first = [d["tool_calls"][0] for d in deltas if "tool_calls" in d and "id" in d["tool_calls"][0]]
    assert [(f["index"], f["function"]["name"], f["function"]["arguments"]) for f in first] == \
        [(0, "get_weather", ""), (1, "now", "")], "each call opens with its id and name, arguments empty"


def test_golden_hermes_deltas():
    text = 'Hi <tool_call>\n{"name": "now", "arguments": {"tz": "UTC"}}\n</tool_call>'
    assert _stream("hermes", text) == [
        {"content": "Hi"},
        {"tool_calls": [{"index": 0, "id": "call_0", "type": "function", "function": {"name": "now", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '"'}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": "tz"}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '"'}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": ":"}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": " "}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '"'}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": "UTC"}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '"'}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]},
    ]


def test_golden_pythonic_deltas():
    assert _stream("pythonic", '[now(), get_weather(city="Oslo")]') == [
        {"tool_calls": [{"index": 0, "id": "call_0", "type": "function", "function": {"name": "now", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]},
        {"tool_calls": [{"index": 1, "id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": ""}}]},
        {"tool_calls": [{"index": 1, "function": {"arguments": '{"city": "Oslo"}'}}]},
    ]


@pytest.mark.parametrize("name", sorted(REPLIES))
def test_plain_replies_are_content(name):
    text = "The weather is fine [really] {today}."
    assert make_parser(name).parse(text, final=True).calls == []
    assert _assembled(_stream(name, text)) == (text, [])


def test_broken_call_is_content_and_single_call_without_parallel():
    broken = '<tool_call>\n{"name": "now", "arguments": {"a": }\n</tool_call>'
    assert make_parser("hermes").parse(broken, final=True).content == broken
    assert _assembled(_stream("hermes", REPLIES["hermes"], parallel=False))[1] == CALLS[:1]


def test_json_lists_that_are_not_calls_are_content():
    parser = make_parser("json")
    for text in ('[1, 2, 3]', '[{"city": "Paris"}]', 'Sure: [{"name": "now", "parameters": {}}]'):
        assert parser.parse(text, final=True) == Parsed(text), text
        assert _assembled(_stream("json", text)) == (text, []), text
    broken = '[{"name": "now", "parameters": {"a": }}]'  # (a stream has sent the call's start by then)
    assert parser.parse(broken, final=True) == Parsed(broken)


def test_parser_chosen_from_template():
    assert parser_for_template("{% for t in tools %}<tool_call>{% endfor %}") == "hermes"
    assert parser_for_template("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert parser_for_template("{{ '<|python_tag|>' }}") == "llama3_json"
    assert parser_for_template("{{ messages }}") is None


@pytest.fixture(scope="module")
def ll_tokenizer():
    from kvserve.frontend.tokenizer import load_tokenizer
    from kvserve.model.default_model import default_model_path
    from kvserve.sample.grammar import GrammarCompiler

    tokenizer = load_tokenizer(default_model_path())
    return tokenizer, GrammarCompiler(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))


@pytest.mark.parametrize("name", sorted(REPLIES))
def test_grammar_accepts_the_format_and_rejects_other_tools(name, ll_tokenizer):
    from kvserve.types import StructuredOutputs

    tokenizer, compiler = ll_tokenizer
    calls_only = REPLIES[name].removeprefix("Let me look.").lstrip("\n").removeprefix("<|python_tag|>")
    matcher = compiler.matcher(StructuredOutputs(grammar=make_parser(name).grammar(TOOLS, parallel=True)))
    ids = tokenizer.encode(calls_only, add_special_tokens=False)
    assert matcher.num_valid(ids) == len(ids), calls_only
    single = compiler.matcher(StructuredOutputs(grammar=make_parser(name).grammar(TOOLS[1:], parallel=False)))
    assert single.num_valid(ids) < len(ids), "a grammar of `now` alone refuses get_weather"


def test_reasoning_split_whole_and_streamed():
    text = "<think>\nThe user wants JSON.\n</think>\n\n{\"a\": 1}"
    parser = ThinkParser("...<|im_start|>assistant\n")
    split = parser.split(text, final=True)
    assert (split.reasoning, split.content) == ("\nThe user wants JSON.\n", '{"a": 1}')
    stream, reasoning, seen = ReasoningStream(parser), "", ""
    for piece in _pieces(text):
        seen += piece
        new, content = stream.update(seen, final=False)
        reasoning += new
        assert "<" not in reasoning and "think" not in content
    assert (reasoning, content) == (split.reasoning, split.content)
    opened = ThinkParser("<|im_start|>assistant\n<think>\n")
    assert opened.split("plan</think>answer", final=True).reasoning == "plan"
    assert ThinkParser("x").split("no thinking here", final=True).reasoning is None
    assert json.loads(ThinkParser("x").split(text, final=False).content) == {"a": 1}
