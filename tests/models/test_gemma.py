"""Gemma 2 (alternating local/global layers, soft-capped attention and logits, (1 + w) norms before
and after attention and the MLP, GeGLU, scaled embeddings) and Gemma 3 (5:1 local/global, q/k norms,
a RoPE base per layer type) match transformers token for token, with the hybrid KV cache: the local
layers' KV kept to their window (kv_cache/groups.py), the global layers' in full."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.kv_cache.hybrid import HybridKVCacheManager
from kvserve.kv_cache.sizing import max_window_blocks
from tests.conftest import assert_no_leak, make_tiny_model
from tests.models.reference import check_greedy_matches, generate_and_check, load_hf, motif_prompts, random_prompts

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
    kv = llm.engine.core.kv_cache
    assert isinstance(kv, HybridKVCacheManager)  # global layers (1, 3) in full, local ones (0, 2) windowed
    assert [(g.window, g.layers) for g in kv.layout.groups] == [(None, (1, 3)), (WINDOW, (0, 2))]
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
    layout = llm.engine.core.kv_layout
    assert layout.layers_per_block == 1 and [g.window for g in layout.groups] == [None] + [WINDOW] * 5
    hf = load_hf(tiny_gemma3)
    prompts = random_prompts(5, 5, 50, seed=2)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    compared = 0
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        compared += check_greedy_matches(hf, prompt, out.token_ids)
    assert compared >= len(prompts) * 20 // 2
    assert_no_leak(llm)


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def hybrid(request, tiny_gemma2, tiny_gemma3):
    """(model path, transformers model)."""
    path = tiny_gemma2 if request.param == "gemma2" else tiny_gemma3
    return path, load_hf(path)


def test_hybrid_prefix_cache_hit_past_the_window(hybrid):
    """The second prompt shares 48 tokens (three windows) with the first: a hit although the window
    groups released (and may have lost) the blocks behind their window."""
    path, hf = hybrid
    llm = LLM(model=str(path), num_kv_blocks=256, block_size=4, max_num_batched_tokens=24)
    first = random_prompts(1, 60, 60, seed=4)[0]
    generate_and_check(llm, hf, [first])
    generate_and_check(llm, hf, [first[:48] + [7, 8, 9, 10, 11]])
    assert llm.engine.core.kv_cache.prefix_stats.hits >= 48


def test_hybrid_preemption(hybrid):
    """Short prompts are admitted together; their global groups then outgrow the pool."""
    path, hf = hybrid
    llm = LLM(model=str(path), num_kv_blocks=72, block_size=4, max_num_batched_tokens=16)
    generate_and_check(llm, hf, random_prompts(6, 8, 16, seed=5), max_tokens=40)
    assert llm.engine.core.scheduler.num_preemptions > 0


def test_hybrid_ngram_speculation(hybrid):
    path, hf = hybrid
    prompts = motif_prompts(4, seed=6)
    llm = LLM(model=str(path), num_kv_blocks=256, block_size=4, speculative_method="ngram", num_speculative_tokens=3)
    spec = generate_and_check(llm, hf, prompts, max_tokens=32)
    plain = LLM(model=str(path), num_kv_blocks=256, block_size=4)
    assert spec == [o.token_ids for o in plain.generate(
        prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True), use_tqdm=False)]
    assert llm.engine.core.spec.stats.proposed > 0


def test_local_group_bounded_by_the_window(tiny_gemma2, monkeypatch):
    """Gemma 2 generating 4x its window: the local group never holds more blocks than the planner's
    figure (max_window_blocks, at most window / block_size + 2) while the global group grows with the
    sequence, past what the pool could hold with every layer kept; the planner's bytes per user are
    the engine's peak."""
    block_size, max_tokens = 4, 4 * WINDOW
    llm = LLM(model=str(tiny_gemma2), num_kv_blocks=32, block_size=block_size, max_num_batched_tokens=16)
    core = llm.engine.core
    engine, kv = llm.engine, core.kv_cache
    full, local = kv.groups
    held = []  # (global, local) blocks the request holds once each step's room is made
    reported = []  # what the engine's snapshot (/metrics) says then
    allocate = kv.allocate_slots
    monkeypatch.setattr(kv, "allocate_slots", lambda rid, *a, **k: allocate(rid, *a, **k) and (
        held.append((full.num_held_blocks(rid), local.num_held_blocks(rid)))
        or reported.append(core.stats().kv_blocks_in_use) or True))
    prompt = random_prompts(1, 10, 10, seed=10)[0]
    engine.add_request("r", prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    last = None
    while engine.has_unfinished():
        for out in engine.step():
            last = out
    total = len(prompt) + max_tokens
    bound = max_window_blocks(WINDOW, block_size)
    assert bound <= WINDOW // block_size + 2
    assert max(h[1] for h in held) == bound, held  # reached, never exceeded
    assert held[-1][0] == -(-(total - 1) // block_size)  # the global group holds the whole sequence
    assert 2 * -(-total // block_size) > kv.num_blocks  # every layer kept, it would not have fitted
    assert reported == [{"full": f, "window": w} for f, w in held]
    assert core.stats().kv_cache_blocks == 32
    assert check_greedy_matches(load_hf(tiny_gemma2), prompt, last.outputs[0].token_ids) > max_tokens // 2
    assert_no_leak(llm)
    # the planner: the same bytes per token, groups, capacity and per-user peak
    from kvserve.model.loader import load_hf_config
    from kvserve.planner.capacity import (
        Setup,
        kv_bytes_per_token_of,
        kv_bytes_per_user,
        kv_capacity_tokens_of,
        kv_groups_of,
    )
    from kvserve.planner.hardware import lookup_gpu
    from kvserve.planner.shape import ModelShape

    info = core.kv_info
    shape = ModelShape.from_hf(load_hf_config(core.model_path))
    setup = Setup(shape, lookup_gpu("h100"), dtype="float32", block_size=block_size,
                  kv_cache_memory_bytes=info.pool_bytes)
    assert kv_bytes_per_token_of(setup) == info.bytes_per_token and kv_groups_of(setup) == info.num_groups == 2
    assert kv_capacity_tokens_of(setup) == info.capacity_tokens
    context = held[-1][0] * block_size
    assert kv_bytes_per_user(setup, context) == (held[-1][0] + bound) * info.block_bytes
