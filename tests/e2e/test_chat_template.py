"""--chat-template: a template given at start-up (its text, or a file) replaces the model's own, or
gives one to a model without any, for every chat request; a bad one stops the start, not a request."""

from __future__ import annotations

import time

import openai
import pytest
from starlette.testclient import TestClient

from kvserve import LLM
from kvserve.entrypoints.llm import engine_config
from kvserve.entrypoints.openai.app import ServerOptions, build_app

# Each message's words, then w9 as the turn marker: easy to read back with the word tokenizer.
TEMPLATE = "{% for m in messages %}{{ m.content }} {% endfor %}{% if add_generation_prompt %}w9{% endif %}"


def _serve(model, **options):
    app = build_app(engine_config(model=str(model), dtype="float32", num_kv_blocks=64, block_size=16, **options),
                    ServerOptions(("tiny",)))
    http = TestClient(app)
    http.__enter__()
    deadline = time.monotonic() + 120
    while not app.state.kvserve.client.is_ready and time.monotonic() < deadline:
        time.sleep(0.05)
    return http


@pytest.mark.parametrize("as_file", [False, True])
def test_chat_template_option_renders_every_chat_request(tiny_llama, tmp_path, as_file):
    value = TEMPLATE
    if as_file:
        value = str(tmp_path / "template.jinja")
        (tmp_path / "template.jinja").write_text(TEMPLATE)
    http = _serve(tiny_llama, chat_template=value)
    try:
        messages = [{"role": "user", "content": "w5 w6"}, {"role": "assistant", "content": "w7"},
                    {"role": "user", "content": "w8"}]
        counted = http.post("/tokenize", json={"model": "tiny", "messages": messages}).json()
        assert counted["tokens"] == [5, 6, 7, 8, 9]
        client = openai.OpenAI(base_url=str(http.base_url) + "/v1", api_key="unused", http_client=http, max_retries=0)
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
        assert reply.usage.prompt_tokens == 5 and reply.choices[0].finish_reason in ("length", "stop")
    finally:
        http.__exit__(None, None, None)


def test_without_a_template_chat_says_how_to_give_one(tiny_llama):
    http = _serve(tiny_llama)
    try:
        got = http.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "w5"}]})
        assert got.status_code == 400 and "--chat-template" in got.json()["error"]["message"]
        assert http.get("/health").status_code == 200
    finally:
        http.__exit__(None, None, None)


@pytest.mark.parametrize("value, words", [("{% for m in messages %}{{ m.content }", "not a valid Jinja template"),
                                          ("no/such/template.jinja", "neither a readable file"),
                                          ("  ", "chat_template")])
def test_a_bad_template_stops_the_start(tiny_llama, value, words):
    with pytest.raises(ValueError, match=words):
        LLM(model=str(tiny_llama), num_kv_blocks=16, block_size=8, chat_template=value)


def test_the_offline_tokenizer_carries_the_template(tiny_llama):
    llm = LLM(model=str(tiny_llama), num_kv_blocks=16, block_size=8, chat_template=TEMPLATE)
    prompt = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": "w5"}], tokenize=False,
                                                     add_generation_prompt=True)
    assert prompt == "w5 w9"


def test_serve_refuses_a_bad_template_before_it_loads_anything(capsys):
    from kvserve.cli import main

    assert main(["serve", "--chat-template", "{% for m in messages %}", "--port", "8123"]) == 2
    assert "not a valid Jinja template" in capsys.readouterr().err
