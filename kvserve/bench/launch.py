"""Start a `kvserve serve` process on a free local port and wait until it is healthy (benchmarks, tests)."""

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
    """``kvserve serve ARGS --port <free>``; usable as a context manager (SIGTERM on exit)."""

    def __init__(self, args: list[str], startup_timeout: float = 300.0) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.started_at = time.monotonic()
        self.log = tempfile.NamedTemporaryFile("w+", prefix="kvserve-server-", suffix=".log", delete=False)
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", *args, "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.seconds_to_healthy = self._wait_healthy(startup_timeout)

    def _wait_healthy(self, timeout: float) -> float:
        deadline = self.started_at + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_text()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=1.0).status_code == 200:
                    return time.monotonic() - self.started_at
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"server not healthy after {timeout} s:\n{self.log_text()}")

    def log_text(self) -> str:
        return Path(self.log.name).read_text()[-5000:]

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
