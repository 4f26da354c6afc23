"""Start a `kvserve serve` process on a free local port and wait until it answers /health."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_health(base_url: str, proc: subprocess.Popen, timeout: float, poll: float = 0.05,
                    statuses: list[int] | None = None) -> float:
    """Seconds from now until ``GET base_url/health`` answers 200 (any OpenAI-style server).

    Raises RuntimeError if ``proc`` exits first and TimeoutError after ``timeout`` seconds; every
    status seen on the way is appended to ``statuses`` if given.
    """
    import httpx  # here, not at the top: `kvserve serve` imports this module for its options alone

    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before /health answered 200")
        try:
            status = httpx.get(base_url + "/health", timeout=1.0).status_code
        except httpx.HTTPError:
            status = None
        if status is not None and statuses is not None:
            statuses.append(status)
        if status == 200:
            return time.monotonic() - start
        time.sleep(poll)
    raise TimeoutError(f"no 200 from {base_url}/health within {timeout:.0f} s")


def start_server(args: list[str], host: str = "127.0.0.1", log=None,
                 die_with_parent: bool = False) -> tuple[subprocess.Popen, str]:
    """``kvserve serve ARGS`` on a free port of ``host``; returns the process and its base URL at once.

    ``die_with_parent`` (Linux): the server gets SIGTERM when the thread that started it ends, so a
    front end that is killed leaves no replica behind; only for a starter on its main thread.
    """
    port = free_port()
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "kvserve.cli", "serve", *args, "--host", host, "--port", str(port)]
    preexec = _term_with_parent if die_with_parent and sys.platform == "linux" else None
    proc = subprocess.Popen(cmd, stdout=log or subprocess.DEVNULL, stderr=subprocess.STDOUT, env=env,
                            preexec_fn=preexec)
    return proc, f"http://{host}:{port}"


def terminate(proc: subprocess.Popen, timeout: float) -> int:
    """SIGTERM (a server's graceful shutdown), SIGKILL after ``timeout`` seconds; the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def _term_with_parent() -> None:
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
