"""Shared by the reliability suite: a tiny chat-capable model and checks that a server is back to idle."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.conftest import make_tiny_model
from tests.e2e.server import ServerProcess

ENGINE_ARGS = ["--num-kv-blocks", "96", "--block-size", "8", "--max-model-len", "256", "--dtype", "float32"]
CHAT_TEMPLATE = ("{% if greeting %}{{ greeting }} {% endif %}{% for m in messages %}{{ m['role'] }} {{ m['content'] }} "
                 "{% endfor %}{% if add_generation_prompt %}w3{% endif %}")
API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("tiny-reliability"), "LlamaForCausalLM")
    config_file = path / "tokenizer_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "chat_template": CHAT_TEMPLATE}))
    return path


def start_server(model, *extra: str, preamble: str | None = None) -> ServerProcess:
    return ServerProcess([str(model), *ENGINE_ARGS, "--served-model-name", "tiny", "--api-key", API_KEY, *extra],
                         preamble=preamble)


def metric(server: ServerProcess, name: str) -> float | None:
    for line in httpx.get(server.url("/metrics"), headers=AUTH, timeout=5).text.splitlines():
        if line.startswith((name + "{", name + " ")):
            return float(line.rsplit(" ", 1)[1])
    return None


def assert_idle(server: ServerProcess, timeout: float = 10.0) -> None:
    """Healthy, nothing running or waiting, and every KV block back in the pool (none leaked)."""
    import time

    names = ("kvserve:num_requests_running", "kvserve:num_requests_waiting", "kvserve:kv_cache_usage_perc")
    deadline = time.monotonic() + timeout
    while True:
        values = {n: metric(server, n) for n in names}
        if all(v == 0 for v in values.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert values == dict.fromkeys(names, 0.0), values
    assert httpx.get(server.url("/health"), timeout=5).status_code == 200


def raw_request(server: ServerProcess, head: str, body: bytes = b"", timeout: float = 10.0) -> tuple[int, bytes]:
    """Send a hand-written HTTP/1.1 request (what an HTTP client would refuse to send, such as a
    Content-Length with no body behind it) and return the status and response body. Whatever the
    server does not read is not sent; a server that never answers fails the test by the timeout."""
    import socket

    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as sock:
        try:
            sock.sendall(head.replace("\n", "\r\n").encode() + b"\r\n" + body)
        except OSError:  # the server answered and closed before taking it all, as it may
            pass
        data = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            data += chunk
    status_line, _, rest = data.partition(b"\r\n")
    assert status_line.startswith(b"HTTP/1.1 "), data[:200]
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]
