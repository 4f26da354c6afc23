"""Quantized weights and KV caches through the whole engine: the bundled GGUF kept in its blocks against
its dequantized form, int8/int4 at load, int8/fp8 KV caches under preemption, chunked prefill,
prefix caching and speculative decoding, and the memory report."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve import LLM, SamplingParams
from kvserve.eval.perplexity import perplexity, sliding_windows
from tests.conftest import assert_no_leak
from tests.models.reference import random_prompts

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
ALICE = Path(__file__).resolve().parents[1] / "data" / "alice29.txt"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,", "Water boils at",
           "Here is a recipe for pancakes:", "The largest planet in the solar system is"]



def _tokens(llm, prompts, params=GREEDY) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def dequantized():
    """The default model with its GGUF blocks dequantized to float32 (quantization="none")."""
    return LLM(dtype="float32", quantization="none", kv_cache_memory_bytes=64 * 2**20)


def test_native_gguf_matches_dequantized(default_llm, dequantized):
    # default_llm keeps the Q4_1 / Q8_0 blocks (int4 / int8 kernels): an exact mapping, so the two
    # forms differ only by float32 summation order.
    memory = default_llm.engine.core.memory
    assert "int4-g32" in memory.quantization and "int8-g32" in memory.quantization
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3)
    prompt = "Alice was beginning to get very tired of sitting by her sister on the bank."
    native, dense = default_llm.generate(prompt, params)[0], dequantized.generate(prompt, params)[0]
    for a, b in zip(native.prompt_logprobs[1:], dense.prompt_logprobs[1:]):
        assert abs(a.logprob - b.logprob) < 2e-3
        assert [t for t, _ in a.top] == [t for t, _ in b.top] or abs(a.top[0][1] - a.top[1][1]) < 2e-3
    short = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert _tokens(default_llm, PROMPTS[:3], short) == _tokens(dequantized, PROMPTS[:3], short)
    bf16_bytes = dequantized.engine.core.memory.weight_bytes / 2  # the dequantized model is float32
    assert memory.weight_bytes < 0.4 * bf16_bytes
    assert_no_leak(default_llm)


@pytest.mark.slow
def test_int8_greedy_mostly_matches_dequantized(dequantized):
    llm = LLM(kv_cache_memory_bytes=64 * 2**20, quantization="int8")
    got, want = _tokens(llm, PROMPTS), _tokens(dequantized, PROMPTS)
    assert sum(a == b for a, b in zip(got, want)) >= len(PROMPTS) // 2
    assert sum(a[0] == b[0] for a, b in zip(got, want)) >= len(PROMPTS) - 1  # first tokens nearly all agree
    assert llm.engine.core.memory.weight_bytes < 0.55 * dequantized.engine.core.memory.weight_bytes / 2
    assert_no_leak(llm)


@pytest.mark.slow
def test_int4_perplexity_and_bytes(dequantized):
    # int4 re-quantizes everything, the embedding / tied head too (groups of 16, importance-weighted
    # clip search): under 0.3x the bf16 bytes, at a few percent of perplexity.
    llm = LLM(kv_cache_memory_bytes=64 * 2**20, quantization="int4")
    ids = llm.get_tokenizer().encode(ALICE.read_text()[:12000], add_special_tokens=False)[:2048]
    base, quant = perplexity(dequantized, ids, 1024, 512), perplexity(llm, ids, 1024, 512)
    assert quant.perplexity < 1.06 * base.perplexity, (quant.perplexity, base.perplexity)
    assert llm.engine.core.memory.weight_bytes < 0.3 * dequantized.engine.core.memory.weight_bytes / 2
    assert "int4-g16-coded-clip" in llm.engine.core.memory.quantization
    assert_no_leak(llm)


@pytest.mark.parametrize("kv_dtype, tol", [("int8", 0.05), ("fp8", 0.25)])
def test_kv_quantized_decode_close_to_full_precision(tiny_llama, kv_dtype, tol):
    # Logprobs of the decoded tokens stay within ``tol`` of the full-precision cache's; where the
    # outputs part, the full-precision run had a near tie (its two best tokens within 2 * tol).
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=2)
    prompts = random_prompts(8, 4, 60, seed=4)
    exact = LLM(model=str(tiny_llama), num_kv_blocks=256, block_size=8).generate(prompts, params)
    llm = LLM(model=str(tiny_llama), num_kv_blocks=256, block_size=8, kv_cache_dtype=kv_dtype)
    compared = 0
    for a, b in zip(llm.generate(prompts, params), exact):
        for lp_a, lp_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            if lp_a.token_id != lp_b.token_id:
                ref = dict(lp_b.top)
                assert lp_a.token_id in ref and lp_b.logprob - ref[lp_a.token_id] < 2 * tol
                break
            assert abs(lp_a.logprob - lp_b.logprob) < tol
            compared += 1
    assert compared >= 2 * len(prompts)
    assert_no_leak(llm)


@pytest.mark.parametrize("kv_dtype, weights", [("int8", None), ("fp8", "int8")])
def test_kv_quantized_preemption_and_chunked_prefill_change_nothing(tiny_qwen2, kv_dtype, weights):
    # Attention reads the cache's quantized values on every path, so recomputing after preemption and
    # prefilling in 16-token chunks give exactly the tokens of an unconstrained run.
    prompts, params = random_prompts(8, 20, 40, seed=2), SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    small = LLM(model=str(tiny_qwen2), num_kv_blocks=24, block_size=4, max_num_batched_tokens=16,
                kv_cache_dtype=kv_dtype, quantization=weights)
    roomy = LLM(model=str(tiny_qwen2), num_kv_blocks=256, block_size=4, kv_cache_dtype=kv_dtype, quantization=weights)
    assert _tokens(small, prompts, params) == _tokens(roomy, prompts, params)
    assert small.engine.core.scheduler.num_preemptions > 0
    assert_no_leak(small)
    assert_no_leak(roomy)


def test_quantized_weights_and_kv_with_prefix_caching_and_speculation(tiny_llama):
    # int4 weights + int8 KV: a prefix-cache hit reads the same quantized KV the first request wrote,
    # and n-gram speculation (verified in the normal step) leaves greedy output unchanged.
    options = {"model": str(tiny_llama), "num_kv_blocks": 256, "block_size": 4, "quantization": "int4",
               "quantization_group_size": 32, "kv_cache_dtype": "int8"}
    shared = [7, 8, 9, 10] * 6
    prompts = [shared + [11, 12], shared + [13], shared + [14, 15, 16]]
    plain = LLM(enable_prefix_caching=False, **options)
    want = _tokens(plain, prompts)
    cached = LLM(**options)
    first = _tokens(cached, prompts[:1])
    assert first + _tokens(cached, prompts[1:]) == want
    assert cached.engine.core.kv_cache.prefix_stats.hits >= len(shared) - 4
    spec = LLM(speculative_method="ngram", num_speculative_tokens=3, **options)
    assert _tokens(spec, prompts) == want
    assert spec.engine.core.spec.stats.proposed > 0
    for llm in (plain, cached, spec):
        assert_no_leak(llm)


def test_draft_model_speculation_with_quantized_weights_and_kv(tiny_llama):
    # The draft keeps its own (dense, "auto") cache; the target's int8 weights and fp8 KV are verified
    # in the normal step, so greedy output equals the non-speculative run.
    options = {"model": str(tiny_llama), "num_kv_blocks": 128, "block_size": 4, "quantization": "int8",
               "kv_cache_dtype": "fp8"}
    prompts = random_prompts(4, 8, 30, seed=5)
    want = _tokens(LLM(**options), prompts)
    spec = LLM(speculative_method="draft", speculative_model=str(tiny_llama), num_speculative_tokens=3, **options)
    assert _tokens(spec, prompts) == want
    assert spec.engine.core.spec.stats.accepted > 0
    assert_no_leak(spec)


def test_memory_report_and_capacity(tiny_llama):
    budget = 4 * 2**20
    reports = {kv: LLM(model=str(tiny_llama), kv_cache_memory_bytes=budget, dtype="bfloat16", kv_cache_dtype=kv,
                       quantization=q).engine.core.memory
               for kv, q in (("auto", None), ("int8", "int8"), ("fp8", "int4"))}
    # tiny llama: 2 layers, 2 KV heads of 16: bf16 = 2*2*2*16*2 bytes; int8/fp8 = 2*2*2*(16 + 2)
    assert reports["auto"].kv_bytes_per_token == 256 and reports["int8"].kv_bytes_per_token == 144
    assert reports["fp8"].kv_capacity_tokens >= 1.75 * reports["auto"].kv_capacity_tokens
    assert reports["int8"].weight_bytes < 0.6 * reports["auto"].weight_bytes
    assert reports["fp8"].weight_bytes < reports["int8"].weight_bytes
    assert "int8" in reports["int8"].quantization and "dense" not in reports["int8"].quantization


def test_sliding_windows_score_every_token_once():
    for n, window, stride in ((10, 4, 2), (1000, 256, 128), (17, 32, 8), (5, 5, 5)):
        windows = sliding_windows(n, window, stride)
        scored = [p for w in windows for p in range(w.first_scored, w.end)]
        assert scored == list(range(1, n))
        assert all(w.end - w.start <= window and w.first_scored > w.start for w in windows)
    with pytest.raises(ValueError):
        sliding_windows(10, 4, 8)


@pytest.mark.slow
def test_perplexity_of_default_model_native_and_kv_int8(default_llm):
    text = ALICE.read_text()
    ids = default_llm.get_tokenizer().encode(text, add_special_tokens=False)[:768]
    native = perplexity(default_llm, ids, window=256, stride=128)
    assert native.tokens_scored == len(ids) - 1
    assert 5 < native.perplexity < 40  # SmolLM2-135M on Alice: about 20
    kv_int8 = perplexity(LLM(kv_cache_dtype="int8", kv_cache_memory_bytes=64 * 2**20), ids, window=256, stride=128)
    assert abs(kv_int8.perplexity / native.perplexity - 1) < 0.02
