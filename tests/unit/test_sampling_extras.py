"""Penalties, logit_bias, min_tokens and logprobs: the maths against a slow reference, and through the engine."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.frontend.tokenizer import bad_words_token_ids, load_tokenizer
from kvserve.model.loader import resolve_model_path
from kvserve.sample.penalties import apply_penalties, bad_word_completions, hold_back
from kvserve.sample.sampler import Sampler, SamplingBatch
from tests.conftest import assert_no_leak

V = 12


def _reference(logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """One row, one token at a time: the vLLM formulas written out."""
    out = logits.clone()
    for tok in range(V):
        count = output.count(tok)
        if tok in prompt or count:
            rp = p.repetition_penalty
            out[tok] = out[tok] / rp if out[tok] > 0 else out[tok] * rp
        out[tok] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
        out[tok] += (p.logit_bias or {}).get(tok, 0.0)
    return out


def test_penalties_match_reference_per_row():
    torch.manual_seed(0)
    logits = torch.randn(4, V) * 3
    params = [SamplingParams(temperature=0),
              SamplingParams(repetition_penalty=1.7, frequency_penalty=0.5, presence_penalty=-0.3),
              SamplingParams(logit_bias={3: 5.0, 7: -100.0}, repetition_penalty=0.8),
              SamplingParams(frequency_penalty=2.0)]
    prompts = [[1, 2], [1, 2, 2, 9], [3, 3], [0]]
    outputs = [[4], [2, 5, 5, 5], [], [6, 6, 11]]
    before = logits.clone()
    got = apply_penalties(logits, params, prompts, outputs)
    every = apply_penalties(logits[1:], params[1:], prompts[1:], outputs[1:])  # all rows penalised
    for row in range(4):
        want = _reference(logits[row], params[row], prompts[row], outputs[row])
        torch.testing.assert_close(got[row], want)
        if row:
            torch.testing.assert_close(every[row - 1], want)
    assert torch.equal(logits, before)  # the raw logits (read for logprobs) are left alone


def test_no_penalty_rows_cost_nothing():
    logits = torch.randn(3, V)
    params = [SamplingParams(temperature=0)] * 3
    assert apply_penalties(logits, params, [[1]] * 3, [[2]] * 3) is logits


def test_frequency_penalty_changes_greedy_choice():
    logits = torch.tensor([[5.0, 4.9] + [0.0] * (V - 2)] * 2)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, frequency_penalty=2.0)]
    out = Sampler()(logits, SamplingBatch(params, [1, 1], [[3], [3]], [[0], [0]]))
    assert out.token_ids == [0, 1]
    assert out.logprobs is None


def test_logprobs_are_raw_log_softmax():
    torch.manual_seed(1)
    logits = torch.randn(3, V)
    params = [SamplingParams(temperature=0, logprobs=3, logit_bias={5: 100.0}),
              SamplingParams(temperature=0),
              SamplingParams(temperature=0.5, seed=7, logprobs=0)]
    out = Sampler()(logits, SamplingBatch(params, [0, 0, 0], [[1]] * 3, [[]] * 3))
    raw = logits.log_softmax(-1)
    assert out.token_ids[0] == 5  # the bias decides the token ...
    first = out.logprobs[0]
    assert first.token_id == 5 and math.isclose(first.logprob, raw[0, 5].item(), rel_tol=1e-5)  # ... not its logprob
    top_values, top_ids = raw[0].topk(3)
    assert [t for t, _ in first.top] == top_ids.tolist()
    assert [v for _, v in first.top] == pytest.approx(top_values.tolist(), rel=1e-5)
    assert out.logprobs[1] is None
    third = out.logprobs[2]
    assert third.top == [] and math.isclose(third.logprob, raw[2, out.token_ids[2]].item(), rel_tol=1e-5)


@pytest.mark.parametrize("kwargs, field", [
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={4: 101.0}), "logit_bias"),
    (dict(logprobs=21), "logprobs"),
    (dict(logprobs=-1), "logprobs"),
    (dict(prompt_logprobs=50), "prompt_logprobs"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=17, max_tokens=16), "min_tokens"),
    (dict(min_tokens=1.5), "min_tokens"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[3, -1]), "allowed_token_ids"),
    (dict(allowed_token_ids=[2.0]), "allowed_token_ids"),
    (dict(bad_words=["w5", " "]), "bad_words"),
    (dict(bad_words="w5"), "bad_words"),
    (dict(bad_words_token_ids=[[3], []]), "bad_words_token_ids"),
])
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return LLM(model=str(tiny_llama), num_kv_blocks=128, block_size=8, max_model_len=256)


def test_logit_bias_out_of_vocab_is_rejected(tiny):
    with pytest.raises(ValueError, match=r"logit_bias.*\[0, 512\)"):
        tiny.generate([[5, 6]], SamplingParams(logit_bias={600: 1.0}))
    assert_no_leak(tiny)


def test_logit_bias_forces_token_through_engine(tiny):
    out = tiny.generate([[5, 6, 7]], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True,
                                                    logit_bias={42: 100.0}))[0]
    assert out.token_ids == [42] * 5


def test_allowed_token_ids_rule_out_the_rest_of_their_row():
    torch.manual_seed(0)
    logits = torch.randn(3, V)
    params = [SamplingParams(allowed_token_ids=[2, 5, V + 3]), SamplingParams(),
              SamplingParams(allowed_token_ids=[7], logit_bias={7: -3.0, 1: 2.0})]
    for chosen in (params, params[:1]):  # some rows (gathered) and every row
        out = apply_penalties(logits, chosen, [[]] * len(chosen), [[]] * len(chosen))
        assert torch.equal(out[0, [2, 5]], logits[0, [2, 5]]) and torch.isneginf(out[0]).sum() == V - 2
    out = apply_penalties(logits, params, [[]] * 3, [[]] * 3)
    assert torch.equal(out[1], logits[1]) and not torch.isinf(logits).any()
    assert out[2, 7] == logits[2, 7] - 3 and torch.isneginf(out[2]).sum() == V - 1


def test_allowed_token_ids_through_engine(tiny):
    with pytest.raises(ValueError, match=r"allowed_token_ids.*\[0, 512\)"):
        tiny.generate([[5, 6]], SamplingParams(allowed_token_ids=[3, 512]))
    allowed = [11, 42, 300]
    sampled = SamplingParams(max_tokens=16, temperature=1.0, seed=1, ignore_eos=True, allowed_token_ids=allowed)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs = tiny.generate([[5, 6, 7], [9, 10]], [sampled, greedy])
    assert set(outs[0].token_ids) <= set(allowed) and len(set(outs[0].token_ids)) > 1
    assert outs[1].token_ids == tiny.generate([[9, 10]], greedy)[0].token_ids  # its neighbour row untouched
    # greedy: the likeliest of the allowed tokens, which the raw logprobs rank
    first = tiny.generate([[9, 10]], dataclasses.replace(greedy, max_tokens=1, logprobs=20))[0]
    ranked = [token for token, _ in first.outputs[0].logprobs[0].top]
    pick = tiny.generate([[9, 10]], dataclasses.replace(greedy, max_tokens=1, allowed_token_ids=ranked[3:1:-1]))[0]
    assert pick.token_ids == [ranked[2]]
    assert_no_leak(tiny)


def test_bad_word_completions_follow_the_output_tail():
    words = [[5], [7, 8], [1, 2, 3]]
    assert bad_word_completions(words, []) == [5]
    assert bad_word_completions(words, [4, 7]) == [5, 8]
    assert bad_word_completions(words, [1, 2]) == [5, 3]
    assert bad_word_completions(words, [2, 1, 7, 2]) == [5]


def test_bad_words_are_tokenized_as_generated_alone_and_mid_text():
    """On the bundled model's byte-level BPE a word has a second spelling after a space (its first
    token carries the space); both are banned, and only spellings of the word's own length."""
    tokenizer = load_tokenizer(resolve_model_path(None))
    paris, spaced, *rest = bad_words_token_ids(tokenizer, ["Paris", "hello world"])
    assert (tokenizer.decode(paris), tokenizer.decode(spaced)) == ("Paris", " Paris")
    assert [tokenizer.decode(ids) for ids in rest] == ["hello world", " hello world"]
    assert all(len(ids) == 2 for ids in rest)


def test_http_requests_bring_their_bad_words_tokenized():
    """The server tokenizes bad words with the event loop's tokenizer, so the engine thread, which
    every stream waits on, does not."""
    from kvserve.entrypoints.openai.protocol import CompletionRequest
    from kvserve.entrypoints.openai.serving import build_params
    from kvserve.frontend.client import ModelInfo

    tokenizer = load_tokenizer(resolve_model_path(None))
    info = ModelInfo(tokenizer, 64, len(tokenizer), 64, 4, 16, 8, lambda ids: None, lambda params: None)
    params = build_params(CompletionRequest(model="m", prompt="hi", bad_words=["Paris"]), info, max_tokens=4)
    assert params.bad_words_token_ids == bad_words_token_ids(tokenizer, ["Paris"])
    assert build_params(CompletionRequest(model="m", prompt="hi"), info, max_tokens=4).bad_words_token_ids is None


def test_bad_words_are_never_generated(tiny):
    tokenizer = tiny.get_tokenizer()
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    free = tiny.generate([[5, 6, 7]], greedy)[0].token_ids
    one = tokenizer.decode([free[2]])  # a one-token word: ruled out everywhere
    pair = tokenizer.decode(free[3:5])  # a two-token word: its second token only right after its first
    outs = tiny.generate([[5, 6, 7], [5, 6, 7], [9, 10]],
                         [dataclasses.replace(greedy, bad_words=[one]), dataclasses.replace(greedy, bad_words=[pair]),
                          greedy])
    assert outs[0].token_ids[:2] == free[:2] and free[2] not in outs[0].token_ids
    assert outs[1].token_ids[:4] == free[:4] and outs[1].token_ids[4] != free[4]
    assert all(outs[1].token_ids[i:i + 2] != free[3:5] for i in range(11))
    assert outs[2].token_ids == tiny.generate([[9, 10]], greedy)[0].token_ids
    with pytest.raises(ValueError, match="bad_words need the tokenizer"):
        tiny.engine.core.add_request("raw", [5, 6], SamplingParams(bad_words=[one]))
    assert_no_leak(tiny)


def test_penalised_row_batched_equals_alone(tiny):
    bias = {42: 6.0}  # makes the random model repeat token 42, so the penalties have work to do
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logit_bias=bias, repetition_penalty=1.5,
                            presence_penalty=1.0, frequency_penalty=0.5)
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logit_bias=bias)
    alone = tiny.generate([[9, 10, 11]], params)[0].token_ids
    batched = tiny.generate([[5, 6], [9, 10, 11], [7]], [plain, params, plain])
    assert batched[1].token_ids == alone
    assert batched[1].token_ids != tiny.generate([[9, 10, 11]], plain)[0].token_ids == [42] * 12
    assert_no_leak(tiny)


def test_hold_back_rules_tokens_out_of_its_rows_only():
    logits = torch.randn(3, V)
    assert hold_back(logits, [[], [], []], copy=True) is logits
    held = hold_back(logits, [[1, 3], [], [V + 5]], copy=True)  # (an id past the vocabulary is no token)
    assert torch.isneginf(held[0, [1, 3]]).all() and torch.equal(held[0, [0, 2]], logits[0, [0, 2]])
    assert torch.equal(held[1:], logits[1:]) and not torch.isinf(logits).any()


def test_min_tokens_holds_back_eos_and_stop_ids(tiny):
    eos = tiny.engine.core.model_config.eos_token_ids[0]
    to_eos = SamplingParams(max_tokens=10, temperature=0, logit_bias={eos: 100.0})
    assert tiny.generate([[5, 6, 7]], to_eos)[0].token_ids == [eos]
    for params in (dataclasses.replace(to_eos, min_tokens=4), dataclasses.replace(to_eos, min_tokens=4, temperature=1.0,
                                                                                   seed=3)):
        out = tiny.generate([[5, 6, 7]], params)[0]
        assert len(out.token_ids) == 5 and out.token_ids[-1] == eos and eos not in out.token_ids[:4], out.token_ids
        assert out.finish_reason == "stop"
    to_42 = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, stop_token_ids=[42], logit_bias={42: 100.0})
    assert tiny.generate([[5, 6, 7]], to_42)[0].token_ids == [42]
    out = tiny.generate([[5, 6, 7]], dataclasses.replace(to_42, min_tokens=3))[0]
    assert len(out.token_ids) == 4 and out.token_ids[-1] == 42 and 42 not in out.token_ids[:3]
    assert_no_leak(tiny)


def test_output_logprobs_match_prompt_logprobs_of_same_tokens(tiny):
    """Two code paths, one distribution: decoding's logprobs equal scoring the same text as a prompt."""
    prompt = [5, 6, 7, 8]
    gen = tiny.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2))[0]
    lps = gen.outputs[0].logprobs
    assert len(lps) == len(gen.token_ids) == 6
    for lp, tok in zip(lps, gen.token_ids):
        assert lp.token_id == tok and lp.top[0][0] == tok  # greedy picks the top token
        assert lp.logprob == pytest.approx(lp.top[0][1])
    scored = tiny.generate([prompt + gen.token_ids], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    assert scored.prompt_logprobs[0] is None and len(scored.prompt_logprobs) == len(prompt) + 6
    for lp, want in zip(scored.prompt_logprobs[len(prompt):], lps):
        assert lp.token_id == want.token_id
        assert lp.logprob == pytest.approx(want.logprob, abs=1e-4)
    assert_no_leak(tiny)


def test_prompt_logprobs_across_prefill_chunks(tiny_llama):
    """A prompt split over several steps by the token budget is scored once per position."""
    prompt = list(range(3, 43))
    whole = LLM(model=str(tiny_llama), num_kv_blocks=64, block_size=8).generate(
        [prompt], SamplingParams(max_tokens=1, prompt_logprobs=1))[0].prompt_logprobs
    chunked = LLM(model=str(tiny_llama), num_kv_blocks=64, block_size=8, max_num_batched_tokens=16).generate(
        [prompt], SamplingParams(max_tokens=1, prompt_logprobs=1))[0].prompt_logprobs
    assert len(whole) == len(chunked) == len(prompt)
    assert [lp.token_id for lp in chunked[1:]] == prompt[1:]
    for a, b in zip(whole[1:], chunked[1:]):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


def test_prompt_logprobs_bypass_the_prefix_cache(tiny):
    """A cached prefix skips its computation, so a request scoring its prompt must not reuse it,
    even with prompt_logprobs=0 (the chosen tokens' logprobs, no alternatives)."""
    prompt = list(range(3, 35))
    tiny.generate([prompt], SamplingParams(max_tokens=1))  # fills the prefix cache
    scored = tiny.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0))[0].prompt_logprobs
    assert len(scored) == len(prompt) and scored[0] is None
    assert [lp.token_id for lp in scored[1:]] == prompt[1:] and all(lp.top == [] for lp in scored[1:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 37, 49152])
def test_logprob_kernel_matches_torch_log_softmax(dtype, vocab, monkeypatch):
    """The C++ path (the CPU's) and the torch one (CUDA's) give the same logprobs and the same top
    tokens; ties go to the first index, and -inf logits are scored -inf."""
    from kvserve.model.cpu_kernels import load_kernels
    from kvserve.sample import sampler as sampler_module

    if load_kernels() is None:
        pytest.skip("no C++ kernels here")
    gen = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(6, vocab, generator=gen) * 4).to(dtype)
    if vocab > 20:
        logits[1, :] = 0.0  # all tied
        logits[2, 3:] = float("-inf")  # fewer finite values than the widest top
        logits[3, [7, 11, 19]] = logits[3].max() + 1  # a tie for first place
    tokens = torch.randint(0, vocab, (6,), generator=gen)
    tokens[2] = vocab - 1  # a -inf logit
    num_top = [min(k, vocab) if k is not None else None for k in (20, 5, 20, 3, None, 0)]
    got = sampler_module.token_logprobs(logits, tokens, num_top)
    monkeypatch.setattr(sampler_module, "load_kernels", lambda: None)
    want = sampler_module.token_logprobs(logits, tokens, num_top)
    # float64: torch's float32 log_softmax itself is 1e-5 off over 49K logits on some CPUs (AVX2)
    ref = logits.double().log_softmax(-1)
    for row, (g, w) in enumerate(zip(got, want)):
        if w is None:
            assert g is None
            continue
        assert g.token_id == w.token_id
        assert g.logprob == pytest.approx(ref[row, tokens[row]].item(), abs=1e-5) or g.logprob == w.logprob == -math.inf
        assert [v for _, v in g.top] == pytest.approx([v for _, v in w.top], abs=3e-5)
        values = [v for _, v in g.top]
        assert values == sorted(values, reverse=True)
        for token, value in g.top:  # each pair is that token's logprob, whichever tie the order chose
            assert value == pytest.approx(ref[row, token].item(), abs=1e-5) or value == ref[row, token].item()
        assert len({t for t, _ in g.top}) == len(g.top)
    if vocab > 20:
        assert [t for t, _ in got[1].top] == list(range(5))  # ties: the first indices, in order
        assert [t for t, _ in got[3].top] == [7, 11, 19]
        finite_order = torch.argsort(logits[2, :3].float(), descending=True, stable=True).tolist()
        assert [t for t, _ in got[2].top][:3] == finite_order
    assert got[5].top == [] and got[5].logprob == pytest.approx(ref[5, tokens[5]].item(), abs=1e-5)


def test_logprob_kernel_rejects_bad_rows_and_tokens():
    from kvserve.model.cpu_kernels import load_kernels

    kernels = load_kernels()
    if kernels is None:
        pytest.skip("no C++ kernels here")
    logits = torch.randn(2, 10)
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        kernels.row_logprobs(logits, torch.tensor([0]), torch.tensor([10]), 2)
    with pytest.raises(RuntimeError, match="outside the logits"):
        kernels.row_logprobs(logits, torch.tensor([2]), torch.tensor([0]), 2)


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_logprobs_wider_than_the_vocabulary_return_all_of_it(path, monkeypatch):
    from kvserve.sample import sampler as sampler_module

    if path == "torch":
        monkeypatch.setattr(sampler_module, "load_kernels", lambda: None)
    logits = torch.randn(2, 5, generator=torch.Generator().manual_seed(0))
    got = sampler_module.token_logprobs(logits, torch.tensor([1, 4]), [20, 3])
    assert [len(g.top) for g in got] == [5, 3]
    assert [t for t, _ in got[0].top] == logits[0].argsort(descending=True).tolist()


def test_special_tokens_written_when_asked(tiny):
    tokenizer = tiny.get_tokenizer()
    special = next(i for i, t in tokenizer.added_tokens_decoder.items() if t.special)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logit_bias={special: 100.0})
    assert tiny.generate([[5, 6]], params)[0].text == ""
    shown = tiny.generate([[5, 6]], dataclasses.replace(params, skip_special_tokens=False))[0]
    assert shown.text.split() == [tokenizer.decode([special])] * 3


@pytest.mark.parametrize("value", [0, -2, 1.5, True])
def test_truncate_prompt_tokens_must_be_a_count(value):
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=value)


def test_truncated_prompt_is_its_last_tokens(tiny):
    long = [(7 * i) % 500 + 3 for i in range(300)]  # past the 256-token context window
    with pytest.raises(ValueError, match="context window"):
        tiny.generate([long], SamplingParams(max_tokens=4))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = tiny.generate([long[-20:]], params)[0]
    got = tiny.generate([long], dataclasses.replace(params, truncate_prompt_tokens=20))[0]
    assert (got.prompt_token_ids, got.token_ids) == (long[-20:], want.token_ids)
    most = tiny.generate([long], dataclasses.replace(params, max_tokens=1, truncate_prompt_tokens=-1))[0]
    assert most.prompt_token_ids == long[-255:]
    assert SamplingParams(truncate_prompt_tokens=50).truncate(long[:10], 256) == long[:10]
    assert_no_leak(tiny)
