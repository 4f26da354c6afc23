"""How many CPU threads the engine's tensor ops use, chosen once per process at engine start.

Why not "one per core": torch splits every op across its OpenMP threads and waits for the slowest
at a barrier. When another process takes one of the cores, the thread sharing that core only runs
when the kernel scheduler gives it a slice (milliseconds), so every op, even a 100 us decode
matmul, waits milliseconds: on a shared 2-core machine two threads fell to a few percent of their
quiet speed, while one thread simply moves to the free core and keeps its speed
(benchmarks/thread_contention.py measures it; figures in benchmarks/README.md).

So the default leaves one core free: ``available cores - 1`` threads, at least 1. That core also
serves the HTTP/tokenizer thread of ``kvserve serve``. Precedence: an explicit request
(``--num-threads``, or ``configure_threads(n)``) > ``$KVSERVE_NUM_THREADS`` > the default.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

ENV_VAR = "KVSERVE_NUM_THREADS"


@dataclass(frozen=True)
class ThreadChoice:
    """The thread count the engine runs with and where it came from ('request', 'env' or 'default')."""

    num_threads: int
    source: str


def available_cpus() -> int:
    """Cores this process may run on (taskset and cgroup cpusets shrink it), not the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def default_num_threads(cpus: int) -> int:
    """All cores but one, at least one: the spare core absorbs a neighbour or the server's own threads."""
    return max(1, cpus - 1)


def _parse(value: int | str, origin: str) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{origin}={value!r} is not a thread count; give a positive integer") from None
    if n < 1:
        raise ValueError(f"{origin}={n} must be >= 1 (unset it to use the default)")
    return n


def pick_num_threads(requested: int | None, env: Mapping[str, str], cpus: int) -> ThreadChoice:
    """The thread count for ``requested`` (None: not asked), the environment and ``cpus`` cores.

    Raises ValueError naming the flag or variable when a given value is not a positive integer.
    """
    if requested is not None:
        return ThreadChoice(_parse(requested, "num_threads"), "request")
    if env.get(ENV_VAR, "").strip():
        return ThreadChoice(_parse(env[ENV_VAR].strip(), ENV_VAR), "env")
    return ThreadChoice(default_num_threads(cpus), "default")


class ThreadSettings:
    """Applies a choice to torch (a process-wide setting) and keeps an explicit request for the
    process: a later engine start without a request does not undo ``--num-threads``."""

    def __init__(self) -> None:
        self.explicit: ThreadChoice | None = None

    def configure(self, requested: int | None = None, env: Mapping[str, str] | None = None,
                  cpus: int | None = None) -> ThreadChoice:
        if requested is None and self.explicit is not None:
            choice = self.explicit
        else:
            choice = pick_num_threads(requested, os.environ if env is None else env,
                                      available_cpus() if cpus is None else cpus)
        if choice.source == "request":
            self.explicit = choice
        _apply(choice.num_threads)
        return choice


def _apply(num_threads: int) -> None:
    import torch

    if torch.get_num_threads() != num_threads:
        torch.set_num_threads(num_threads)


_SETTINGS = ThreadSettings()


def configure_threads(requested: int | None = None) -> ThreadChoice:
    """Set torch's intra-op thread count for this process; call at engine start and for ``--num-threads``."""
    return _SETTINGS.configure(requested)
