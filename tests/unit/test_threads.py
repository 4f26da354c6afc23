"""The engine's thread picker: OpenMP wait policy, default from the cores, env and explicit overrides."""

from __future__ import annotations

import pytest

from kvserve.runtime import threads
from kvserve.runtime.threads import ENV_VAR, ThreadChoice, ThreadSettings, pick_num_threads, prepare_openmp


def test_bounded_spin_is_set_before_torch_loads():
    env: dict[str, str] = {}
    assert prepare_openmp(env, torch_loaded=False) is True
    assert env == {"GOMP_SPINCOUNT": str(threads.default_spin_count())}


@pytest.mark.parametrize("vendor, count", [("GenuineIntel", 3000), ("AuthenticAMD", 30_000), ("", 3000)])
def test_spin_count_follows_the_cpu_vendor(vendor, count):
    """A pause took ~25 ns on a Zen 4, shorter than Intel's ~140 cycles: AMD CPUs spin more rounds."""
    assert threads.default_spin_count(vendor) == count
    assert threads.default_spin_count() in (threads.DEFAULT_SPIN_COUNT, threads.AMD_SPIN_COUNT)
    assert threads.default_spin_count() <= threads.MAX_BOUNDED_SPIN_COUNT  # still counts as bounded


def test_too_late_after_torch_loaded():
    env: dict[str, str] = {}
    assert prepare_openmp(env, torch_loaded=True) is False  # GNU OpenMP's default spins long
    assert env == {}


@pytest.mark.parametrize("policy, bounded", [("ACTIVE", False), ("passive", True)])
def test_the_users_policy_is_kept(policy, bounded):
    env = {"OMP_WAIT_POLICY": policy}
    assert prepare_openmp(env, torch_loaded=False) is bounded
    assert env == {"OMP_WAIT_POLICY": policy}


@pytest.mark.parametrize("count, bounded", [("0", True), ("3000", True), ("300000", False), ("lots", False)])
def test_the_users_spin_count_is_kept(count, bounded):
    env = {"GOMP_SPINCOUNT": count}
    assert prepare_openmp(env, torch_loaded=False) is bounded
    assert env == {"GOMP_SPINCOUNT": count}
    assert prepare_openmp({"GOMP_SPINCOUNT": count, "OMP_WAIT_POLICY": "PASSIVE"}, torch_loaded=False) is bounded


@pytest.mark.parametrize("cpus, passive, expected", [(2, True, 2), (16, True, 16), (1, False, 1), (2, False, 1),
                                                     (16, False, 15)])
def test_default_uses_every_core_only_when_idle_threads_sleep(cpus, passive, expected):
    assert pick_num_threads(None, {}, cpus, passive) == ThreadChoice(expected, "default")


def test_env_overrides_the_default():
    assert pick_num_threads(None, {ENV_VAR: " 1 "}, 2, True) == ThreadChoice(1, "env")
    assert pick_num_threads(None, {ENV_VAR: ""}, 2, True) == ThreadChoice(2, "default")


def test_request_overrides_env():
    assert pick_num_threads(3, {ENV_VAR: "2"}, 2, True) == ThreadChoice(3, "request")


@pytest.mark.parametrize("requested, env, name", [(0, {}, "num_threads"), (None, {ENV_VAR: "two"}, ENV_VAR),
                                                  (None, {ENV_VAR: "-1"}, ENV_VAR)])
def test_bad_values_name_the_setting(requested, env, name):
    with pytest.raises(ValueError, match=name):
        pick_num_threads(requested, env, 2, True)


@pytest.fixture
def applied(monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(threads, "_apply", calls.append)
    return calls


def test_an_explicit_request_survives_a_later_engine_start(applied):
    settings = ThreadSettings(passive_wait=True)
    assert settings.configure(1, env={}, cpus=2).num_threads == 1
    assert settings.configure(None, env={ENV_VAR: "2"}, cpus=2) == ThreadChoice(1, "request")
    assert applied == [1, 1]


def test_without_a_request_each_start_reads_env_and_cores(applied):
    settings = ThreadSettings(passive_wait=False)
    assert settings.configure(None, env={}, cpus=4) == ThreadChoice(3, "default")
    assert settings.configure(None, env={ENV_VAR: "2"}, cpus=4) == ThreadChoice(2, "env")
    assert applied == [3, 2]


def test_a_default_that_leaves_a_core_idle_says_why(applied, caplog):
    with caplog.at_level("WARNING", logger="kvserve.runtime.threads"):
        ThreadSettings(passive_wait=False).configure(None, env={}, cpus=2)
    assert "torch was imported before kvserve" in caplog.text and "1 thread(s) on 2 cores" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="kvserve.runtime.threads"):
        ThreadSettings(passive_wait=True).configure(None, env={}, cpus=2)
        ThreadSettings(passive_wait=False).configure(None, env={ENV_VAR: "1"}, cpus=2)
    assert caplog.text == ""


def test_cli_flag_is_parsed():
    from kvserve.cli import build_parser

    assert build_parser().parse_args(["generate", "hi", "--num-threads", "2"]).num_threads == 2


class _Machine:
    """Fake /proc counters: ``others`` and ``own`` cores busy, advanced by hand (100 ticks/s)."""

    def __init__(self) -> None:
        self.now, self.busy, self.own, self.applied = 0.0, 0, 0, []

    def run(self, seconds: float, others: float, own: float) -> None:
        self.now += seconds
        self.busy += round((others + own) * 100 * seconds)
        self.own += round(own * 100 * seconds)

    def governor(self) -> threads.ContentionGovernor:
        g = threads.ContentionGovernor(frozenset({0, 1}), 2, busy_ticks=lambda _cpus: self.busy,
                                       own_ticks=lambda: self.own, clock=lambda: self.now, apply=self.applied.append)
        g.hz = 100
        return g


def test_governor_drops_a_thread_while_a_neighbour_is_busy_and_returns():
    m = _Machine()
    g = m.governor()
    assert g.tick() == 2
    m.run(0.6, others=0.3, own=1.7)  # a load generator beside us: keep both threads
    assert g.tick() == 2 and m.applied == []
    m.run(0.6, others=1.0, own=1.0)  # a busy loop on one core
    assert g.tick() == 1 and m.applied == [1]
    m.run(0.6, others=1.0, own=1.0)
    assert g.tick() == 1 and m.applied == [1]
    m.run(0.6, others=0.1, own=1.0)  # it stopped
    assert g.tick() == 2 and m.applied == [1, 2]


def test_governor_measures_at_most_once_per_interval():
    m = _Machine()
    g = m.governor()
    g.tick()
    m.run(0.1, others=2.0, own=0.0)
    assert g.tick() == 2  # too soon to judge
    m.run(0.5, others=2.0, own=0.0)
    assert g.tick() == 1


def test_only_the_default_thread_count_adapts(applied):
    settings = threads.ThreadSettings(passive_wait=True)
    settings.configure(requested=2, env={}, cpus=2)
    assert settings.governor is None
    settings = threads.ThreadSettings(passive_wait=True)
    settings.configure(env={}, cpus=2)
    assert settings.governor is not None and settings.governor.full == 2
    settings.configure(env={threads.ENV_VAR: "2"}, cpus=2)
    assert settings.governor is None
