"""Prefix caching and copy-on-write forks change nothing in the outputs, only the work done."""

from __future__ import annotations

import random

from kvserve import LLM, SamplingParams
from kvserve.bench.prefix_workloads import agentic_branches, multi_turn_chat, shared_system_prompt
from tests.conftest import TINY_VOCAB, assert_no_leak

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _llm(path, caching: bool, **kw) -> LLM:
    kw = {"num_kv_blocks": 512, "block_size": 4, **kw}
    return LLM(model=str(path), enable_prefix_caching=caching, **kw)


def _run_rounds(llm: LLM, rounds: list[list[list[int]]]) -> list[list[int]]:
    """Each round's prompts may extend earlier outputs, as a chat or an agent would."""
    outs = []
    for prompts in rounds:
        outs += [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    return outs


def _workloads():
    rng = random.Random(0)
    vocab = (3, TINY_VOCAB)
    return {
        "shared_system_prompt": [shared_system_prompt(rng, 12, 60, vocab)],
        "multi_turn": multi_turn_chat(rng, conversations=3, turns=3, vocab=vocab, turn_len=(5, 15)),
        "agentic": agentic_branches(rng, context_len=50, branches=4, rounds=2, vocab=vocab),
    }


def test_outputs_identical_with_and_without_caching(tiny_llama):
    on, off = _llm(tiny_llama, True), _llm(tiny_llama, False)
    for name, rounds in _workloads().items():
        assert _run_rounds(on, rounds) == _run_rounds(off, rounds), name
    stats = on.engine.core.kv_cache.prefix_stats
    assert stats.hits > 0.5 * stats.queries, f"hit rate {stats.hit_rate:.2f}"
    assert off.engine.core.kv_cache.prefix_stats.hits == 0
    assert_no_leak(on)
    assert_no_leak(off)


def test_identical_under_preemption(tiny_qwen2):
    rounds = _workloads()["shared_system_prompt"]
    small = _llm(tiny_qwen2, True, num_kv_blocks=40, max_num_batched_tokens=64)
    big = _llm(tiny_qwen2, False)
    assert _run_rounds(small, rounds) == _run_rounds(big, rounds)
    assert small.engine.core.scheduler.num_preemptions > 0
    assert_no_leak(small)


def test_cached_tokens_reported_per_request(tiny_llama):
    llm = _llm(tiny_llama, True)
    prefix = list(range(3, 43))  # 40 tokens = 10 full blocks
    first = llm.generate([prefix + [50]], GREEDY)[0]
    second = llm.generate([prefix + [60, 61]], GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 40


def test_n_siblings_fork_instead_of_recomputing(tiny_llama):
    llm = _llm(tiny_llama, False)  # forks share blocks even with the prefix cache off
    prompt = list(range(3, 33))  # 30 tokens: 7 full blocks + a partial one that must be copied
    greedy = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    out = llm.generate([prompt], SamplingParams(n=3, max_tokens=10, temperature=0, ignore_eos=True))[0]
    assert [c.token_ids for c in out.outputs] == [greedy.token_ids] * 3
    assert [c.num_cached_tokens for c in out.outputs][1:] == [29, 29]
    sampled = llm.generate([prompt], SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=7, ignore_eos=True))[0]
    alone = [llm.generate([prompt], SamplingParams(max_tokens=10, temperature=1.0, seed=7 + i, ignore_eos=True))[0]
             for i in range(3)]
    assert [c.token_ids for c in sampled.outputs] == [a.token_ids for a in alone]
    assert_no_leak(llm)


def test_priority_runs_first(tiny_llama):
    llm = _llm(tiny_llama, True, max_num_seqs=1)
    engine = llm.engine
    engine.add_request("low", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0), priority=5)
    engine.add_request("high", [8, 9, 10], SamplingParams(max_tokens=3, temperature=0), priority=-1)
    finished = []
    while engine.has_unfinished():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["high", "low"]


def test_shortest_first_changes_the_order_not_the_outputs(tiny_llama):
    """A burst of mixed prompt lengths: shortest-first finishes the short ones first, and every
    request's tokens are the ones FCFS gives."""
    rng = random.Random(1)
    lens = [40, 6, 30, 3, 18]
    prompts = [[rng.randrange(3, TINY_VOCAB) for _ in range(n)] for n in lens]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    results = {}
    for policy in ("fcfs", "shortest-first"):
        llm = _llm(tiny_llama, True, max_num_batched_tokens=8, scheduling_policy=policy)
        for i, p in enumerate(prompts):
            llm.engine.add_request(f"r{i}", p, params)
        first_token_order, tokens = [], {}
        while llm.engine.has_unfinished():
            for o in llm.engine.step():
                if o.outputs[0].token_ids and o.request_id not in first_token_order:
                    first_token_order.append(o.request_id)
                tokens[o.request_id] = list(o.outputs[0].token_ids)
        results[policy] = (first_token_order, tokens)
        assert_no_leak(llm)
    assert results["fcfs"][0][0] == "r0"
    assert results["shortest-first"][0][:2] == ["r3", "r1"]
    assert results["shortest-first"][1] == results["fcfs"][1]
