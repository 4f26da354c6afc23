"""Fault isolation over HTTP: a request that makes a kernel raise fails alone while 15 others finish;
a fault that is every request's makes the server exit non-zero (for its supervisor to restart)."""

from __future__ import annotations

import asyncio

import httpx

from kvserve.entrypoints.serve_cli import EXIT_FATAL
from tests.reliability.conftest import AUTH, assert_idle, start_server

# What made top_p=5e-324 crash the server, with the clamp where it is parsed undone: the value
# reaches the C++ sampler as 0.0f, which refuses it.
UNCLAMPED = "import kvserve.types as t\nt.SamplingParams._clamp_to_kernel_range = lambda self: None"
# Every step raises once the warm-up is over, as a lost device or a broken build would.
BROKEN = ("import kvserve.worker.model_runner as m\nexecute = m.ModelRunner.execute\n"
          "def broken(self, out):\n"
          "    if any(not s.request_id.startswith('warm-up') for s in out.scheduled):\n"
          "        raise RuntimeError('device lost')\n"
          "    return execute(self, out)\n"
          "m.ModelRunner.execute = broken")


def test_the_reported_request_is_answered_and_the_server_stays_up(chat_model):
    with start_server(chat_model) as server:
        body = {"prompt": "hi", "max_tokens": 4, "top_p": 5e-324, "ignore_eos": True}
        r = httpx.post(server.url("/v1/completions"), json=body, headers=AUTH, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        assert_idle(server)


async def _batch(server, bad_index: int, stream: bool) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=server.base_url, headers=AUTH, timeout=60) as client:
        async def one(i):
            body = {"prompt": f"w{i + 5} w6 w7", "max_tokens": 32, "ignore_eos": True, "stream": stream,
                    "top_p": 5e-324 if i == bad_index else 1.0, "temperature": 1.0 if i == bad_index else 0}
            return await client.post("/v1/completions", json=body)
        return await asyncio.gather(*(one(i) for i in range(16)))


def test_a_kernel_that_raises_for_one_request_of_16_fails_it_alone(chat_model):
    with start_server(chat_model, preamble=UNCLAMPED) as server:
        responses = asyncio.run(_batch(server, 9, stream=False))
        statuses = [r.status_code for r in responses]
        assert statuses == [500 if i == 9 else 200 for i in range(16)], statuses
        assert all(r.json()["usage"]["completion_tokens"] == 32 for i, r in enumerate(responses) if i != 9)
        error = responses[9].json()["error"]
        assert "failed inside the engine" in error["message"] and "top_p" in error["message"]
        assert error["type"] == "internal_server_error"
        streamed = asyncio.run(_batch(server, 3, stream=True))
        assert all(r.status_code == 200 and r.text.endswith("data: [DONE]\n\n") for r in streamed)
        assert '"error"' in streamed[3].text
        assert all('"error"' not in r.text and '"finish_reason":"length"' in r.text
                   for i, r in enumerate(streamed) if i != 3)
        assert_idle(server)
        assert "engine loop died" not in server.log_text()
    assert server.proc.returncode == 0


def test_a_fault_that_is_not_one_requests_exits_non_zero(chat_model):
    server = start_server(chat_model, preamble=BROKEN)
    try:
        answers = []
        for i in range(5):
            try:
                r = httpx.post(server.url("/v1/completions"), json={"prompt": f"w{i + 5}", "max_tokens": 2},
                               headers=AUTH, timeout=30)
            except httpx.TransportError:  # the server has gone, as it should
                break
            answers.append(r.status_code)
            assert r.json()["error"]["message"]
        assert answers[:2] == [500, 500] and answers[2] == 503, answers
        assert server.proc.wait(30) == EXIT_FATAL, server.log_text()
    finally:
        server.stop()
    assert "shutting down with exit code" in server.log_text()
