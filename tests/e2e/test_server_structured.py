"""Structured outputs through the official openai client on the bundled model: response_format
(json_schema strict, json_object), chat.completions.parse with a pydantic model, seeded random
schemas greedy and sampled, bad specs as 400s naming the field, and "length" for a grammar cut off."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pydantic
import pytest

from tests.e2e.random_schemas import random_schema
from tests.e2e.server import ServerProcess

USER = [{"role": "user", "content": "Reply with a JSON object."}]
FAST_SEEDS = range(4)  # the CI subset; test_fifty_random_schemas runs all 50


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess(["--dtype", "float32", "--kv-cache-memory", "0.25", "--served-model-name", "default"])
    yield proc
    assert proc.stop() == 0, proc.log_text()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0)


def _schema_reply(client, schema: dict, temperature: float, seed: int) -> str:
    out = client.chat.completions.create(
        model="default", messages=USER, temperature=temperature, seed=seed, max_completion_tokens=400,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}})
    choice = out.choices[0]
    assert choice.finish_reason == "stop", (schema, choice.message.content)
    return choice.message.content


def _check_seeds(client, seeds) -> None:
    for seed in seeds:
        schema = random_schema(seed)
        for temperature in (0.0, 1.0):
            text = _schema_reply(client, schema, temperature, seed)
            jsonschema.validate(json.loads(text), schema)


def test_random_schemas_validate(client):
    _check_seeds(client, FAST_SEEDS)


@pytest.mark.slow
def test_fifty_random_schemas(client):
    _check_seeds(client, range(50))


def test_json_object_streamed_and_not(client):
    # any object is allowed, and greedy decoding may never close a long one: a prompt asking for a short one
    messages = [{"role": "user", "content": 'Reply with exactly this JSON: {"ok": true}'}]
    kwargs = dict(model="default", messages=messages, temperature=0, max_completion_tokens=300,
                  response_format={"type": "json_object"})
    whole = client.chat.completions.create(**kwargs)
    assert whole.choices[0].finish_reason == "stop", whole.choices[0].message.content
    assert isinstance(json.loads(whole.choices[0].message.content), dict)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
                       if c.choices)
    assert streamed == whole.choices[0].message.content


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    kind: str = pydantic.Field(pattern=r"^(cat|dog|fish)$")
    age: int = pydantic.Field(ge=0, le=30)


class Household(pydantic.BaseModel):
    pets: list[Pet] = pydantic.Field(max_length=2)
    city: str = pydantic.Field(max_length=16)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_parse_with_a_pydantic_model(client, temperature):
    out = client.chat.completions.parse(model="default", messages=[{"role": "user", "content": "Describe a home."}],
                                        response_format=Household, temperature=temperature, seed=3,
                                        max_completion_tokens=300)
    parsed = out.choices[0].message.parsed
    assert isinstance(parsed, Household), out.choices[0].message.content
    assert all(p.kind in ("cat", "dog", "fish") for p in parsed.pets)


def test_regex_and_choice_extra_fields(client):
    out = client.chat.completions.create(model="default", messages=USER, temperature=1.0, seed=1,
                                         max_completion_tokens=40,
                                         extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2}"}})
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", out.choices[0].message.content)
    out = client.completions.create(model="default", prompt="Pick:", max_tokens=10, temperature=1.0, seed=2,
                                    extra_body={"guided_choice": ["left", "right"]})
    assert out.choices[0].text in ("left", "right")


@pytest.mark.parametrize("body,field", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"extra_body": {"structured_outputs": {"regex": "a(b"}}}, "structured_outputs"),
    ({"extra_body": {"guided_grammar": "start: undefined_rule"}}, "guided_grammar"),
    ({"extra_body": {"guided_json": "{not json"}}, "guided_json"),
])
def test_bad_specs_are_400s_naming_the_field(client, body, field):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="default", messages=USER, max_completion_tokens=8, **body)
    assert err.value.status_code == 400
    assert err.value.body["param"] == field, err.value.body
    # the server is still up
    assert client.chat.completions.create(model="default", messages=USER, max_completion_tokens=2).choices


def test_grammar_cut_off_by_max_tokens_ends_with_length(client):
    schema = {"type": "object", "properties": {"text": {"type": "string", "minLength": 200}}, "required": ["text"]}
    out = client.chat.completions.create(model="default", messages=USER, max_completion_tokens=8, temperature=0,
                                         response_format={"type": "json_schema",
                                                          "json_schema": {"name": "s", "schema": schema}})
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 8
