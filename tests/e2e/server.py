"""A real `kvserve serve` process on a free local port, for end-to-end tests (see kvserve/bench/launch.py)."""

from pathlib import Path

from kvserve.bench.launch import ServerProcess, free_port

ROOT = Path(__file__).resolve().parents[2]  # the repository, for subprocesses that run kvserve commands

__all__ = ["ROOT", "ServerProcess", "free_port"]
