"""Abort storms and overload: clients that leave mid-stream, bursts past --max-queue, n counted in
the queue, and streams cut by the shutdown deadline. After each, nothing is left running or waiting
and every KV block is back in the pool."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from tests.conftest import make_tiny_model
from tests.reliability.conftest import AUTH, assert_idle, start_server


@pytest.fixture(scope="module")
def server(chat_model):
    proc = start_server(chat_model, "--max-num-seqs", "8", "--max-queue", "32")
    yield proc
    assert proc.stop() == 0, proc.log_text()


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    # A long context, so one request runs for seconds: the queue checks and the shutdown's 1 s deadline
    # must not race its end (4,000 tokens of this tiny model took under 2 s on a quiet machine).
    return make_tiny_model(tmp_path_factory.mktemp("tiny-long"), "LlamaForCausalLM", max_position_embeddings=16384)


async def _storm(server, count: int, seed: int) -> dict[str, int]:
    """``count`` concurrent requests; a third leave before any token, a third mid-stream, a third finish."""
    rng = random.Random(seed)
    outcome = {"finished": 0, "left": 0, "429": 0, "5xx": 0}
    async with httpx.AsyncClient(base_url=server.base_url, headers=AUTH, timeout=60) as client:
        async def one(i: int) -> None:
            body = {"prompt": f"w{5 + i % 50} w7 w9", "max_tokens": rng.choice([8, 64, 200]), "ignore_eos": True,
                    "stream": i % 3 != 2, "n": rng.choice([1, 1, 2])}
            plan = i % 3  # 0: leave at once, 1: leave after a few chunks, 2: read it all
            try:
                if body["stream"]:
                    async with client.stream("POST", "/v1/completions", json=body) as r:
                        if r.status_code != 200:
                            outcome["429" if r.status_code == 429 else "5xx"] += 1
                            return
                        chunks = 0
                        async for line in r.aiter_lines():
                            chunks += line.startswith("data:")
                            if plan == 0 or (plan == 1 and chunks >= 3):
                                outcome["left"] += 1
                                return
                        outcome["finished"] += 1
                else:
                    r = await asyncio.wait_for(client.post("/v1/completions", json=body), rng.choice([0.05, 60]))
                    key = "finished" if r.status_code == 200 else "429" if r.status_code == 429 else "5xx"
                    outcome[key] += 1
            except asyncio.TimeoutError:
                outcome["left"] += 1

        for wave in range(0, count, 24):  # waves that fit the queue, so most requests get in
            await asyncio.gather(*(one(i) for i in range(wave, min(count, wave + 24))))
    return outcome


def test_abort_storm_leaks_nothing(server):
    outcome = asyncio.run(_storm(server, 120, seed=1))
    assert outcome["5xx"] == 0, outcome
    assert outcome["left"] > 20 and outcome["finished"] > 10, outcome
    assert_idle(server)


def test_overload_gets_fast_429s_and_recovers(server):
    async def burst():
        async with httpx.AsyncClient(base_url=server.base_url, headers=AUTH, timeout=60) as client:
            body = {"prompt": "w5 w6", "max_tokens": 32, "ignore_eos": True}
            return await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(120)))

    statuses = [r.status_code for r in asyncio.run(burst())]
    assert set(statuses) == {200, 429} and statuses.count(200) >= 32, statuses
    assert_idle(server)
    again = httpx.post(server.url("/v1/completions"), json={"prompt": "w5", "max_tokens": 4}, headers=AUTH, timeout=30)
    assert again.status_code == 200


def test_n_counts_in_the_queue_and_shutdown_ends_streams_with_an_error(long_model):
    proc = start_server(long_model, "--max-num-seqs", "1", "--max-queue", "8", "--max-model-len", "16384",
                        "--num-kv-blocks", "6100", "--shutdown-timeout", "1")
    try:
        long = {"prompt": "w5", "max_tokens": 16000, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=proc.base_url, headers=AUTH, timeout=30) as http:
            with http.stream("POST", "/v1/completions", json=long) as running:
                lines = running.iter_lines()
                next(lines)  # running: the only slot is taken for seconds
                with http.stream("POST", "/v1/completions", json={**long, "n": 5}) as waiting:
                    assert waiting.status_code == 200  # 5 of 8 waiting
                    refused = http.post("/v1/completions", json={"prompt": "w5", "n": 4})
                    assert refused.status_code == 429, refused.text  # 5 + 4 > 8
                    assert http.post("/v1/completions", json={"prompt": "w5", "n": 9}).status_code == 400
                    proc.proc.terminate()  # SIGTERM: a graceful shutdown with a 1 s deadline
                    rest = [line for line in lines if line.startswith("data:")]
                    queued = [line for line in waiting.iter_lines() if line.startswith("data:")]
        for events in (rest, queued):
            assert events[-1] == "data: [DONE]", events[-3:]
            error = json.loads(events[-2].removeprefix("data: "))["error"]
            assert "shutting down" in error["message"] and "--shutdown-timeout" in error["message"]
        assert proc.proc.wait(30) == 0, proc.log_text()
    finally:
        proc.stop()
