"""The bad-input catalogue: over a hundred malformed requests, each answered with a 4xx and OpenAI's
error JSON naming the field, and the server healthy and idle (no KV block held) after all of them.
The reproductions of issue 37 are here too, each with the answer it now gets."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.reliability.conftest import API_KEY, AUTH, assert_idle, raw_request, start_server

MAX_BYTES = 8 * 2**20
MAX_QUEUE = 8


@pytest.fixture(scope="module")
def server(chat_model):
    proc = start_server(chat_model, "--max-request-bytes", str(MAX_BYTES), "--max-queue", str(MAX_QUEUE),
                        "--metrics-require-key")
    yield proc
    assert proc.stop() == 0, proc.log_text()


OK_COMPLETION = {"model": "tiny", "prompt": "w5 w6", "max_tokens": 2}
OK_CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": 2}
SURROGATE = "w5 \ud800 w6"

# (field, bad value, status): set on a valid request of both endpoints.
SHARED = [
    ("max_tokens", "2", 400), ("max_tokens", 1.5, 400), ("max_tokens", 0, 400), ("max_tokens", -3, 400),
    ("max_tokens", True, 400), ("max_tokens", 1 << 40, 400),
    ("min_tokens", -1, 400), ("min_tokens", "3", 400), ("min_tokens", 3, 400),  # (3: above the request's max_tokens)
    ("include_stop_str_in_output", "yes", 400), ("skip_special_tokens", 0, 400),
    ("truncate_prompt_tokens", 0, 400), ("truncate_prompt_tokens", -2, 400), ("truncate_prompt_tokens", "5", 400),
    ("priority", "1", 400), ("priority", 1.5, 400), ("priority", 1 << 40, 400),
    ("temperature", "hot", 400), ("temperature", -0.5, 400), ("temperature", 2.5, 400), ("temperature", [1], 400),
    ("top_p", 0, 400), ("top_p", -0.1, 400), ("top_p", 1.5, 400), ("top_p", "1", 400),
    ("top_k", -2, 400), ("top_k", 1.5, 400), ("top_k", "4", 400), ("top_k", 1 << 40, 400),
    ("min_p", -0.1, 400), ("min_p", 1.5, 400), ("min_p", "0", 400),
    ("n", 0, 400), ("n", 129, 400), ("n", "2", 400), ("n", 1.5, 400), ("n", MAX_QUEUE + 1, 400),
    ("stop", 5, 400), ("stop", [1, 2], 400), ("stop", [""], 400), ("stop", {"a": 1}, 400), ("stop", [SURROGATE], 400),
    ("stop_token_ids", "x", 400), ("stop_token_ids", [-1], 400), ("stop_token_ids", ["a"], 400),
    ("stop_token_ids", [1 << 40], 400),
    ("seed", "x", 400), ("seed", 1.5, 400), ("seed", 1 << 64, 400),
    ("presence_penalty", 3, 400), ("presence_penalty", -3, 400), ("presence_penalty", "0", 400),
    ("frequency_penalty", 2.5, 400), ("frequency_penalty", None, 400),
    ("repetition_penalty", 0, 400), ("repetition_penalty", 11, 400), ("repetition_penalty", -1, 400),
    ("logit_bias", {"x": 1}, 400), ("logit_bias", {"5": 101}, 400), ("logit_bias", {"5": "1"}, 400),
    ("logit_bias", {"99999999": 1}, 400), ("logit_bias", [5], 400), ("logit_bias", {SURROGATE: 1}, 400),
    ("ignore_eos", "yes", 400), ("ignore_eos", 1, 400),
    ("stream", "yes", 400), ("stream", 0, 400),
    ("stream_options", {"include_usage": "y"}, 400), ("stream_options", "x", 400),
    ("user", 5, 400), ("user", SURROGATE, 400),
    ("model", 5, 400), ("model", "no-such-model", 404), ("model", SURROGATE, 400),
]
COMPLETION_ONLY = [
    ("prompt", "", 400), ("prompt", [], 400), ("prompt", [""], 400), ("prompt", [-1], 400),
    ("prompt", [99999999], 400), ("prompt", [[]], 400), ("prompt", 5, 400), ("prompt", None, 400),
    ("prompt", {"a": 1}, 400), ("prompt", [1.5], 400), ("prompt", [[5, "a"]], 400), ("prompt", SURROGATE, 400),
    ("prompt", ["w5", SURROGATE], 400), ("prompt", [5] * 300, 400), ("prompt", "w5 " * 200_000, 400),
    ("logprobs", -1, 400), ("logprobs", 21, 400), ("logprobs", "x", 400),
    ("echo", "x", 400), ("suffix", "x", 400), ("suffix", 5, 400), ("best_of", 2, 400), ("best_of", 0, 400),
]
CHAT_ONLY = [
    ("messages", [], 400), ("messages", "hi", 400), ("messages", [{}], 400), ("messages", None, 400),
    ("messages", [{"role": "wizard", "content": "x"}], 400), ("messages", [{"content": "x"}], 400),
    ("messages", [{"role": "user", "content": 5}], 400),
    ("messages", [{"role": "user", "content": [{"type": "image_url", "text": "x"}]}], 400),
    ("messages", [{"role": "user", "content": [{"type": "text"}]}], 400),
    ("messages", [{"role": "user", "content": SURROGATE}], 400),
    ("messages", [{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}], 400),
    ("messages", [{"role": "user", "content": "x", "name": SURROGATE}], 400),
    ("messages", [{"role": "user", "content": "x", "tool_calls": [{"id": SURROGATE}]}], 400),
    ("messages", [{"role": "user", "content": "w5 " * 200_000}], 400),
    ("max_completion_tokens", 0, 400), ("max_completion_tokens", "4", 400), ("max_completion_tokens", 10**6, 400),
    ("top_logprobs", 5, 400), ("top_logprobs", 21, 400), ("logprobs", "x", 400), ("add_generation_prompt", 1, 400),
    ("continue_final_message", True, 400), ("continue_final_message", "yes", 400),
    ("chat_template_kwargs", [], 400), ("chat_template_kwargs", {"tokenize": True}, 400),
    ("chat_template_kwargs", {"add_generation_prompt": False}, 400), ("chat_template_kwargs", {"tools": []}, 400),
]
CASES = ([("/v1/completions", OK_COMPLETION, *c) for c in SHARED + COMPLETION_ONLY]
         + [("/v1/chat/completions", OK_CHAT, *c) for c in SHARED + CHAT_ONLY])
# Bodies that are not a request at all: (path, content, status).
RAW = [(path, body, 400) for path in ("/v1/completions", "/v1/chat/completions")
       for body in (b"", b"{", b"[]", b"null", b"5", b'"text"', b'{"prompt": NaN}', b"\xff\xfe{}", b"{}",
                    b'{"prompt": "w5", "max_tokens": 2', b'{"messages": [{"role": "user", "content": "\\ud800"}]}')]
SEEN: dict[str, int] = {"payloads": 0, "5xx": 0}


def check_error(response: httpx.Response, status: int, field: str | None) -> None:
    SEEN["payloads"] += 1
    SEEN["5xx"] += response.status_code >= 500
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert error["message"] and error["type"] and "code" in error, error
    if field is not None:
        assert field in (error["param"] or "") or field in error["message"], error


def test_catalogue_has_over_a_hundred_payloads():
    assert len(CASES) + len(RAW) >= 100


@pytest.mark.parametrize("path, ok, field, value, status", CASES,
                         ids=[f"{p.rsplit('/', 1)[1]}-{c[0]}-{i}" for i, (p, _, *c) in enumerate(CASES)])
def test_bad_field(server, path, ok, field, value, status):
    body = {**ok, field: value}
    if field == "top_logprobs":  # only meaningful without logprobs=true, or out of range with it
        body["logprobs"] = value == 21
    response = httpx.post(server.url(path), content=json.dumps(body), timeout=30,
                          headers={**AUTH, "Content-Type": "application/json"})
    check_error(response, status, None if status == 404 else field)


@pytest.mark.parametrize("path, content, status", RAW)
def test_bad_body(server, path, content, status):
    response = httpx.post(server.url(path), content=content, timeout=30,
                          headers={**AUTH, "Content-Type": "application/json"})
    check_error(response, status, None)


@pytest.mark.parametrize("method, path, status", [("GET", "/v1/completions", 405), ("POST", "/v1/models", 405),
                                                  ("GET", "/v1/nowhere", 404), ("GET", "/nowhere", 404),
                                                  ("DELETE", "/health", 405)])
def test_bad_route(server, method, path, status):
    check_error(httpx.request(method, server.url(path), headers=AUTH, timeout=30), status, None)


def test_keys(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}, {"Authorization": "Basic dXNlcjpwYXNz"}):
        for path in ("/v1/models", "/metrics"):
            check_error(httpx.get(server.url(path), headers=headers, timeout=30), 401, None)
        for path in ("/tokenize", "/detokenize"):  # vLLM's paths, outside /v1
            check_error(httpx.post(server.url(path), json={"tokens": [5]}, headers=headers, timeout=30), 401, None)
    assert httpx.get(server.url("/metrics"), headers=AUTH, timeout=30).status_code == 200
    assert httpx.post(server.url("/detokenize"), json={"tokens": [5]}, headers=AUTH, timeout=30).status_code == 200
    for path in ("/health", "/version", "/openapi.json", "/docs"):  # open, by choice: probes and the schema
        assert httpx.get(server.url(path), timeout=30).status_code == 200


def test_chat_template_kwargs_reach_the_template(server):
    """The control for the chat_template_kwargs 400s above: a variable of the template's own is taken."""
    def prompt_tokens(**extra) -> int:
        response = httpx.post(server.url("/v1/chat/completions"), json={**OK_CHAT, **extra}, headers=AUTH, timeout=30)
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens"]

    assert prompt_tokens(chat_template_kwargs={"greeting": "w7 w8"}) > prompt_tokens(chat_template_kwargs={}) \
        == prompt_tokens()


# ---- issue 37's reproductions, each with what it gets now ------------------------------------------------------
def test_tiny_top_p_gets_an_answer(server):
    body = {"prompt": "hi", "max_tokens": 4, "top_p": 5e-324, "ignore_eos": True}
    response = httpx.post(server.url("/v1/completions"), json=body, headers=AUTH, timeout=30)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4


def test_a_huge_body_without_the_key_is_refused_unread(server):
    head = (f"POST /v1/completions HTTP/1.1\nHost: x\nContent-Type: application/json\n"
            f"Content-Length: {300 * 2**20}\n")
    start = time.monotonic()
    status, body = raw_request(server, head, b'{"prompt": "' + b"a" * 65536)
    assert status == 401 and b"API key" in body and time.monotonic() - start < 5


def test_a_content_length_with_no_body_gets_413_at_once(server):
    head = (f"POST /v1/completions HTTP/1.1\nHost: x\nAuthorization: Bearer {API_KEY}\n"
            f"Content-Type: application/json\nContent-Length: {100 * 2**20}\n")
    status, body = raw_request(server, head)
    assert status == 413 and b"max-request-bytes" in body


def test_a_chunked_body_over_the_limit_gets_413(server):
    head = (f"POST /v1/completions HTTP/1.1\nHost: x\nAuthorization: Bearer {API_KEY}\n"
            "Content-Type: application/json\nTransfer-Encoding: chunked\n")
    chunk = b"a" * 2**20
    status, _ = raw_request(server, head, (f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n") * 10 + b"0\r\n\r\n")
    assert status == 413


def test_a_4mb_prompt_is_refused_before_tokenizing(server):
    start = time.monotonic()
    response = httpx.post(server.url("/v1/completions"), json={"prompt": "w5 " * (4 * 2**20 // 3)}, headers=AUTH,
                          timeout=30)
    check_error(response, 400, "prompt")
    assert "context window" in response.json()["error"]["message"] and time.monotonic() - start < 3


def test_lone_surrogates_get_400_naming_the_field(server):
    for path, body, field in (("/v1/completions", {"prompt": SURROGATE}, "prompt"),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": SURROGATE}]},
                               "messages.0.content")):
        response = httpx.post(server.url(path), content=json.dumps(body), timeout=30,
                              headers={**AUTH, "Content-Type": "application/json"})
        check_error(response, 400, field)
        assert "Unicode" in response.json()["error"]["message"]


def test_n_beyond_the_queue_is_refused(server):
    response = httpx.post(server.url("/v1/completions"), json={"prompt": ["w5", "w6"], "n": 5}, headers=AUTH,
                          timeout=30)
    check_error(response, 400, "n")
    assert "--max-queue" in response.json()["error"]["message"]


def test_zz_server_healthy_and_idle_after_all(server):
    assert_idle(server)
    assert "Traceback" not in server.log_text(), server.log_text()
    print(f"\nbad-input catalogue: {SEEN['payloads']} payloads, {SEEN['5xx']} answered 5xx")
