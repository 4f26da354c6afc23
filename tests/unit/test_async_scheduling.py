"""Async scheduling (``async_scheduling``: step N+1 scheduled while step N runs, its sampled ids read a
step late) changes when tokens are read, never which: outputs match the synchronous loop exactly,
stop conditions, aborts, preemption, speculation and n > 1 included, and no KV block is left behind."""

from __future__ import annotations

import argparse

import pytest

from kvserve import LLM, SamplingParams
from kvserve.config import engine_config
from kvserve.entrypoints.cli import add_engine_args, engine_kwargs
from tests.conftest import assert_no_leak, make_tiny_model
from tests.models.reference import motif_prompts, random_prompts

GREEDY = dict(temperature=0, ignore_eos=True)


def _llm(path, overlap: bool, **kw) -> LLM:
    llm = LLM(model=str(path), block_size=8, num_kv_blocks=kw.pop("num_kv_blocks", 256), async_scheduling=overlap,
              **kw)
    assert llm.engine.core.overlaps is overlap
    return llm


@pytest.fixture(scope="module")
def llms(tiny_llama):
    return {overlap: _llm(tiny_llama, overlap, max_num_seqs=16) for overlap in (False, True)}


def _generate(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_no_leak(llm)
    return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs]


def _both(llms, prompts, params):
    sync, overlapped = (_generate(llms[overlap], prompts, params) for overlap in (False, True))
    assert overlapped == sync
    return sync


def test_greedy_outputs_match_with_max_tokens_and_chunked_prefill(llms):
    prompts = random_prompts(12, 3, 120, seed=1)
    params = [SamplingParams(max_tokens=m, **GREEDY) for m in (1, 2, 7, 30) * 3]
    out = _both(llms, prompts, params)
    assert [len(o[0][0]) for o in out] == [p.max_tokens for p in params]


def test_stop_token_ids_and_stop_strings_match(llms):
    prompts = random_prompts(6, 5, 40, seed=2)
    free = _both(llms, prompts, SamplingParams(max_tokens=24, **GREEDY))
    # stop on a token each output reaches half-way, and on a word of another's text
    by_token = [SamplingParams(max_tokens=24, stop_token_ids=[o[0][0][10]], **GREEDY) for o in free]
    by_text = [SamplingParams(max_tokens=24, stop=[o[0][1].split()[6]], **GREEDY) for o in free]
    stopped = _both(llms, prompts * 2, by_token + by_text)
    assert all(o[0][2] == "stop" for o in stopped)
    assert all(len(o[0][0]) <= 11 for o in stopped[:6])


def test_min_tokens_holds_back_stops_the_same(llms):
    prompts = random_prompts(6, 5, 40, seed=5)
    free = _both(llms, prompts, SamplingParams(max_tokens=24, **GREEDY))
    stop_id = free[0][0][0][2]  # the third token of the first output: held back until 8 tokens are out
    params = [SamplingParams(max_tokens=24, stop_token_ids=[stop_id], logit_bias={stop_id: 100.0}, min_tokens=m,
                             **GREEDY) for m in (0, 1, 8, 8, 23, 24)]
    out = _both(llms, prompts, params)
    assert [len(o[0][0]) for o in out] == [1, 2, 9, 9, 24, 24]


def test_eos_ends_requests_the_same(tiny_llama, tmp_path):
    prompts = random_prompts(6, 5, 40, seed=3)
    probe = _llm(tiny_llama, False)
    tokens = [o.outputs[0].token_ids for o in probe.generate(prompts, SamplingParams(max_tokens=16, **GREEDY),
                                                             use_tqdm=False)]
    eos = tokens[0][5]  # the same weights with this token as EOS: the first request ends on it
    model = make_tiny_model(tmp_path / "eos", "LlamaForCausalLM", eos_token_id=eos)
    outs = {overlap: _generate(_llm(model, overlap), prompts, SamplingParams(max_tokens=16, temperature=0))
            for overlap in (False, True)}
    assert outs[True] == outs[False]
    assert outs[True][0][0][2] == "stop" and outs[True][0][0][0][-1] == eos


def test_preemption_in_a_tiny_pool_loses_and_repeats_nothing(tiny_llama, llms):
    prompts = random_prompts(8, 20, 60, seed=4)
    params = SamplingParams(max_tokens=40, **GREEDY)
    want = _generate(llms[False], prompts, params)
    for overlap in (False, True):
        small = _llm(tiny_llama, overlap, num_kv_blocks=24)  # 192 tokens for ~8 x 80
        assert _generate(small, prompts, params) == want
        assert small.engine.core.scheduler.num_preemptions > 0


def test_abort_mid_stream(llms):
    prompts = random_prompts(4, 5, 30, seed=5)
    params = SamplingParams(max_tokens=30, **GREEDY)
    want = _generate(llms[False], prompts, params)
    for overlap in (False, True):
        engine = llms[overlap].engine
        for i, prompt in enumerate(prompts):
            engine.add_request(f"a{i}", prompt, params)
        got: dict[str, list[int]] = {}
        steps = 0
        while engine.has_unfinished():
            for out in engine.step():
                got[out.request_id] = list(out.outputs[0].token_ids)
            steps += 1
            if steps == 6:
                assert engine.core.scheduler.requests["a1"].num_pending == int(overlap)
                engine.abort_request("a1")  # mid-decode: in the async loop its next token is in flight
                # the id comes back at once as a new request: the in-flight token is not its own
                engine.add_request("a1", prompts[3], params)
        assert got["a1"] == want[3][0][0]
        assert [got[f"a{i}"] for i in (0, 2, 3)] == [want[i][0][0] for i in (0, 2, 3)]
        assert_no_leak(llms[overlap])


def test_n_gt_1_seeded_sampling_and_logprobs_match(llms):
    prompts = random_prompts(4, 5, 30, seed=6)
    params = [SamplingParams(max_tokens=12, n=3, temperature=0.8, seed=11, ignore_eos=True),
              SamplingParams(max_tokens=12, n=2, **GREEDY),
              SamplingParams(max_tokens=12, logprobs=2, prompt_logprobs=1, **GREEDY),
              SamplingParams(max_tokens=12, temperature=0.7, top_p=0.9, seed=3, ignore_eos=True)]
    _both(llms, prompts, params)
    # a request with penalties samples by every token so far: steps are synchronous while it runs
    _both(llms, prompts, params[:3] + [SamplingParams(max_tokens=12, repetition_penalty=1.5, **GREEDY)])
    outs = {o: llms[o].generate(prompts[2:3], params[2], use_tqdm=False)[0] for o in (False, True)}
    assert outs[True].outputs[0].logprobs == outs[False].outputs[0].logprobs
    assert outs[True].prompt_logprobs == outs[False].prompt_logprobs


def test_prefix_cache_hits_the_same_blocks(llms):
    shared = random_prompts(1, 40, 40, seed=7)[0]
    prompts = [shared + tail for tail in random_prompts(4, 3, 9, seed=8)]
    params = SamplingParams(max_tokens=20, **GREEDY)
    before = {o: llms[o].engine.core.stats().prefix_cache_hits for o in (False, True)}
    for _ in range(2):  # the second round reads what the first published, decoded blocks included
        _both(llms, prompts + [p + o[0][0] for p, o in zip(prompts, _both(llms, prompts, params))], params)
    hits = {o: llms[o].engine.core.stats().prefix_cache_hits - before[o] for o in (False, True)}
    assert hits[True] == hits[False] > 0


def test_ngram_speculation_runs_synchronous_steps(tiny_llama, llms):
    prompts = motif_prompts(4, seed=9)
    params = SamplingParams(max_tokens=24, **GREEDY)
    want = _generate(llms[False], prompts, params)
    spec = _llm(tiny_llama, True, speculative_method="ngram", num_speculative_tokens=3)
    assert _generate(spec, prompts, params) == want
    assert spec.engine.core.stats().spec_accepted_tokens > 0


def test_option_and_flag():
    assert engine_config().overlap_steps is False  # the CPU default: see benchmarks/async_scheduling.py
    assert engine_config(device="cuda").overlap_steps is True
    assert engine_config(async_scheduling=True).overlap_steps is True
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        engine_config(async_scheduling=True, tensor_parallel_size=2)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert "async_scheduling" not in engine_kwargs(parser.parse_args([]))  # the config's default applies
    assert engine_kwargs(parser.parse_args(["--async-scheduling"]))["async_scheduling"] is True
    assert engine_kwargs(parser.parse_args(["--no-async-scheduling"]))["async_scheduling"] is False


def test_a_failing_request_is_taken_out_and_the_rest_match(llms, monkeypatch):
    prompts = random_prompts(3, 5, 30, seed=10)
    params = SamplingParams(max_tokens=16, **GREEDY)
    want = _generate(llms[False], prompts, params)
    engine = llms[True].engine
    execute = engine.core.runner.execute
    calls = [0]

    def fails_for_one(out, *args, **kwargs):
        calls[0] += 1
        if calls[0] > 4 and any(s.request_id == "bad" for s in out.scheduled):
            raise RuntimeError("injected")  # mid-stream: the batch is rerun request by request, read at once
        return execute(out, *args, **kwargs)

    monkeypatch.setattr(engine.core.runner, "execute", fails_for_one)
    for rid, prompt in zip(("a", "bad", "b"), prompts):
        engine.add_request(rid, prompt, params)
    got, failed = {}, []
    while engine.has_unfinished():
        got.update({o.request_id: o.outputs[0].token_ids for o in engine.step(finished_only=True)})
        failed += [e.request_id for e in engine.take_failed()]
    assert failed == ["bad"] and got == {"a": want[0][0][0], "b": want[2][0][0]}
    assert_no_leak(llms[True])


def test_a_hybrid_model_matches_with_its_window_blocks_released(tmp_path):
    """Gemma 2's local layers hold only their window (KV groups): the one-step-late loop frees and
    reuses those blocks as the synchronous one does, across preemptions."""
    path = make_tiny_model(tmp_path / "gemma2", "Gemma2ForCausalLM", num_hidden_layers=4, sliding_window=12)
    llms = {overlap: _llm(path, overlap, num_kv_blocks=40, max_num_seqs=8) for overlap in (False, True)}
    assert llms[True].engine.core.kv_cache.layout.is_hybrid
    prompts = random_prompts(8, 20, 60, seed=11)
    _both(llms, prompts, SamplingParams(max_tokens=40, **GREEDY))
    assert all(llm.engine.core.scheduler.num_preemptions > 0 for llm in llms.values())
