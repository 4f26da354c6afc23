"""Phi-3 (fused qkv and gate/up projections, a sliding window) and Phi-4-mini (LongRoPE with a
cos/sin gain, partial rotary, tied embeddings) match transformers token for token: chunked prefill,
a prefix-cache hit, preemption and n-gram speculation, and LongRoPE's short and long factors."""

from __future__ import annotations

import random

import pytest

from kvserve import LLM, SamplingParams
from tests.conftest import TINY_VOCAB, make_tiny_model
from tests.models.reference import check_greedy_matches, generate_and_check, load_hf, motif_prompts, random_prompts

WINDOW = 18  # not a multiple of the block size
ORIGINAL = 64  # LongRoPE's original context in the tiny model; its max_position_embeddings is 256
ROTARY = 12  # Phi-4-mini style: 3/4 of the 16 head dims rotate


@pytest.fixture(scope="module")
def tiny_phi3(tmp_path_factory):
    # pad_token_id: the default one lies beyond a tiny vocabulary
    return make_tiny_model(tmp_path_factory.mktemp("tiny-phi3"), "Phi3ForCausalLM", sliding_window=WINDOW,
                           pad_token_id=0)


@pytest.fixture(scope="module")
def hf_phi3(tiny_phi3):
    return load_hf(tiny_phi3)


@pytest.fixture(scope="module")
def tiny_phi4_mini(tmp_path_factory):
    # factors far apart, so that the short and long sets give different tokens
    rng = random.Random(0)
    short = [round(rng.uniform(1.0, 1.5), 3) for _ in range(ROTARY // 2)]
    long = [round(rng.uniform(2.0, 40.0), 3) for _ in range(ROTARY // 2)]
    return make_tiny_model(tmp_path_factory.mktemp("tiny-phi4-mini"), "Phi3ForCausalLM", pad_token_id=0,
                           max_position_embeddings=256, original_max_position_embeddings=ORIGINAL,
                           partial_rotary_factor=ROTARY / 16, tie_word_embeddings=True,
                           rope_scaling={"type": "longrope", "short_factor": short, "long_factor": long})


@pytest.fixture(scope="module")
def hf_phi4_mini(tiny_phi4_mini):
    return load_hf(tiny_phi4_mini)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_phi3_matches_transformers(tiny_phi3, hf_phi3, backend):
    """Prompts longer than the window, chunked prefill (a 16-token budget) and a prefix-cache hit."""
    if backend == "triton":
        pytest.importorskip("triton")
    llm = LLM(model=str(tiny_phi3), attention_backend=backend, num_kv_blocks=256, block_size=4,
              max_num_batched_tokens=16)
    cfg = llm.engine.core.model_config
    assert cfg.layer_windows == (WINDOW, WINDOW) and llm.engine.core.kv_cache.window == WINDOW
    if backend == "torch" and llm.engine.core.runner.backend.kernels is not None:
        assert llm.engine.core.runner.fused_decoder is not None  # the split weights keep the fast path
    prompts = random_prompts(5, 5, 60, seed=1)
    prompts.append(prompts[1][:40] + [5, 6, 7])
    generate_and_check(llm, hf_phi3, prompts, max_tokens=20)
    assert llm.engine.core.kv_cache.prefix_stats.hits > 0


def test_phi3_preemption(tiny_phi3, hf_phi3):
    llm = LLM(model=str(tiny_phi3), num_kv_blocks=13, block_size=4, max_num_batched_tokens=32)
    generate_and_check(llm, hf_phi3, random_prompts(6, 40, 70, seed=5), max_tokens=30)
    assert llm.engine.core.scheduler.num_preemptions > 0


def test_phi3_ngram_speculation(tiny_phi3, hf_phi3):
    prompts = motif_prompts(4, seed=6)
    llm = LLM(model=str(tiny_phi3), num_kv_blocks=256, block_size=4, speculative_method="ngram",
              num_speculative_tokens=3)
    generate_and_check(llm, hf_phi3, prompts, max_tokens=32)
    assert llm.engine.core.spec.stats.proposed > 0


def test_longrope_config_is_read(tiny_phi4_mini):
    llm = LLM(model=str(tiny_phi4_mini), num_kv_blocks=64, block_size=4)
    rope = llm.engine.core.model_config.rope
    assert rope.rope_type == "longrope" and rope.original_max_position == ORIGINAL
    assert len(rope.short_factor) == len(rope.long_factor) == ROTARY // 2 and rope.rotary_fraction == 0.75
    assert rope.attention_factor > 1.0  # sqrt(1 + ln 4 / ln 64): the stretch from 64 to 256 positions


def test_longrope_long_factors_match_transformers(tiny_phi4_mini, hf_phi4_mini):
    """The engine runs up to 256 positions, past the original 64: the long factors, as transformers
    uses them for sequences longer than 64 (all these prompts are), through chunked prefill, a
    prefix-cache hit, preemption and speculation."""
    llm = LLM(model=str(tiny_phi4_mini), num_kv_blocks=256, block_size=4, max_num_batched_tokens=32)
    prompts = random_prompts(4, ORIGINAL + 1, 110, seed=7)
    prompts.append(prompts[0][:72] + [5, 6, 7])
    generate_and_check(llm, hf_phi4_mini, prompts, max_tokens=20)
    assert llm.engine.core.kv_cache.prefix_stats.hits > 0
    small = LLM(model=str(tiny_phi4_mini), num_kv_blocks=40, block_size=4, max_num_batched_tokens=32)
    generate_and_check(small, hf_phi4_mini, random_prompts(4, ORIGINAL + 1, 90, seed=8), max_tokens=24)
    assert small.engine.core.scheduler.num_preemptions > 0
    rng = random.Random(9)
    motifs = [[rng.randrange(3, TINY_VOCAB) for _ in range(4)] for _ in range(3)]
    spec = LLM(model=str(tiny_phi4_mini), num_kv_blocks=256, block_size=4, speculative_method="ngram",
               num_speculative_tokens=3)
    generate_and_check(spec, hf_phi4_mini, [m * 20 for m in motifs], max_tokens=24)
    assert spec.engine.core.spec.stats.proposed > 0


def test_longrope_short_factors_match_transformers(tiny_phi4_mini, hf_phi4_mini):
    """With max_model_len within the original context, the short factors, as transformers uses
    them for sequences of at most 64 tokens."""
    llm = LLM(model=str(tiny_phi4_mini), num_kv_blocks=256, block_size=4, max_num_batched_tokens=16,
              max_model_len=ORIGINAL)
    generate_and_check(llm, hf_phi4_mini, random_prompts(5, 5, ORIGINAL - 20, seed=10), max_tokens=20)


def test_longrope_factor_sets_give_other_tokens(tiny_phi4_mini, hf_phi4_mini):
    """The test can fail: short sequences rotated with the long factors (max_model_len past the
    original context) are not transformers' short-factor tokens."""
    llm = LLM(model=str(tiny_phi4_mini), num_kv_blocks=256, block_size=4)
    prompts = random_prompts(4, 20, ORIGINAL - 24, seed=11)
    outs = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True), use_tqdm=False)
    with pytest.raises(AssertionError, match="kvserve chose"):
        for prompt, out in zip(prompts, outs):
            check_greedy_matches(hf_phi4_mini, prompt, out.token_ids)
