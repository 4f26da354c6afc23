"""Start a `kvserve serve` process on a free local port and wait until it is healthy.

Used by the benchmarks that compare server settings and by the end-to-end tests.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``kvserve serve ARGS --port <free>``, healthy on return; a context manager (SIGTERM on exit)."""

    def __init__(self, args: list[str], startup_timeout: float = 300.0) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.startup_statuses: list[int] = []  # /health answers seen while waiting for 200
        self.log = tempfile.NamedTemporaryFile("w+", prefix="kvserve-server-", suffix=".log", delete=False)
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", *args, "--port", str(self.port)]
        started = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self._wait_healthy(started + startup_timeout)
        self.seconds_to_healthy = time.monotonic() - started

    def _wait_healthy(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_text()}")
            try:
                self.startup_statuses.append(httpx.get(self.url("/health"), timeout=1.0).status_code)
                if self.startup_statuses[-1] == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"server not healthy in time:\n{self.log_text()}")

    def url(self, path: str) -> str:
        return self.base_url + path

    def log_text(self) -> str:
        return Path(self.log.name).read_text()[-5000:]

    def metric(self, name: str, **labels: str) -> float | None:
        """The sample of ``name`` (with these label values) from /metrics; None if absent."""
        wanted = [f'{k}="{v}"' for k, v in labels.items()]
        for line in httpx.get(self.url("/metrics"), timeout=5).text.splitlines():
            if line.startswith((name + "{", name + " ")) and all(w in line for w in wanted):
                return float(line.rsplit(" ", 1)[1])
        return None

    def wait_metric(self, name: str, value: float, timeout: float = 10.0) -> float | None:
        deadline = time.monotonic() + timeout
        while (got := self.metric(name)) != value and time.monotonic() < deadline:
            time.sleep(0.05)
        return got

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM (graceful shutdown), then wait; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
