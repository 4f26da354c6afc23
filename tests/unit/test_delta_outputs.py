"""Delta outputs (``LLMEngine.step(delta=True)``, what the server's streams use): each output holds
only what its step added, and adding them up gives exactly the cumulative outputs of the offline API,
held-back stop-string tails, n > 1, logprobs and prompt logprobs included."""

from __future__ import annotations

import copy

from kvserve import SamplingParams

PROMPTS = ["The capital of France is", "Once upon a time, there was a little"]
PARAMS = [
    SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[" the"]),
    SamplingParams(max_tokens=16, temperature=0.8, seed=7, n=2, logprobs=2, prompt_logprobs=1),
]


def _run_delta(engine, requests):
    merged, pieces = {}, {}
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished():
        for out in engine.step(delta=True):
            pieces.setdefault(out.request_id, []).append(copy.deepcopy(out))
            if out.request_id in merged:
                merged[out.request_id].merge(out)
            else:
                merged[out.request_id] = out
    return merged, pieces


def test_delta_outputs_add_up_to_the_cumulative_ones(default_llm):
    requests = {f"r{i}-{j}": (prompt, params) for i, prompt in enumerate(PROMPTS) for j, params in enumerate(PARAMS)}
    want = dict(zip(requests, default_llm.generate([p for p, _ in requests.values()], [p for _, p in requests.values()],
                                                    use_tqdm=False)))
    merged, pieces = _run_delta(default_llm.engine, requests)

    assert set(merged) == set(want)
    assert any(o.finish_reason == "stop" for o in want.values()), "no request ended on its stop string"
    for rid, expected in want.items():
        got = merged[rid]
        assert got.finished
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in expected.outputs]
        assert [c.text for c in got.outputs] == [c.text for c in expected.outputs]
        assert [c.finish_reason for c in got.outputs] == [c.finish_reason for c in expected.outputs]
        assert [c.logprobs for c in got.outputs] == [c.logprobs for c in expected.outputs]
        assert got.prompt_logprobs == expected.prompt_logprobs
        steps = pieces[rid]
        assert len(steps) > 2
        for i in range(len(expected.outputs)):  # no delta repeats what an earlier one carried
            assert sum(len(s.outputs[i].token_ids) for s in steps) == len(expected.outputs[i].token_ids)
            assert "".join(s.outputs[i].text for s in steps) == expected.outputs[i].text
        # the prompt's logprobs come once, with the first output
        assert [s.prompt_logprobs is not None for s in steps] == [expected.prompt_logprobs is not None] + [False] * (
            len(steps) - 1)
