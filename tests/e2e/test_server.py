"""The OpenAI-compatible server on a tiny random model, driven by the official `openai` client.

One server process per module (tiny model: starts in about two seconds). The default model's
chat template and latency-dependent checks live in test_server_default_model.py.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from kvserve import LLM, SamplingParams
from tests.conftest import make_tiny_model
from tests.e2e.server import ServerProcess

ENGINE_ARGS = ["--num-kv-blocks", "64", "--block-size", "8", "--max-model-len", "256", "--dtype", "float32"]
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}w3{% endif %}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("tiny-chat"), "LlamaForCausalLM")
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    proc = ServerProcess([str(model_dir), *ENGINE_ARGS, "--served-model-name", "tiny", "tiny-alias"])
    yield proc
    assert proc.stop() == 0, proc.log_text()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(model_dir):
    return LLM(model=str(model_dir), num_kv_blocks=64, block_size=8, max_model_len=256)


GREEDY = {"temperature": 0, "max_tokens": 24, "extra_body": {"ignore_eos": True}}


def test_models_health_version_metrics_through_openai_clients(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny", "tiny-alias"]
    root = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)  # the non-/v1 routes
    assert root.get("/health", cast_to=httpx.Response).json() == {"status": "ok"}
    assert root.get("/version", cast_to=httpx.Response).json()["version"]
    metrics = root.get("/metrics", cast_to=httpx.Response)
    assert metrics.headers["content-type"].startswith("text/plain") and "kvserve:" in metrics.text

    async def run():
        async with openai.AsyncOpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0) as aclient:
            return [m.id async for m in aclient.models.list()]

    assert asyncio.run(run()) == ["tiny", "tiny-alias"]


@pytest.mark.parametrize("prompt", ["w5 w6 w7 w8", [5, 6, 7, 8]])
def test_completion_equals_offline_api(client, offline, prompt):
    want = offline.generate([prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    got = client.completions.create(model="tiny", prompt=prompt, **GREEDY)
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == "length"
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(want.prompt_token_ids), 24)
    chunks = list(client.completions.create(model="tiny-alias", prompt=prompt, stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == want.text


def test_stream_chunks_and_usage(client):
    chunks = list(client.completions.create(model="tiny", prompt="w9 w10", stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    *content, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 24
    assert [c.choices[0].finish_reason for c in content][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    assert all(c.usage is None for c in content)


def test_stream_of_several_prompts_counts_each_choice_once(client):
    chunks = list(client.completions.create(model="tiny", prompt=["w9 w10", "w11", "w12 w13 w14"], n=2, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    *content, last = chunks
    assert last.usage.completion_tokens == 3 * 2 * 24 and last.usage.prompt_tokens > 0
    assert sorted(c.choices[0].index for c in content if c.choices[0].finish_reason) == list(range(6))


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(client):
    """vLLM's stream_options.continuous_usage_stats: each chunk's usage counts the prompts and the
    completion tokens out so far, ending where the final usage chunk says; chat's role chunk too."""
    running = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(client.completions.create(model="tiny", prompt=["w9 w10", "w11"], n=2, stream=True,
                                            stream_options=running, **GREEDY))
    *content, last = chunks
    done = [c.usage.completion_tokens for c in content]
    assert done == sorted(done) and done[0] >= 1 and done[-1] == last.usage.completion_tokens == 2 * 2 * 24
    assert {c.usage.prompt_tokens for c in chunks} == {last.usage.prompt_tokens}
    chat = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w5"}], stream=True,
                                               stream_options=running, **GREEDY))
    role, *content, last = chat
    assert role.choices[0].delta.role == "assistant" and role.usage.completion_tokens == 0
    assert content[-1].usage.completion_tokens == last.usage.completion_tokens == 24
    assert {c.usage.prompt_tokens for c in chat} == {last.usage.prompt_tokens}
    plain = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w5"}], stream=True,
                                                stream_options={"include_usage": True, "continuous_usage_stats": False},
                                                **GREEDY))
    assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage.completion_tokens == 24


def test_async_client_streaming_and_not(server):
    async def run():
        aclient = openai.AsyncOpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0)
        whole = await aclient.completions.create(model="tiny", prompt="w11 w12", **GREEDY)
        stream = await aclient.completions.create(model="tiny", prompt="w11 w12", stream=True, **GREEDY)
        parts = [c.choices[0].text async for c in stream]
        chat = await aclient.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "w5 w6"}], max_completion_tokens=6,
            temperature=0, extra_body={"ignore_eos": True})
        chat_stream = await aclient.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "w5 w6"}], max_completion_tokens=6,
            temperature=0, stream=True, extra_body={"ignore_eos": True})
        chat_parts = [c.choices[0].delta.content or "" async for c in chat_stream if c.choices]
        await aclient.close()
        return whole, parts, chat, chat_parts

    whole, parts, chat, chat_parts = asyncio.run(run())
    assert "".join(parts) == whole.choices[0].text != ""
    assert "".join(chat_parts) == chat.choices[0].message.content != ""
    assert chat.usage.completion_tokens == 6


def test_concurrent_identical_greedy_requests_agree(server, client):
    async def run():
        aclient = openai.AsyncOpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0)
        outs = await asyncio.gather(*(aclient.completions.create(model="tiny", prompt="w20 w21 w22", **GREEDY)
                                      for _ in range(16)))
        await aclient.close()
        return [o.choices[0].text for o in outs]

    texts = asyncio.run(run())
    alone = client.completions.create(model="tiny", prompt="w20 w21 w22", **GREEDY).choices[0].text
    assert set(texts) == {alone}


def test_many_prompts_with_n(client):
    kwargs = {"model": "tiny", "prompt": ["w5 w6", "w7 w8 w9"], "n": 2, "temperature": 0.9, "seed": 3,
              "max_tokens": 8}
    first = client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2, 3]
    assert first.usage.prompt_tokens == 5 and first.usage.completion_tokens <= 32
    again = client.completions.create(**kwargs)
    assert [c.text for c in again.choices] == [c.text for c in first.choices]  # seeded: reproducible


def test_echo_with_logprobs(client, offline):
    got = client.completions.create(model="tiny", prompt=[5, 6, 7], echo=True, logprobs=2,
                                    **{**GREEDY, "max_tokens": 3})
    choice = got.choices[0]
    prompt_text = offline.get_tokenizer().decode([5, 6, 7])
    assert choice.text.startswith(prompt_text) and len(choice.text) > len(prompt_text)
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs[1:])
    # greedy: every generated token is its position's most likely one
    assert all(lp.token_logprobs[i] == pytest.approx(max(lp.top_logprobs[i].values())) for i in range(3, 6))


def test_stop_string_truncates(client):
    words = client.completions.create(model="tiny", prompt="w30 w31", **GREEDY).choices[0].text.split()
    stop = words[3]
    got = client.completions.create(model="tiny", prompt="w30 w31", stop=[stop], **GREEDY).choices[0]
    assert got.finish_reason == "stop" and stop not in got.text
    assert got.text.split() == words[:words.index(stop)]
    streamed = client.completions.create(model="tiny", prompt="w30 w31", stop=stop, stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in streamed) == got.text


def test_min_tokens_holds_back_stop_strings(client):
    """vLLM's min_tokens over HTTP: a stop string counts only once that many tokens are out."""
    free = client.completions.create(model="tiny", prompt="w30 w31", **GREEDY).choices[0].text
    stop = [free.split()[1]]
    early = client.completions.create(model="tiny", prompt="w30 w31", stop=stop, **GREEDY).choices[0]
    held = client.completions.create(model="tiny", prompt="w30 w31", stop=stop,
                                     **{**GREEDY, "extra_body": {"ignore_eos": True, "min_tokens": 24}}).choices[0]
    assert early.finish_reason == "stop" and (held.finish_reason, held.text) == ("length", free)


def test_allowed_token_ids_over_http(server, client):
    """vLLM's allowed_token_ids: the completion is made of those tokens only; a bad list is a 400."""
    free = client.completions.create(model="tiny", prompt="w30 w31", **GREEDY).choices[0].text
    allowed = httpx.post(server.url("/tokenize"), json={"model": "tiny", "prompt": "w77 w78", "add_special_tokens": False},
                         timeout=30).json()["tokens"]
    got = client.completions.create(model="tiny", prompt="w30 w31", **{**GREEDY, "extra_body": {
        "ignore_eos": True, "allowed_token_ids": allowed}}).choices[0].text
    assert got != free and set(got.split()) <= {"w77", "w78"}, got
    with pytest.raises(openai.BadRequestError, match="allowed_token_ids"):
        client.completions.create(model="tiny", prompt="w30", max_tokens=2, extra_body={"allowed_token_ids": []})
    with pytest.raises(openai.BadRequestError, match="allowed_token_ids"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w5"}], max_tokens=2,
                                       extra_body={"allowed_token_ids": [10**6]})


def test_bad_words_over_http(client):
    words = client.completions.create(model="tiny", prompt="w30 w31", **GREEDY).choices[0].text.split()
    got = client.completions.create(model="tiny", prompt="w30 w31", **{**GREEDY, "extra_body": {
        "ignore_eos": True, "bad_words": [words[2]]}}).choices[0].text.split()
    assert got[:2] == words[:2] and words[2] not in got
    with pytest.raises(openai.BadRequestError, match="bad_words"):
        client.completions.create(model="tiny", prompt="w30", max_tokens=2, extra_body={"bad_words": [""]})


def test_stop_string_kept_when_asked(client):
    free = client.completions.create(model="tiny", prompt="w30 w31", **GREEDY).choices[0].text
    stop = free.split()[3]
    kept = {"ignore_eos": True, "include_stop_str_in_output": True}
    got = client.completions.create(model="tiny", prompt="w30 w31", stop=[stop], **{**GREEDY, "extra_body": kept})
    assert got.choices[0].finish_reason == "stop" and got.choices[0].text == free[:free.index(stop) + len(stop)]
    streamed = client.completions.create(model="tiny", prompt="w30 w31", stop=[stop], stream=True,
                                         **{**GREEDY, "extra_body": kept})
    assert "".join(c.choices[0].text for c in streamed) == got.choices[0].text


def test_unknown_fields_are_ignored_and_named_in_the_log(server, client):
    body = {"model": "tiny", "prompt": "w5", "max_tokens": 2, "frobnicate": 1, "zz_unknown": {"a": 1}}
    for _ in range(3):
        assert httpx.post(server.url("/v1/completions"), json=body, timeout=30).status_code == 200
    deadline = time.monotonic() + 10
    while "frobnicate" not in server.log_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    lines = [line for line in server.log_text().splitlines() if "frobnicate" in line]
    assert len(lines) == 1 and "ignored: frobnicate, zz_unknown" in lines[0], lines


def test_truncate_prompt_tokens_keeps_the_prompt_tail(client):
    long = [(7 * i) % 500 + 3 for i in range(300)]  # past the 256-token context window
    with pytest.raises(openai.BadRequestError, match="context window"):
        client.completions.create(model="tiny", prompt=long, max_tokens=2)
    tail = client.completions.create(model="tiny", prompt=long[-20:], **GREEDY)
    got = client.completions.create(model="tiny", prompt=long, **{**GREEDY, "extra_body": {
        "ignore_eos": True, "truncate_prompt_tokens": 20}})
    assert got.usage.prompt_tokens == 20 and got.choices[0].text == tail.choices[0].text
    most = client.completions.create(model="tiny", prompt=long, max_tokens=1,
                                     extra_body={"truncate_prompt_tokens": -1})
    assert most.usage.prompt_tokens == 255
    text = " ".join(f"w{i % 90 + 5}" for i in range(400))  # a text too long for the window, kept to its tail
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": text}], max_tokens=2,
                                          extra_body={"truncate_prompt_tokens": 30})
    assert chat.usage.prompt_tokens == 30
    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens"):
        client.completions.create(model="tiny", prompt="w5", max_tokens=2, extra_body={"truncate_prompt_tokens": 0})


def test_tokenize_counts_what_the_engine_sees_and_detokenize_inverts_it(server, client):
    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(server.url(path), json=body, timeout=30)

    prompt = "w30 w31 w32"
    got = post("/tokenize", {"model": "tiny", "prompt": prompt}).json()
    used = client.completions.create(model="tiny", prompt=prompt, max_tokens=1).usage.prompt_tokens
    assert got["count"] == len(got["tokens"]) == used and got["max_model_len"] == 256
    assert post("/detokenize", {"model": "tiny", "tokens": got["tokens"]}).json()["prompt"].endswith(prompt)
    messages = [{"role": "user", "content": "w5 w6"}]
    chat = post("/tokenize", {"model": "tiny", "messages": messages}).json()
    assert chat["count"] == client.chat.completions.create(model="tiny", messages=messages,
                                                           max_tokens=1).usage.prompt_tokens
    long = post("/tokenize", {"prompt": "w5 " * 400}).json()  # counted though past the context window
    assert long["count"] >= 400 > long["max_model_len"]
    for path, body, status, field in [
            ("/tokenize", {"prompt": "w5", "messages": messages}, 400, None),
            ("/tokenize", {}, 400, None),
            ("/tokenize", {"prompt": "w5", "model": "gpt-4"}, 404, "model"),
            ("/detokenize", {"tokens": [5, 10**6]}, 400, "tokens"),
            ("/detokenize", {"tokens": "w5"}, 400, "tokens")]:
        response = post(path, body)
        assert response.status_code == status and response.json()["error"]["message"], (body, response.text)
        assert field is None or response.json()["error"]["param"] == field, response.text


def test_chat_stream_is_openai_shaped(server):
    body = {"model": "tiny", "messages": [{"role": "system", "content": "w4"}, {"role": "user", "content": "w5"}],
            "max_tokens": 5, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url("/v1/chat/completions"), json=body, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    finish = chunks[-2]["choices"][0]
    assert finish["delta"] == {} and finish["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    contents = [c["choices"][0]["delta"]["content"] for c in chunks[1:-2]]
    assert contents and all(contents)


def test_chat_with_logprobs_and_history(client):
    messages = [{"role": "system", "content": "w4"}, {"role": "user", "content": "w5 w6"},
                {"role": "assistant", "content": "w7"}, {"role": "user", "content": [{"type": "text", "text": "w8"}]}]
    got = client.chat.completions.create(model="tiny", messages=messages, logprobs=True, top_logprobs=3,
                                         max_completion_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    choice = got.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    content = choice.logprobs.content
    assert len(content) == 5 and all(len(t.top_logprobs) == 3 for t in content)
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in content)  # greedy
    assert [t.token for t in content] == choice.message.content.split()  # word-level tokenizer


def test_logprobs_name_tokens_by_id_when_asked(client, offline):
    """vLLM's return_tokens_as_token_ids: logprobs name each token ``token_id:N``, the same tokens and
    values as by text; echoed prompt tokens too."""
    tokenizer = offline.get_tokenizer()
    kwargs = dict(model="tiny", prompt=[5, 6, 7], echo=True, logprobs=2, **{**GREEDY, "max_tokens": 3})
    by_text = client.completions.create(**kwargs).choices[0].logprobs
    by_id = client.completions.create(**{**kwargs, "extra_body": {"ignore_eos": True,
                                                                   "return_tokens_as_token_ids": True}}).choices[0].logprobs
    ids = [int(t.removeprefix("token_id:")) for t in by_id.tokens]
    assert ids[:3] == [5, 6, 7] and [tokenizer.decode([i]) for i in ids] == by_text.tokens
    assert by_id.token_logprobs == by_text.token_logprobs
    messages = [{"role": "user", "content": "w5 w6"}]
    chat = [client.chat.completions.create(model="tiny", messages=messages, logprobs=True, top_logprobs=2,
                                           max_completion_tokens=4, temperature=0,
                                           extra_body={"ignore_eos": True, "return_tokens_as_token_ids": as_ids})
            for as_ids in (False, True)]
    text, named = (c.choices[0].logprobs.content for c in chat)
    assert [tokenizer.decode([int(t.token.removeprefix("token_id:"))]) for t in named] == [t.token for t in text]
    assert all(t.token.startswith("token_id:") and t.top_logprobs[0].token.startswith("token_id:") for t in named)


BAD_INPUTS = [
    ("/v1/completions", {"prompt": "w5", "max_tokens": "x"}, 400, "max_tokens", ["max_tokens"]),
    ("/v1/completions", {"prompt": "w5", "max_tokens": 300}, 400, "max_tokens", ["256", "301", "300"]),
    ("/v1/completions", {"prompt": [5] * 300}, 400, "prompt", ["300", "256"]),
    ("/v1/completions", {"prompt": "w5", "temperature": -1}, 400, "temperature", ["temperature"]),
    ("/v1/completions", {"prompt": "w5", "top_p": 0}, 400, "top_p", ["top_p"]),
    ("/v1/completions", {"prompt": "w5", "n": "2"}, 400, "n", ["n:"]),
    ("/v1/completions", {"prompt": "w5", "stop": 5}, 400, "stop", ["stop"]),
    ("/v1/completions", {"prompt": "w5", "seed": "x"}, 400, "seed", ["seed"]),
    ("/v1/completions", {"prompt": "w5", "presence_penalty": 3}, 400, "presence_penalty", ["presence_penalty"]),
    ("/v1/completions", {"prompt": "w5", "logprobs": 21}, 400, "logprobs", ["logprobs"]),
    ("/v1/completions", {"prompt": "w5", "logit_bias": {"100000": 1}}, 400, "logit_bias", ["logit_bias", "512"]),
    ("/v1/completions", {"prompt": [5, 100000]}, 400, "prompt", ["100000", "512"]),
    ("/v1/completions", {"prompt": []}, 400, "prompt", ["prompt"]),
    ("/v1/completions", {"prompt": ["w5", [5]]}, 400, "prompt", ["prompt"]),
    ("/v1/completions", {}, 400, "prompt", ["prompt"]),
    ("/v1/completions", [1, 2], 400, None, ["request body"]),
    ("/v1/completions", {"prompt": "w5", "model": "gpt-4"}, 404, "model", ["gpt-4"]),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", ["messages"]),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "w5"}]}, 400, "messages.0.role", ["role"]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w5"}], "top_logprobs": 2}, 400,
     "top_logprobs", ["top_logprobs"]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w5"}], "max_completion_tokens": 999}, 400,
     "max_completion_tokens", ["256", "999"]),
]


@pytest.mark.parametrize("path, body, status, param, words", BAD_INPUTS)
def test_bad_input_is_named_and_harmless(server, path, body, status, param, words):
    response = httpx.post(server.url(path), json=body, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert all(w in error["message"] for w in words), error["message"]


NASTY_BODIES = [
    b"\xff\xfe\x00", b"", b"null", b'"prompt"', b'{"prompt": NaN}', b'{"prompt": "w5", "temperature": NaN}',
    b'{"prompt": "w5", "top_p": Infinity}', b'{"prompt": "w5", "logit_bias": {"5": 1e309}}',
    b'{"prompt": "w5", "seed": 100000000000000000000000000000}', b'{"prompt": "w5", "max_tokens": 1e400}',
    b'{"prompt": [[]]}', b'{"prompt": [[5], []]}', b'{"prompt": [-1]}', b'{"prompt": null}', b'{"prompt": 5}',
    b'{"prompt": "w5", "stop": [null]}', b'{"prompt": "w5", "stop_token_ids": [-5]}',
    b'{"prompt": "w5", "logit_bias": {"5": "a"}}', b'{"prompt": "w5", "top_k": 1000000000, "max_tokens": 2}',
    b'{"prompt": "w5", "stream": true, "stream_options": {"include_usage": "yes"}}',
    b'{"prompt": "w5", "max_tokens": 100000000000000000000}', b'{"prompt": "w5", "n": 1000}',
    b'{"messages": [{"role": "user", "content": null}], "max_tokens": 2}',
    b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}',
    b'{"messages": [{"role": "user"}], "logprobs": true, "top_logprobs": 21}', b'{"messages": "hi"}',
]


@pytest.mark.parametrize("body", NASTY_BODIES)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_no_input_makes_a_500(server, path, body):
    response = httpx.post(server.url(path), content=body, headers={"content-type": "application/json"}, timeout=30)
    assert response.status_code < 500, response.text
    if response.status_code != 200:
        assert response.json()["error"]["message"]


def test_malformed_json_and_unknown_route(server, client):
    response = httpx.post(server.url("/v1/completions"), content=b"{not json", timeout=30,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]
    assert httpx.get(server.url("/v1/nothing")).json()["error"]["code"] == 404
    with pytest.raises(openai.NotFoundError, match="no-such-model"):
        client.completions.create(model="no-such-model", prompt="w5")
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="tiny", prompt="w5", max_tokens=10_000)
    # still healthy and serving (also after every input of test_no_input_makes_a_500)
    assert httpx.get(server.url("/health")).status_code == 200
    assert client.completions.create(model="tiny", prompt="w5", **GREEDY).usage.completion_tokens == 24


def test_metrics_exposition(server, client):
    client.completions.create(model="tiny", prompt="w40", **GREEDY)
    text = httpx.get(server.url("/metrics")).text
    for name in ("time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "e2e_request_latency_seconds_bucket", "request_queue_time_seconds_bucket", "prompt_tokens_total",
                 "generation_tokens_total", "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "num_preemptions_total", 'request_success_total{finished_reason="length"'):
        assert f"kvserve:{name}" in text, name
    assert server.metric("kvserve:generation_tokens_total") >= 24
    # a request's first token costs at least one computed prompt token, each later one a decode token
    computed, steps = server.metric("kvserve:computed_tokens_total"), server.metric("kvserve:engine_steps_total")
    assert 0 < steps <= computed and computed >= server.metric("kvserve:generation_tokens_total")


# ---- a second server: API key, overload, graceful shutdown -------------------------------------
@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    # A long context, so one request runs for ~10 s: the overload test must not race its end.
    path = make_tiny_model(tmp_path_factory.mktemp("tiny-long"), "LlamaForCausalLM", max_position_embeddings=4096)
    proc = ServerProcess([str(path), *ENGINE_ARGS, "--api-key", "sesame", "--max-queue", "1",
                          "--max-num-seqs", "1", "--max-model-len", "4096", "--num-kv-blocks", "600"])
    yield proc
    proc.stop()


def test_api_key_required(guarded):
    for key, ok in (("wrong", False), ("sesame", True)):
        client = openai.OpenAI(base_url=guarded.url("/v1"), api_key=key, max_retries=0)
        if ok:
            assert client.models.list().data
        else:
            with pytest.raises(openai.AuthenticationError, match="API key"):
                client.models.list()
    response = httpx.post(guarded.url("/v1/completions"), json={"prompt": "w5"})
    assert response.status_code == 401 and "Authorization" in response.json()["error"]["message"]
    assert httpx.get(guarded.url("/health")).status_code == 200  # probes need no key


def test_overload_answers_429_at_once(guarded):
    headers = {"Authorization": "Bearer sesame"}
    # 4000 tokens keep the one running slot busy for seconds; closing the streams aborts them.
    body = {"prompt": "w5", "max_tokens": 4000, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=guarded.base_url, headers=headers, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=body) as running:
            lines = running.iter_lines()  # kept: a discarded iterator closes the response, aborting it
            next(lines)  # the first request is running (max-num-seqs 1) ...
            with http.stream("POST", "/v1/completions", json=body) as waiting:  # ... the second waits
                assert waiting.status_code == 200
                refused = http.post("/v1/completions", json=body)
                assert refused.status_code == 429, refused.text
                assert "max-queue" in refused.json()["error"]["message"]
    assert guarded.wait_metric("kvserve:num_requests_running", 0) == 0
    ok = httpx.post(guarded.url("/v1/completions"), headers=headers, json={"prompt": "w5", "max_tokens": 2})
    assert ok.status_code == 200


def test_sigterm_finishes_in_flight_then_exits_zero(model_dir):
    proc = ServerProcess([str(model_dir), *ENGINE_ARGS])
    # Long enough to be still running when the signal comes (a stream's first chunk carries whatever
    # the engine made before the event loop sent it: under load, once, all of a 60-token request).
    body = {"prompt": "w5", "max_tokens": 250, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", proc.url("/v1/completions"), json=body, timeout=60) as response:
        lines = response.iter_lines()
        first = next(lines)
        proc.proc.terminate()
        events = [first, *(line for line in lines if line)]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["usage"]["completion_tokens"] == 250
    assert json.loads(events[-3][6:])["choices"][0]["finish_reason"] == "length"
    assert json.loads(first[6:])["choices"][0]["finish_reason"] is None  # it was in flight when stopped
    assert proc.stop() == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(proc.url("/health"))


def test_priority_orders_the_waiting_queue(model_dir):
    """vLLM's priority field: with one running slot, of two waiting requests the lower value runs first,
    though it arrived second."""
    args = [str(model_dir), "--num-kv-blocks", "160", "--block-size", "8", "--max-model-len", "1024", "--dtype",
            "float32", "--max-num-seqs", "1", "--served-model-name", "tiny"]
    body = {"model": "tiny", "prompt": [5, 6], "ignore_eos": True, "temperature": 0}

    async def waiting(proc, count: int) -> None:
        deadline = time.monotonic() + 20
        while proc.metric("kvserve:num_requests_waiting") != count:
            assert time.monotonic() < deadline, f"never {count} waiting"
            await asyncio.sleep(0.01)

    async def run(proc) -> list[str]:
        async with httpx.AsyncClient(timeout=60) as http:
            finished: list[str] = []

            async def short(name: str, priority: int) -> None:
                r = await http.post(proc.url("/v1/completions"), json={**body, "max_tokens": 4, "priority": priority})
                assert r.status_code == 200, r.text
                finished.append(name)

            async with http.stream("POST", proc.url("/v1/completions"),
                                   json={**body, "max_tokens": 1000, "stream": True}) as long:
                assert long.status_code == 200
                lines = long.aiter_lines()  # (kept: a dropped iterator closes the stream, which aborts it)
                await anext(lines)  # it holds the one slot now
                low = asyncio.create_task(short("low", 5))
                await waiting(proc, 1)
                high = asyncio.create_task(short("high", -5))
                await waiting(proc, 2)
            # leaving the stream aborts the long request: the two waiting ones run, high first
            await asyncio.gather(low, high)
            return finished

    with ServerProcess(args) as proc:
        assert asyncio.run(run(proc)) == ["high", "low"]
