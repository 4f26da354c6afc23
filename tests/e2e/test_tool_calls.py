"""Tool calls through the official openai client, streamed and not, for each parser: tiny random
models with the bundled BPE tokenizer and a chat template in each family's tool format (the
parser is recognised from the template), and one whose template shows no tool format (``json``:
forced calls only). ``tool_choice`` required or named is enforced by the parser's grammar, so even
a random model's reply parses into calls whose arguments fit the schema."""

from __future__ import annotations

import json
import time

import jsonschema
import openai
import pytest
from starlette.testclient import TestClient

from kvserve.entrypoints.llm import engine_config
from kvserve.entrypoints.openai.app import ServerOptions, build_app
from tests.conftest import make_tiny_model

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {},
                                                                          "additionalProperties": False}}}]
MESSAGES = [{"role": "user", "content": "Weather in Paris for two days?"}]

# Abridged templates in each family's own tool-call format: enough to render tools, earlier calls
# and tool results the way those models were trained to read them.
_TOOLS_JSON = "{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
TEMPLATES = {
    "hermes": ("{% if tools %}<|im_start|>system\nYou may call functions. <tools>\n" + _TOOLS_JSON + "</tools>\n"
               "Return each call as <tool_call>\n{\"name\": <name>, \"arguments\": <args>}\n</tool_call><|im_end|>\n"
               "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
               "{% for c in m.tool_calls or [] %}<tool_call>\n{{ {'name': c.function.name, 'arguments': "
               "c.function.arguments} | tojson }}\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    "llama3_json": ("{% if tools %}<|start_header_id|>system<|end_header_id|>\nEnvironment: ipython\n"
                    "Answer with a function call as JSON {\"name\": function name, \"parameters\": dictionary of "
                    "argument name and its value}, after <|python_tag|> if you like.\n" + _TOOLS_JSON +
                    "<|eot_id|>{% endif %}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n"
                    "{{ m.content }}<|eot_id|>{% endfor %}"
                    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n{% endif %}"),
    "pythonic": ("{% if tools %}<|start_header_id|>system<|end_header_id|>\nTo call functions answer "
                 "[func_name1(params_name1=params_value1, params_name2=params_value2), func_name2(params)]\n"
                 + _TOOLS_JSON + "<|eot_id|>{% endif %}{% for m in messages %}<|start_header_id|>{{ m.role }}"
                 "<|end_header_id|>\n{{ m.content }}<|eot_id|>{% endfor %}"
                 "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n{% endif %}"),
    "mistral": ("{% if tools %}[AVAILABLE_TOOLS][{% for t in tools %}{{ t | tojson }}{% if not loop.last %}, "
                "{% endif %}{% endfor %}][/AVAILABLE_TOOLS]{% endif %}{% for m in messages %}"
                "{% if m.role == 'user' %}[INST]{{ m.content }}[/INST]{% elif m.tool_calls %}[TOOL_CALLS]"
                "{{ m.tool_calls | map(attribute='function') | list | tojson }}</s>{% else %}{{ m.content }}</s>"
                "{% endif %}{% endfor %}"),
    # no tool format at all: forced calls fall back to the json list, auto is refused
    "json": ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
}


@pytest.fixture(scope="module")
def tokenizer_files():
    from kvserve.frontend.tokenizer import load_tokenizer
    from kvserve.model.default_model import default_model_path

    return load_tokenizer(default_model_path())


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def family(request, tmp_path_factory, tokenizer_files):
    """(parser name, an openai client of an in-process server on a tiny model with that template)."""
    name = request.param
    path = make_tiny_model(tmp_path_factory.mktemp(f"tools-{name}"), "LlamaForCausalLM",
                           vocab_size=len(tokenizer_files), eos_token_id=tokenizer_files.eos_token_id)
    tokenizer_files.chat_template = TEMPLATES[name]
    tokenizer_files.save_pretrained(str(path))
    app = build_app(engine_config(model=str(path), dtype="float32", num_kv_blocks=256, block_size=16),
                    ServerOptions(("tiny",)))
    with TestClient(app) as http:
        deadline = time.monotonic() + 120
        while not app.state.kvserve.client.is_ready and time.monotonic() < deadline:
            time.sleep(0.05)
        client = openai.OpenAI(base_url=str(http.base_url) + "/v1", api_key="unused", http_client=http,
                               max_retries=0)
        yield name, client


def _streamed(client, **kwargs):
    content, calls, finish = "", {}, None
    first_deltas = []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for tc in choice.delta.tool_calls or []:
            if tc.index not in calls:
                first_deltas.append(tc)
                calls[tc.index] = [tc.function.name, ""]
            calls[tc.index][1] += tc.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, [tuple(c) for c in calls.values()], finish, first_deltas


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_calls_parse_streamed_and_not(family, choice):
    name, client = family
    kwargs = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=120,
                  parallel_tool_calls=False)
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls", (name, whole.message.content)
    calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert len(calls) == 1 and all(c.id.startswith("call_") for c in whole.message.tool_calls)
    fn, args = calls[0]
    if isinstance(choice, dict):
        assert fn == "get_weather"
    jsonschema.validate(json.loads(args), WEATHER if fn == "get_weather" else TOOLS[1]["function"]["parameters"])
    content, streamed, finish, firsts = _streamed(client, **kwargs)
    assert (streamed, finish) == (calls, "tool_calls")
    assert firsts[0].id and firsts[0].type == "function" and firsts[0].function.arguments == ""


def test_auto_and_none(family):
    name, client = family
    kwargs = dict(model="tiny", messages=MESSAGES, tools=TOOLS, temperature=0, max_tokens=8)
    none = client.chat.completions.create(tool_choice="none", **kwargs).choices[0]
    if name == "json":  # nothing says how this model would write a call of its own accord
        with pytest.raises(openai.BadRequestError, match="--tool-call-parser.*tool_choice required"):
            client.chat.completions.create(tool_choice="auto", **kwargs)
        assert none.message.tool_calls is None and none.message.content
        return
    auto = client.chat.completions.create(tool_choice="auto", **kwargs).choices[0]
    # a random model's free text is content (it could in principle write a call; greedy here does not)
    assert auto.message.tool_calls is None and auto.finish_reason == "length"
    assert none.message.tool_calls is None and none.message.content


def test_parallel_calls_and_history(family):
    name, client = family
    history = MESSAGES + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "now", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    out = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, tool_choice="required",
                                         temperature=1.0, seed=3, max_tokens=200).choices[0]
    assert out.finish_reason in ("tool_calls", "length")
    if out.finish_reason == "tool_calls":
        assert all(c.function.name in ("get_weather", "now") for c in out.message.tool_calls)


def test_bad_tool_requests_are_400(family):
    _, client = family
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=4,
                                       tool_choice={"type": "function", "function": {"name": "missing"}})
    with pytest.raises(openai.BadRequestError, match="tool_choice needs tools"):
        client.chat.completions.create(model="tiny", messages=MESSAGES, tool_choice="required", max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="cannot be combined"):
        client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                       response_format={"type": "json_object"}, max_tokens=4)
