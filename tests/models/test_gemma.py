"""Gemma 2 (alternating local/global layers, soft-capped attention and logits, (1 + w) norms before
and after attention and the MLP, GeGLU, scaled embeddings) and Gemma 3 (5:1 local/global, q/k norms,
a RoPE base per layer type) match transformers token for token."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from tests.conftest import assert_no_leak, make_tiny_model
from tests.models.reference import check_greedy_matches, load_hf, random_prompts

WINDOW = 16


@pytest.fixture(scope="module")
def tiny_gemma2(tmp_path_factory):
    # query_pre_attn_scalar != head_dim and small caps, so that the scale and both caps change tokens
    return make_tiny_model(tmp_path_factory.mktemp("tiny-gemma2"), "Gemma2ForCausalLM", num_hidden_layers=4,
                           sliding_window=WINDOW, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                           final_logit_softcapping=3.0, tie_word_embeddings=True)



@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gemma2_matches_transformers(tiny_gemma2, backend):
    if backend == "triton":
        pytest.importorskip("triton")
    llm = LLM(model=str(tiny_gemma2), attention_backend=backend, num_kv_blocks=256, block_size=4,
              max_num_batched_tokens=24)
    cfg = llm.engine.core.model_config
    assert cfg.layer_windows == (WINDOW, None, WINDOW, None)
    assert llm.engine.core.kv_cache.window is None  # hybrid: full KV kept for every layer
    hf = load_hf(tiny_gemma2)
    prompts = random_prompts(5, 5, 50, seed=1)
    prompts.append(prompts[4][:32] + [5, 6, 7])  # a prefix-cache hit
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    compared = 0
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        assert len(out.token_ids) == 20
        compared += check_greedy_matches(hf, prompt, out.token_ids)
    assert compared >= len(prompts) * 20 // 2
    assert llm.engine.core.kv_cache.prefix_stats.hits > 0
    assert_no_leak(llm)


def test_gemma2_final_logits_are_capped(tiny_gemma2):
    import torch

    llm = LLM(model=str(tiny_gemma2), num_kv_blocks=64, block_size=4)
    model = llm.engine.core.runner.model
    hidden = torch.randn(64, model.config.hidden_size) * 4
    raw = model.model.embed_tokens.project(hidden)
    assert raw.abs().max() > 3.0  # the cap has something to do
    torch.testing.assert_close(model.compute_logits(hidden), torch.tanh(raw / 3.0) * 3.0)


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    # six layers: five local, one global; distinct RoPE bases, the global one scaled linearly
    return make_tiny_model(tmp_path_factory.mktemp("tiny-gemma3"), "Gemma3ForCausalLM", num_hidden_layers=6,
                           sliding_window=WINDOW, query_pre_attn_scalar=24, tie_word_embeddings=True,
                           rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                                               "rope_theta": 1000000.0},
                                            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})


def test_gemma3_matches_transformers(tiny_gemma3):
    llm = LLM(model=str(tiny_gemma3), num_kv_blocks=256, block_size=4, max_num_batched_tokens=24)
    cfg = llm.engine.core.model_config
    assert cfg.layer_windows == (WINDOW,) * 5 + (None,)
    assert cfg.qk_norm and cfg.local_rope.theta == 10000.0 and cfg.rope.theta == 1000000.0
    assert cfg.rope.rope_type == "linear"
    hf = load_hf(tiny_gemma3)
    prompts = random_prompts(5, 5, 50, seed=2)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    compared = 0
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        compared += check_greedy_matches(hf, prompt, out.token_ids)
    assert compared >= len(prompts) * 20 // 2
    assert_no_leak(llm)
