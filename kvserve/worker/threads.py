"""How many CPU threads the engine's tensor ops use, and how OpenMP's idle threads wait.

torch splits every op across its OpenMP threads and waits for the slowest at a barrier. By default
GNU OpenMP (what the torch wheels use) makes a thread that reaches the barrier early *spin*. When
another process takes one of the cores, the thread that shares that core runs only when the kernel
scheduler gives it a slice, and meanwhile its sibling spins, burning the core the straggler could
have moved to: on a shared 2-core machine two spinning threads fell to a tenth of one thread's W1
throughput. With ``OMP_WAIT_POLICY=PASSIVE`` a thread that is done sleeps at once, its core goes
idle, and the straggler is pulled onto it; two passive threads held up with a busy core and beat one
thread (benchmarks/thread_contention.py measures all of this; figures in benchmarks/README.md).

So kvserve sets ``OMP_WAIT_POLICY=PASSIVE`` (unless the environment already says otherwise) when
it is imported, before torch starts OpenMP, and then uses every available core. If torch started
OpenMP first, or the policy is not PASSIVE, idle threads spin and kvserve leaves one core free
instead (``cores - 1``, at least 1).

Thread count precedence: an explicit request (``--num-threads``, ``configure_threads(n)``) >
``$KVSERVE_NUM_THREADS`` > the default above.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

ENV_VAR = "KVSERVE_NUM_THREADS"
WAIT_POLICY = "OMP_WAIT_POLICY"


@dataclass(frozen=True)
class ThreadChoice:
    """The thread count the engine runs with and where it came from ('request', 'env' or 'default')."""

    num_threads: int
    source: str


def prepare_openmp(environ: MutableMapping[str, str], torch_loaded: bool) -> bool:
    """Ask for passive OpenMP waiting unless the user chose a policy; True if idle threads will sleep.

    OpenMP reads its environment once, when torch loads it, so this only takes effect if
    ``torch_loaded`` is False (or the policy was already in the environment).
    """
    if WAIT_POLICY not in environ and not torch_loaded:
        environ[WAIT_POLICY] = "PASSIVE"
    spin_count = environ.get("GOMP_SPINCOUNT", "").strip()  # GNU OpenMP: overrides the policy's spinning
    return environ.get(WAIT_POLICY, "").strip().upper() == "PASSIVE" and spin_count in ("", "0")


def available_cpus() -> int:
    """Cores this process may run on (taskset and cgroup cpusets shrink it), not the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def default_num_threads(cpus: int, passive_wait: bool) -> int:
    """Every core when idle threads sleep; else all but one, so a neighbour cannot strand a spinning barrier."""
    return cpus if passive_wait else max(1, cpus - 1)


def _parse(value: int | str, origin: str) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{origin}={value!r} is not a thread count; give a positive integer") from None
    if n < 1:
        raise ValueError(f"{origin}={n} must be >= 1 (unset it to use the default)")
    return n


def pick_num_threads(requested: int | None, env: Mapping[str, str], cpus: int, passive_wait: bool) -> ThreadChoice:
    """The thread count for ``requested`` (None: not asked), the environment and ``cpus`` cores.

    Raises ValueError naming the flag or variable when a given value is not a positive integer.
    """
    if requested is not None:
        return ThreadChoice(_parse(requested, "num_threads"), "request")
    if env.get(ENV_VAR, "").strip():
        return ThreadChoice(_parse(env[ENV_VAR].strip(), ENV_VAR), "env")
    return ThreadChoice(default_num_threads(cpus, passive_wait), "default")


class ThreadSettings:
    """Applies a choice to torch (a process-wide setting) and keeps an explicit request for the
    process: a later engine start without a request does not undo ``--num-threads``."""

    def __init__(self, passive_wait: bool) -> None:
        self.passive_wait = passive_wait
        self.explicit: ThreadChoice | None = None

    def configure(self, requested: int | None = None, env: Mapping[str, str] | None = None,
                  cpus: int | None = None) -> ThreadChoice:
        if requested is None and self.explicit is not None:
            choice = self.explicit
        else:
            choice = pick_num_threads(requested, os.environ if env is None else env,
                                      available_cpus() if cpus is None else cpus, self.passive_wait)
        if choice.source == "request":
            self.explicit = choice
        _apply(choice.num_threads)
        return choice


def _apply(num_threads: int) -> None:
    import torch

    if torch.get_num_threads() != num_threads:
        torch.set_num_threads(num_threads)


# Decided once, when kvserve is imported (kvserve/__init__.py imports this module first).
_SETTINGS = ThreadSettings(prepare_openmp(os.environ, torch_loaded="torch" in sys.modules))


def openmp_waits_passively() -> bool:
    """Whether this process's OpenMP threads sleep (True) or spin while they wait."""
    return _SETTINGS.passive_wait


def configure_threads(requested: int | None = None) -> ThreadChoice:
    """Set torch's intra-op thread count for this process; call at engine start and for ``--num-threads``."""
    return _SETTINGS.configure(requested)
