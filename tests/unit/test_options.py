"""Options are defined once, in the config dataclasses; the CLI flags and LLM(...) keywords come from them."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from kvserve import LLM
from kvserve.cli import build_parser
from kvserve.config import EngineConfig, engine_config, engine_options
from kvserve.entrypoints.cli import add_engine_args, engine_kwargs

SECTIONS = {"cache", "scheduler", "speculative", "quant"}


def _config_fields():
    for f in dataclasses.fields(EngineConfig):
        if f.name in SECTIONS:
            yield from ((f.name, g) for g in dataclasses.fields(f.default_factory))
        else:
            yield None, f


def test_every_config_field_is_an_option_with_help():
    options = {(o.section, o.field): o for o in engine_options()}
    for section, f in _config_fields():
        assert (section, f.name) in options, f"{section}.{f.name} has no option(...) metadata"
        assert len(options[(section, f.name)].help) > 10, f"{section}.{f.name} needs help text"
    names = [o.name for o in engine_options()]
    assert len(names) == len(set(names)), "two fields share one flat option name"


@pytest.mark.parametrize("command", ["serve", "generate", "bench offline", "bench spec", "eval perplexity"])
def test_every_option_has_a_flag_with_its_help(command, capsys):
    argv = command.split() + ["--help"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for o in engine_options():
        assert o.flag in text, f"{command}: no {o.flag}"
        assert " ".join(o.help.split())[:30] in text, f"{command}: {o.flag} has lost its help"


def test_llm_keywords_are_the_options():
    params = inspect.signature(LLM.__init__).parameters
    assert set(params) - {"self"} == {o.name for o in engine_options()}
    for o in engine_options():
        assert params[o.name].default == o.default


def _parse(*flags: str) -> dict:
    import argparse

    p = argparse.ArgumentParser()
    add_engine_args(p)
    return engine_kwargs(p.parse_args(list(flags)))


def test_flags_reach_the_config_and_absent_flags_keep_the_defaults():
    assert _parse() == {}
    assert engine_config(**_parse()) == engine_config()
    config = engine_config(**_parse("--kv-cache-memory", "0.5", "--no-prefix-caching", "--scheduling-policy", "fcfs",
                                    "--speculative-method", "ngram", "--speculative-ngram-max", "3",
                                    "--quantization", "int8", "--quantization-group-size", "-1", "--num-threads", "1",
                                    "--enforce-eager", "--max-num-seqs", "7"))
    assert config.cache.kv_cache_memory_bytes == 2**29 and not config.cache.enable_prefix_caching
    assert config.scheduler.policy == "fcfs" and config.scheduler.max_num_seqs == 7
    assert config.speculative.method == "ngram" and config.speculative.ngram_max == 3
    assert config.quant.quantization == "int8" and config.quant.group_size == -1
    assert config.num_threads == 1 and config.enforce_eager


def test_bad_values_are_refused_by_the_parser_or_the_config():
    with pytest.raises(SystemExit):
        _parse("--kv-cache-dtype", "int3")
    with pytest.raises(ValueError, match="num_threads"):
        engine_config(**_parse("--num-threads", "0"))
    with pytest.raises(ValueError, match="unknown engine option"):
        engine_config(max_num_sequences=4)


def test_the_token_budget_follows_the_device_unless_given():
    assert engine_config().scheduler.max_num_batched_tokens == 1024
    assert engine_config(device="cuda").scheduler.max_num_batched_tokens == 8192
    assert engine_config(device="cuda", max_num_batched_tokens=512).scheduler.max_num_batched_tokens == 512
