"""The server on the bundled default model: its real chat template, parity with the offline API,
identical concurrent outputs, a continued final message, forced tool calls on a template without a
tool format, and aborts (streamed or not) that give the KV blocks back."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from kvserve import SamplingParams
from tests.e2e.server import ServerProcess

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": "Name three colours of the rainbow."}]
GREEDY = {"temperature": 0, "max_completion_tokens": 16}
KV_USAGE = "kvserve:kv_cache_usage_perc"


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess(["--dtype", "float32", "--kv-cache-memory", "0.25"])
    yield proc
    assert proc.stop() == 0, proc.log_text()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0)


def _offline_chat(llm, messages, max_tokens: int) -> str:
    tokenizer = llm.get_tokenizer()
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return llm.generate([ids], SamplingParams(max_tokens=max_tokens, temperature=0))[0].text


def test_health_is_503_while_loading_then_200(server):
    assert 503 in server.startup_statuses and server.startup_statuses[-1] == 200


def test_chat_equals_offline_api(client, default_llm):
    got = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=MESSAGES, **GREEDY)
    assert got.choices[0].message.content == _offline_chat(default_llm, MESSAGES, 16) != ""
    streamed = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=MESSAGES, stream=True,
                                              **GREEDY)
    chunks = list(streamed)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == got.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == got.choices[0].finish_reason


def test_16_concurrent_identical_greedy_requests(server, client):
    async def run():
        aclient = openai.AsyncOpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0)
        outs = await asyncio.gather(*(aclient.chat.completions.create(messages=MESSAGES, model="SmolLM2-135M-Instruct",
                                                                      **GREEDY) for _ in range(16)))
        await aclient.close()
        return [o.choices[0].message.content for o in outs]

    texts = asyncio.run(run())
    alone = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=MESSAGES, **GREEDY)
    assert set(texts) == {alone.choices[0].message.content}


def test_continue_final_message_equals_offline_api(client, default_llm):
    """vLLM's continue_final_message: the prompt ends inside the assistant's message (transformers'
    rendering), and the reply continues it."""
    messages = MESSAGES + [{"role": "assistant", "content": "The three colours are"}]
    extra = {"continue_final_message": True, "add_generation_prompt": False}
    got = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, extra_body=extra, **GREEDY)
    tokenizer = default_llm.get_tokenizer()
    text = tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nThe three colours are")
    offline = default_llm.generate([tokenizer.encode(text, add_special_tokens=False)],
                                   SamplingParams(max_tokens=16, temperature=0))[0].text
    assert got.choices[0].message.content == offline != ""
    with pytest.raises(openai.BadRequestError, match="last message to be the assistant's"):
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=MESSAGES, extra_body=extra, **GREEDY)


def test_forced_tool_call_without_a_tool_format(client):
    """The bundled model's template shows no tool format: a named call is held to the json list by
    its grammar (and read back from it), streamed or not; ``auto`` has no format to read and is a 400."""
    params = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}}, "required": ["city"],
              "additionalProperties": False}
    kwargs = dict(model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                  tools=[{"type": "function", "function": {"name": "get_weather", "parameters": params}}],
                  temperature=0, max_tokens=40)
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = client.chat.completions.create(tool_choice=named, **kwargs).choices[0]
    assert whole.finish_reason == "tool_calls" and len(whole.message.tool_calls) == 1
    call = whole.message.tool_calls[0]
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}
    streamed = ""
    for chunk in client.chat.completions.create(tool_choice=named, stream=True, **kwargs):
        for tc in chunk.choices[0].delta.tool_calls or []:
            assert tc.index == 0 and tc.function.name in (None, "get_weather")
            streamed += tc.function.arguments or ""
    assert streamed == call.function.arguments
    with pytest.raises(openai.BadRequestError, match="tool_choice required or a named function"):
        client.chat.completions.create(tool_choice="auto", **kwargs)


def test_streamed_text_is_whole_utf8_characters(client):
    # The reply starts with Chinese characters whose UTF-8 bytes are split across byte-level tokens.
    messages = [{"role": "user", "content": "Translate 'thank you' into Chinese characters."}]
    kwargs = {"model": "SmolLM2-135M-Instruct", "messages": messages, "temperature": 0, "max_completion_tokens": 40}
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)]
    assert "".join(parts) == whole
    assert any(ord(ch) > 0x2E80 for ch in whole)  # CJK: several bytes, several tokens per character
    assert not any("\ufffd" in p for p in parts)


def test_aborted_stream_frees_its_blocks(server, client):
    idle = server.metric(KV_USAGE)
    aborts = _aborts(server)
    stream = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Once upon a time", max_tokens=400,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    for _, _chunk in zip(range(3), stream):
        pass
    assert server.metric(KV_USAGE) > idle  # the request holds blocks while it runs
    stream.close()
    assert server.wait_metric(KV_USAGE, idle) == idle
    assert server.wait_metric("kvserve:num_requests_running", 0) == 0
    assert _aborts(server) == aborts + 1
    after = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Once upon a time", max_tokens=8,
                                      temperature=0)
    assert after.usage.completion_tokens == 8 and after.choices[0].text


def test_client_that_gives_up_on_non_streamed_request_aborts_it(server):
    idle = server.metric(KV_USAGE)
    aborts = _aborts(server)
    body = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url("/v1/completions"), json=body, timeout=1.5)
    assert server.wait_metric(KV_USAGE, idle) == idle
    assert _aborts(server) == aborts + 1
    assert httpx.get(server.url("/health")).status_code == 200


def _aborts(server) -> float:
    return server.metric("kvserve:request_success_total", finished_reason="abort") or 0.0
