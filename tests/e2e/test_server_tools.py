"""Tool calls through the official openai client, streamed and not, for each tool-call parser, on
tiny random-weight models that carry a real byte-level tokenizer (the bundled model's) and each
family's chat template (tests/e2e/tool_templates.py); the parser is read from the template.

A random model calls no tool of its own accord, so: named and required choices show the grammar
enforcing a call; for ``auto`` a regex pins the reply's text to a family's call format (text before
a call, two calls in one turn, one with no arguments) and the parser must read it back."""

from __future__ import annotations

import json

import openai
import pytest

from kvserve.frontend.tokenizer import load_tokenizer
from kvserve.model.default_model import default_model_path
from tests.conftest import make_tiny_model
from tests.e2e.server import ServerProcess
from tests.e2e.tool_templates import TEMPLATES

ENGINE_ARGS = ["--num-kv-blocks", "512", "--block-size", "16", "--max-model-len", "2048", "--dtype", "float32",
               "--served-model-name", "x"]
# additionalProperties false on both: an open object lets a random model write keys until max_tokens.
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
             "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                              "days": {"type": "integer", "minimum": 1, "maximum": 7}},
             "required": ["city", "days"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "now", "description": "The time",
                                           "parameters": {"type": "object", "properties": {},
                                                          "additionalProperties": False}}}]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
# Each family's reply with text before the calls where its format allows it, two calls, the second without arguments.
REPLIES = {
    "hermes": ('Let me look.\n', '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
               '</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'),
    "llama3_json": ("", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; '
                        '{"name": "now", "parameters": {}}'),
    "pythonic": ("", '[get_weather(city="Paris", days=2), now()]'),
    "mistral": ("Let me look.", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
                                '{"name": "now", "arguments": {}}]'),
}
EXPECTED_CALLS = [("get_weather", {"city": "Paris", "days": 2}), ("now", {})]
_REGEX_META = set(r".+*?()|[]{}^$\/")


def _literal_regex(text: str) -> str:
    """A regex matching exactly ``text``."""
    return "".join("\\n" if ch == "\n" else "\\" + ch if ch in _REGEX_META else ch for ch in text)


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def family(request, tmp_path_factory):
    tokenizer = load_tokenizer(default_model_path())
    path = make_tiny_model(tmp_path_factory.mktemp(f"tools-{request.param}"), "LlamaForCausalLM",
                           vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                           eos_token_id=tokenizer.eos_token_id)
    tokenizer.chat_template = TEMPLATES[request.param]
    tokenizer.save_pretrained(str(path))
    proc = ServerProcess([str(path), *ENGINE_ARGS])
    client = openai.OpenAI(base_url=proc.url("/v1"), api_key="unused", max_retries=0)
    yield request.param, client
    assert proc.stop() == 0, proc.log_text()


def _create(client, **kwargs):
    kwargs = {"max_completion_tokens": 200, **kwargs}
    return client.chat.completions.create(model="x", messages=USER, tools=TOOLS, temperature=0, **kwargs)


def _stream(client, **kwargs) -> tuple[list, str | None]:
    """The stream's deltas (content and tool-call pieces, in order) and its finish_reason."""
    deltas, finish = [], None
    for chunk in _create(client, stream=True, **kwargs):
        for choice in chunk.choices:
            if choice.delta.content:
                deltas.append(("content", choice.delta.content))
            for tc in choice.delta.tool_calls or []:
                deltas.append(("call", tc.index, tc.id, tc.type, tc.function.name, tc.function.arguments))
            finish = choice.finish_reason or finish
    return deltas, finish


def _check_call_deltas(deltas: list) -> tuple[str, list[tuple[str, str]]]:
    """OpenAI's shape: content only before the calls; each call opens with a delta carrying its id,
    type and name (arguments ""), then only argument fragments; indexes count up from 0."""
    content, calls, ids = "", [], set()
    for d in deltas:
        if d[0] == "content":
            assert not calls, f"content after a tool call: {deltas}"
            content += d[1]
            continue
        _, index, call_id, kind, name, args = d
        if name is not None:
            assert index == len(calls) and call_id and call_id not in ids and kind == "function" and args == "", d
            ids.add(call_id)
            calls.append([name, ""])
        else:
            assert index == len(calls) - 1 and call_id is None and args, d
            calls[-1][1] += args
    return content, [tuple(c) for c in calls]


def test_named_choice_is_enforced(family):
    _, client = family
    choice = {"type": "function", "function": {"name": "get_weather"}}
    whole = _create(client, tool_choice=choice)
    c = whole.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c.message
    call = c.message.tool_calls[0]
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and set(args) == {"city", "days"} and 1 <= args["days"] <= 7
    deltas, finish = _stream(client, tool_choice=choice)
    content, calls = _check_call_deltas(deltas)
    assert finish == "tool_calls" and not content
    assert calls == [("get_weather", call.function.arguments)]


def test_required_choice_calls_a_tool(family):
    _, client = family
    c = _create(client, tool_choice="required", parallel_tool_calls=False).choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c.message
    call = c.message.tool_calls[0]
    assert call.function.name in ("get_weather", "now")
    assert isinstance(json.loads(call.function.arguments), dict)


def test_auto_reads_text_and_two_calls(family):
    name, client = family
    before, calls_text = REPLIES[name]
    pin = {"structured_outputs": {"regex": _literal_regex(before + calls_text)}}
    whole = _create(client, tool_choice="auto", extra_body=pin).choices[0]
    assert whole.finish_reason == "tool_calls", whole.message
    assert (whole.message.content or "") == before.strip() or (whole.message.content or "") == before
    got = [(tc.function.name, json.loads(tc.function.arguments)) for tc in whole.message.tool_calls]
    assert got == EXPECTED_CALLS
    deltas, finish = _stream(client, tool_choice="auto", extra_body=pin)
    content, calls = _check_call_deltas(deltas)
    assert finish == "tool_calls" and content.strip() == before.strip()
    assert [(n, json.loads(a)) for n, a in calls] == EXPECTED_CALLS
    assert [a for _, a in calls] == [tc.function.arguments for tc in whole.message.tool_calls]


def test_none_choice_and_bad_tool_choice(family):
    _, client = family
    c = _create(client, tool_choice="none", max_completion_tokens=5).choices[0]
    assert c.message.tool_calls is None and c.finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as err:
        _create(client, tool_choice={"type": "function", "function": {"name": "missing"}})
    assert err.value.body["param"] == "tool_choice"
