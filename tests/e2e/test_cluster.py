"""Two replicas of the bundled model behind one front end, on processes and on a real local Ray."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import httpx
import openai
import pytest

from tests.e2e.server import ServerProcess

pytestmark = pytest.mark.slow

ARGS = ["--data-parallel-size", "2", "--kv-cache-memory", "0.25", "--max-model-len", "1024"]


def _replicas(server) -> list[dict]:
    return httpx.get(server.url("/health"), timeout=5).json()["replicas"]


def _replica_pids(server) -> list[int]:
    """The replicas' server processes: the children listening on the replicas' ports."""
    import psutil

    ports = {int(r["url"].rsplit(":", 1)[1]) for r in _replicas(server)}
    pids = []
    for proc in psutil.process_iter():
        try:
            if any(c.laddr.port in ports and c.status == psutil.CONN_LISTEN for c in proc.net_connections("tcp")):
                pids.append(proc.pid)
        except (psutil.AccessDenied, psutil.NoSuchProcess):
            continue
    return pids


@pytest.fixture(scope="module", params=["mp", "ray"])
def cluster(request):
    if request.param == "ray":
        pytest.importorskip("ray")
    with ServerProcess(ARGS + ["--distributed-backend", request.param], startup_timeout=900) as server:
        yield server


def test_openai_client_streams_through_the_front_end(cluster):
    client = openai.OpenAI(base_url=cluster.url("/v1"), api_key="unused")
    chunks = list(client.chat.completions.create(model="SmolLM2-135M-Instruct", stream=True, max_tokens=12,
                                                 temperature=0, messages=[{"role": "user", "content": "Hi!"}]))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    out = client.completions.create(model="SmolLM2-135M-Instruct", prompt="The capital of France is", max_tokens=8,
                                    temperature=0)
    assert out.choices[0].text and out.usage.completion_tokens == 8
    again = client.completions.with_raw_response.create(model="SmolLM2-135M-Instruct",
                                                        prompt="The capital of France is", max_tokens=8, temperature=0)
    assert again.parse().choices[0].text == out.choices[0].text  # same prompt, same replica's cache: same answer
    assert again.headers["x-kvserve-replica"] in ("0", "1")
    with pytest.raises(openai.BadRequestError):  # the replica's 400 comes back as it was
        client.completions.create(model="SmolLM2-135M-Instruct", prompt="x", max_tokens=8, temperature=-1)


def test_metrics_and_health_cover_every_replica(cluster):
    replicas = _replicas(cluster)
    assert [r["healthy"] for r in replicas] == [True, True]
    text = httpx.get(cluster.url("/metrics"), timeout=10).text
    for replica in ("0", "1"):
        assert f'kvserve:num_requests_running{{replica="{replica}",model_name=' in text
        assert f'kvserve:replica_up{{replica="{replica}"}} 1' in text
        # the pool size the router models each replica's cache with is the replica's own
        pool = next(line for line in text.splitlines() if line.startswith(f'kvserve:kv_cache_blocks{{replica="{replica}"'))
        assert replicas[int(replica)]["kv_blocks"] == int(float(pool.rsplit(" ", 1)[1])) > 0
    assert text.count("# TYPE kvserve:num_requests_running gauge") == 1


def test_a_replica_killed_under_load_fails_nothing_silently(cluster):
    """Every request gets a complete answer or a clear error within seconds; the other replica serves the rest."""
    client = openai.OpenAI(base_url=cluster.url("/v1"), api_key="unused", max_retries=0, timeout=120)

    def ask(i: int) -> str:
        try:
            stream = client.completions.create(model="SmolLM2-135M-Instruct", prompt=f"Story {i}:", max_tokens=64,
                                               temperature=0, stream=True, extra_body={"ignore_eos": True})
            text, finish = "", None
            for c in stream:
                if c.choices:
                    text += c.choices[0].text
                    finish = c.choices[0].finish_reason or finish
            return "complete" if finish == "length" else f"incomplete: {finish}"
        except (openai.APIError, httpx.HTTPError) as e:
            return f"error: {e}"

    victim = _replica_pids(cluster)[0]
    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(ask, i) for i in range(8)]
        time.sleep(1.0)
        os.kill(victim, signal.SIGKILL)
        results = [f.result(timeout=120) for f in futures]
    assert time.monotonic() - start < 120
    assert all(r == "complete" or r.startswith("error") for r in results), results
    deadline = time.monotonic() + 10
    while sum(r["healthy"] for r in _replicas(cluster)) != 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert sum(r["healthy"] for r in _replicas(cluster)) == 1
    after = [ask(100 + i) for i in range(3)]  # new requests go to the survivor
    assert after == ["complete"] * 3
