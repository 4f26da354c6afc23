"""Start a `kvserve serve` process on a free local port and wait until it is healthy.

Used by the benchmarks that compare server settings and by the end-to-end tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from kvserve.entrypoints.cluster.launch import free_port, terminate, wait_for_health


class ServerProcess:
    """``kvserve serve ARGS --port <free>``, healthy on return; a context manager (SIGTERM on exit).

    ``preamble``: Python run in the server process before the command (fault-injection tests patch
    the engine with it)."""

    def __init__(self, args: list[str], startup_timeout: float = 300.0, preamble: str | None = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.startup_statuses: list[int] = []  # /health answers seen while waiting for 200
        self.log = tempfile.NamedTemporaryFile("w+", prefix="kvserve-server-", suffix=".log", delete=False)
        self._final_log: str | None = None  # the log's tail once the server has stopped and the file is gone
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        cmd = [sys.executable, "-m", "kvserve.cli", "serve", *args, "--port", str(self.port)]
        if preamble is not None:
            cmd[1:3] = ["-c", f"{preamble}\nimport sys\nfrom kvserve.cli import main\nsys.exit(main())"]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        try:
            self.seconds_to_healthy = wait_for_health(self.base_url, self.proc, startup_timeout,
                                                      statuses=self.startup_statuses)
        except (RuntimeError, TimeoutError) as e:
            self.stop()
            raise RuntimeError(f"{e}:\n{self.log_text()}") from None

    def url(self, path: str) -> str:
        return self.base_url + path

    def log_text(self) -> str:
        """The last 5,000 characters the server wrote (kept in memory once it has stopped)."""
        if self._final_log is not None:
            return self._final_log
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
        """SIGTERM (graceful shutdown), then wait; returns the exit code. The log file is removed
        (its tail stays readable through ``log_text``), so that runs leave nothing in the temp folder."""
        terminate(self.proc, timeout)
        if self._final_log is None:
            self._final_log = self.log_text()
            self.log.close()
            Path(self.log.name).unlink(missing_ok=True)
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
