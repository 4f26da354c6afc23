"""A request that makes a step raise fails alone; the batch around it finishes; a fault that is not
one request's stops the engine. Offline here (LLM / LLMEngine); over HTTP in test_server_faults.py."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.core import MAX_FAILED_STEPS, EngineFatalError, RequestFailedError
from tests.conftest import assert_no_leak


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(model=str(tiny_llama), num_kv_blocks=128, block_size=8, max_model_len=256, dtype="float32")


def poisoned(**overrides) -> SamplingParams:
    """Params that passed validation, then had top_p set to 0: what float32 made of top_p=5e-324
    before values were clamped where parsed. The sampling kernels refuse it."""
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=1, **overrides)
    params.top_p = 0.0
    return params


def test_tiny_top_p_is_clamped_where_parsed(llm):
    params = SamplingParams(max_tokens=4, top_p=5e-324, min_p=5e-324, temperature=5e-324, repetition_penalty=5e-324)
    assert params.top_p > 0 and params.min_p == 0 and params.temperature == 0 and params.repetition_penalty > 0
    out = llm.generate(["w1 w2 w3"], params)[0]
    assert len(out.token_ids) == 4
    assert_no_leak(llm)


@pytest.mark.parametrize("field, value", [("temperature", float("nan")), ("temperature", float("inf")),
                                          ("top_p", float("nan")), ("repetition_penalty", float("inf")),
                                          ("presence_penalty", float("nan")), ("top_k", 1 << 40), ("seed", 1 << 64),
                                          ("max_tokens", 1 << 40), ("temperature", "1"), ("n", True)])
def test_values_no_kernel_can_take_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_one_failing_request_in_a_batch_of_16(llm):
    engine = llm.engine
    good = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for i in range(16):
        engine.add_request(f"r{i}", [5 + i, 6, 7, 8], poisoned(ignore_eos=True) if i == 7 else good)
    finished, failed = {}, []
    while engine.has_unfinished():
        for out in engine.step(finished_only=True):
            finished[out.request_id] = out
        failed += engine.take_failed()
    assert sorted(finished) == sorted(f"r{i}" for i in range(16) if i != 7)
    assert all(len(o.token_ids) == 8 and o.finish_reason == "length" for o in finished.values())
    assert [e.request_id for e in failed] == ["r7"] and "r7" in str(failed[0])
    assert_no_leak(llm)
    # The others' outputs are what they would have been without the failing request.
    alone = llm.generate([[5 + i, 6, 7, 8] for i in range(16) if i != 7], good)
    assert [o.token_ids for o in alone] == [finished[f"r{i}"].token_ids for i in range(16) if i != 7]


def test_generate_raises_for_a_failing_request_and_stays_usable(llm):
    with pytest.raises(RequestFailedError, match="failed inside the engine"):
        llm.generate(["w1 w2", "w3 w4"], [SamplingParams(max_tokens=4), poisoned()])
    assert_no_leak(llm)
    assert len(llm.generate(["w1 w2"], SamplingParams(max_tokens=4))[0].token_ids) == 4


def test_n_siblings_fail_together(llm, monkeypatch):
    engine = llm.engine
    execute = engine.core.runner.execute

    def fails_for_one_sibling(out):
        if any(s.request_id == "fork#1" for s in out.scheduled):
            raise RuntimeError("injected")
        return execute(out)

    monkeypatch.setattr(engine.core.runner, "execute", fails_for_one_sibling)
    engine.add_request("fork", [5, 6, 7, 8], SamplingParams(max_tokens=8, n=3, ignore_eos=True))
    engine.add_request("ok", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0))
    done, failed = [], []
    while engine.has_unfinished():
        done += [o.request_id for o in engine.step(finished_only=True)]
        failed += [e.request_id for e in engine.take_failed()]
    assert done == ["ok"] and failed == ["fork"]
    assert_no_leak(llm)


def test_a_fault_that_is_every_requests_is_fatal(llm, monkeypatch):
    engine = llm.engine
    runner = engine.core.runner

    def broken(out):
        raise RuntimeError("device lost")

    monkeypatch.setattr(runner, "execute", broken)
    for i in range(MAX_FAILED_STEPS - 1):  # each alone in its step, as one bad request after another
        engine.add_request(f"f{i}", [5, 6, 7], SamplingParams(max_tokens=4))
        engine.step()
    engine.add_request("last", [5, 6, 7], SamplingParams(max_tokens=4))
    with pytest.raises(EngineFatalError, match="device lost"):
        engine.step()
    assert [e.request_id for e in engine.take_failed()] == [f"f{i}" for i in range(MAX_FAILED_STEPS - 1)]
