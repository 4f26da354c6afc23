"""The engine's thread picker: default from the cores, env and explicit-request overrides."""

from __future__ import annotations

import pytest

from kvserve.worker import threads
from kvserve.worker.threads import ENV_VAR, ThreadChoice, ThreadSettings, pick_num_threads


@pytest.mark.parametrize("cpus, expected", [(1, 1), (2, 1), (4, 3), (16, 15)])
def test_default_leaves_one_core_free(cpus, expected):
    assert pick_num_threads(None, {}, cpus) == ThreadChoice(expected, "default")


def test_env_overrides_the_default():
    assert pick_num_threads(None, {ENV_VAR: " 2 "}, 2) == ThreadChoice(2, "env")
    assert pick_num_threads(None, {ENV_VAR: ""}, 2) == ThreadChoice(1, "default")


def test_request_overrides_env():
    assert pick_num_threads(3, {ENV_VAR: "2"}, 2) == ThreadChoice(3, "request")


@pytest.mark.parametrize("requested, env, name", [(0, {}, "num_threads"), (None, {ENV_VAR: "two"}, ENV_VAR),
                                                  (None, {ENV_VAR: "-1"}, ENV_VAR)])
def test_bad_values_name_the_setting(requested, env, name):
    with pytest.raises(ValueError, match=name):
        pick_num_threads(requested, env, 2)


@pytest.fixture
def applied(monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(threads, "_apply", calls.append)
    return calls


def test_an_explicit_request_survives_a_later_engine_start(applied):
    settings = ThreadSettings()
    assert settings.configure(2, env={}, cpus=2).num_threads == 2
    assert settings.configure(None, env={ENV_VAR: "1"}, cpus=2) == ThreadChoice(2, "request")
    assert applied == [2, 2]


def test_without_a_request_each_start_reads_env_and_cores(applied):
    settings = ThreadSettings()
    assert settings.configure(None, env={}, cpus=4) == ThreadChoice(3, "default")
    assert settings.configure(None, env={ENV_VAR: "2"}, cpus=4) == ThreadChoice(2, "env")
    assert applied == [3, 2]


def test_cli_flag_reaches_the_settings(monkeypatch, applied):
    from kvserve.entrypoints.cli import build_parser

    args = build_parser().parse_args(["generate", "hi", "--num-threads", "2"])
    assert args.num_threads == 2
