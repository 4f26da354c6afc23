"""How many CPU threads the engine's tensor ops use, and how long OpenMP's idle threads spin.

torch and kvserve's C++ kernels split every op across OpenMP threads and wait for the slowest at
a barrier. How a thread waits matters in both directions on a small shared machine:
- A thread that *sleeps* at once (``OMP_WAIT_POLICY=PASSIVE``) has to be woken by the next op, tens
  of microseconds each time; a decode step runs ~150 parallel kernels, so this alone halves the speed.
- A thread that *spins* without end (GNU OpenMP's default, or ``ACTIVE``) collapses when another
  process takes one of the cores: its sibling spins while the thread sharing the busy core waits
  for a time slice.
- A bounded spin (``GOMP_SPINCOUNT``) keeps threads awake between the kernels of a step and lets
  them sleep soon after; longer spins gain a little when quiet and lose far more with a busy core
  (``benchmarks/compare_engines.py`` with and without ``--busy-core 1`` measures both).

So kvserve sets ``GOMP_SPINCOUNT`` when it is imported, before torch starts OpenMP, unless the
environment already chose a policy or a spin count, and then uses every available core. The count
is of ``pause`` instructions, whose length differs by CPU: on AMD a pause is much longer than on
Intel, the Intel count let threads fall asleep between a single stream's decode steps, so AMD CPUs
get ``AMD_SPIN_COUNT`` (with a busy core the governor below runs one thread, so nothing spins). If torch
started OpenMP first, or the environment asks for unbounded spinning, kvserve leaves one core free
instead (``cores - 1``, at least 1).

Thread count precedence: an explicit request (``--num-threads``, ``configure_threads(n)``) >
``$KVSERVE_NUM_THREADS`` > the default above.

With the default, a ``ContentionGovernor`` also watches the cores: while other processes keep about
a core busy it runs one thread fewer, and all of them again once they stop. A thread that shares a
core with a busy neighbour gets half of it, and the whole step waits for it, while one thread runs
as fast on the free core as on a quiet machine (figures: benchmarks/RESULTS.md, "A busy core").
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass

log = logging.getLogger(__name__)

ENV_VAR = "KVSERVE_NUM_THREADS"
WAIT_POLICY = "OMP_WAIT_POLICY"
SPIN_COUNT = "GOMP_SPINCOUNT"
DEFAULT_SPIN_COUNT = 3000
AMD_SPIN_COUNT = 30_000
MAX_BOUNDED_SPIN_COUNT = 100_000  # beyond this a waiting thread burns milliseconds: treated as spinning


@dataclass(frozen=True)
class ThreadChoice:
    """The thread count the engine runs with and where it came from ('request', 'env' or 'default')."""

    num_threads: int
    source: str


def prepare_openmp(environ: MutableMapping[str, str], torch_loaded: bool) -> bool:
    """Ask for a bounded spin unless the user chose a policy or spin count; True if idle threads
    stop spinning soon (a bounded spin count, or passive waiting).

    OpenMP reads its environment once, when torch loads it, so this only takes effect if
    ``torch_loaded`` is False (or the policy was already in the environment).
    """
    if WAIT_POLICY not in environ and SPIN_COUNT not in environ and not torch_loaded:
        environ[SPIN_COUNT] = str(default_spin_count())
    spin = environ.get(SPIN_COUNT, "").strip()
    if spin:  # GNU OpenMP: overrides the policy's own spin count
        return spin.isdigit() and int(spin) <= MAX_BOUNDED_SPIN_COUNT
    return environ.get(WAIT_POLICY, "").strip().upper() == "PASSIVE"


def _cpuinfo_field(name: str) -> str:
    """The first core's ``name`` field of /proc/cpuinfo, or "" where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == name:
                    return value.strip()
    except OSError:
        pass
    return ""


def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id ("GenuineIntel", "AuthenticAMD"), or "" where there is none."""
    return _cpuinfo_field("vendor_id")


def cpu_family() -> int | None:
    """/proc/cpuinfo's cpu family (AMD: 25 = Zen 3/4, 26 = Zen 5), or None where there is none."""
    family = _cpuinfo_field("cpu family")
    return int(family) if family.isdigit() else None


def default_spin_count(vendor: str | None = None) -> int:
    """The bounded spin kvserve asks OpenMP for on this CPU (see the module docstring)."""
    return AMD_SPIN_COUNT if (cpu_vendor() if vendor is None else vendor) == "AuthenticAMD" else DEFAULT_SPIN_COUNT


def allowed_cpus() -> frozenset[int]:
    """The cores this process may run on (taskset and cgroup cpusets shrink it)."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return frozenset(range(os.cpu_count() or 1))


def available_cpus() -> int:
    """How many cores this process may run on, not the machine's count."""
    return len(allowed_cpus())


def default_num_threads(cpus: int, bounded_wait: bool) -> int:
    """Every core when idle threads soon sleep; else all but one, so a neighbour cannot strand a
    spinning barrier."""
    return cpus if bounded_wait else max(1, cpus - 1)


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


def _busy_ticks(cpus: frozenset[int]) -> int:
    """Clock ticks the cores ``cpus`` have spent busy since boot (every process, /proc/stat)."""
    total = 0
    with open("/proc/stat") as f:
        for line in f:
            if not line.startswith("cpu"):
                break  # the cpu lines come first
            name, *fields = line.split()
            if name != "cpu" and int(name[3:]) in cpus:  # "cpu" alone is the sum over all cores
                user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
                total += user + nice + system + irq + softirq + steal
    return total


def _own_ticks() -> int:
    """Clock ticks this process (all its threads) has run since it started."""
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime, stime


class ContentionGovernor:
    """Runs one thread fewer while other processes keep about a core of ours busy (more than
    ``high`` cores on average over ``interval`` seconds), and all threads again once they use less
    than ``low``. The engine calls ``tick()`` every step; it reads /proc at most once per interval."""

    def __init__(self, cpus: frozenset[int], full: int, interval: float = 0.5, high: float = 0.7,
                 low: float = 0.35, busy_ticks: Callable[[frozenset[int]], int] = _busy_ticks,
                 own_ticks: Callable[[], int] = _own_ticks, clock: Callable[[], float] = time.monotonic,
                 apply: Callable[[int], None] | None = None) -> None:
        self.cpus, self.full, self.reduced = cpus, full, max(1, full - 1)
        self.interval, self.high, self.low = interval, high, low
        self.busy_ticks, self.own_ticks, self.clock = busy_ticks, own_ticks, clock
        self.apply = apply or _apply
        self.hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.current = full
        self.others = 0.0  # cores other processes used over the last interval
        self._last: tuple[float, int, int] | None = None

    def tick(self) -> int:
        """Re-measure if an interval has passed and switch if needed; returns the thread count."""
        now = self.clock()
        if self._last is not None and now - self._last[0] < self.interval:
            return self.current
        try:
            busy, own = self.busy_ticks(self.cpus), self.own_ticks()
        except (OSError, ValueError, IndexError):  # no /proc (not Linux): keep what we have
            return self.current
        if self._last is not None:
            then, busy0, own0 = self._last
            self.others = ((busy - busy0) - (own - own0)) / ((now - then) * self.hz)
            want = self.current
            if self.current == self.full and self.others > self.high:
                want = self.reduced
            elif self.current == self.reduced and self.others < self.low:
                want = self.full
            if want != self.current:
                log.info("kvserve: other processes use %.1f cores; running %d threads", self.others, want)
                self.apply(want)
                self.current = want
        self._last = (now, busy, own)
        return self.current


class ThreadSettings:
    """Applies a choice to torch (a process-wide setting) and keeps an explicit request for the
    process: a later engine start without a request does not undo ``--num-threads``."""

    def __init__(self, passive_wait: bool) -> None:
        self.passive_wait = passive_wait
        self.explicit: ThreadChoice | None = None
        self.governor: ContentionGovernor | None = None

    def configure(self, requested: int | None = None, env: Mapping[str, str] | None = None,
                  cpus: int | None = None) -> ThreadChoice:
        cores = available_cpus() if cpus is None else cpus
        if requested is None and self.explicit is not None:
            choice = self.explicit
        else:
            choice = pick_num_threads(requested, os.environ if env is None else env, cores, self.passive_wait)
        if choice.source == "request":
            self.explicit = choice
        if choice.source == "default" and choice.num_threads < cores:
            # Easy to hit by accident (`import torch` before `import kvserve`) and it halves a 2-core machine.
            log.warning("kvserve: OpenMP's idle threads spin without bound here (torch was imported before "
                        "kvserve, or %s / %s ask for it), so kvserve runs %d thread(s) on %d cores. Import "
                        "kvserve first, or set %s to choose.", WAIT_POLICY, SPIN_COUNT, choice.num_threads,
                        cores, ENV_VAR)
        _apply(choice.num_threads)
        # Only the default adapts: an explicit count is the user's to keep.
        self.governor = (ContentionGovernor(allowed_cpus(), choice.num_threads)
                         if choice.source == "default" and choice.num_threads > 1 and sys.platform == "linux" else None)
        return choice

    def tick(self) -> None:
        if self.governor is not None:
            self.governor.tick()


def _apply(num_threads: int) -> None:
    import torch

    if torch.get_num_threads() != num_threads:
        torch.set_num_threads(num_threads)


# Decided once, when kvserve is imported (kvserve/__init__.py imports this module first).
_SETTINGS = ThreadSettings(prepare_openmp(os.environ, torch_loaded="torch" in sys.modules))


def openmp_waits_passively() -> bool:
    """Whether this process's OpenMP threads soon sleep (True) or spin without end while they wait."""
    return _SETTINGS.passive_wait


def configure_threads(requested: int | None = None) -> ThreadChoice:
    """Set torch's intra-op thread count for this process; call at engine start and for ``--num-threads``."""
    return _SETTINGS.configure(requested)


def balance_threads() -> None:
    """Called by the engine every step: lets the contention governor adjust the thread count."""
    _SETTINGS.tick()
