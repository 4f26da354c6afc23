"""DeepSeek-V2 matches transformers token for token: multi-head latent attention over a paged cache
of latents (absorbed decode, expanded prefill), with and without a query LoRA, YaRN RoPE with its
softmax mscale, and DeepSeek's experts (dense first layers, group-limited routing, scaled weights,
shared experts); under chunked prefill, a prefix-cache hit, preemption and n-gram speculation.
Its cache costs what the capacity planner says, a small share of per-head K/V."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.config import ModelConfig
from tests.conftest import assert_no_leak, make_tiny_model
from tests.models.reference import (
    check_ngram_speculation,
    check_under_preemption,
    check_with_prefix_hit,
    load_hf,
    random_prompts,
)

# 3 layers: layer 0 dense, 1 and 2 sparse, each routing to 2 or 3 of 8 experts plus shared ones
_COMMON = dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
               qk_nope_head_dim=16, qk_rope_head_dim=8, head_dim=8, v_head_dim=12, n_routed_experts=8,
               num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=2, first_k_dense_replace=1,
               routed_scaling_factor=1.5)
_YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128, mscale=1.0,
             mscale_all_dim=0.8, beta_fast=32, beta_slow=1)  # mscale differs from mscale_all_dim: both matter
VARIANTS = {
    # V2-Lite's layout: queries straight from q_proj, greedy top k
    "v2_lite": ("DeepseekV2ForCausalLM", dict(_COMMON, q_lora_rank=None, topk_method="greedy")),
    # V2's: a query LoRA, YaRN RoPE, group-limited routing: the top 3 of the 4 experts in the 2
    # groups (of 4) whose best expert scores highest
    "v2_lora_yarn": ("DeepseekV2ForCausalLM", dict(_COMMON, q_lora_rank=24, topk_method="group_limited_greedy",
                                                   n_group=4, topk_group=2, num_experts_per_tok=3,
                                                   rope_parameters=_YARN)),
    # V3's routing: sigmoid scores, a correction bias (random: random_model.py), renormalised weights
    "v3": ("DeepseekV3ForCausalLM", dict(_COMMON, q_lora_rank=24, n_group=4, topk_group=2, num_experts_per_tok=3,
                                         n_shared_experts=1, norm_topk_prob=True, routed_scaling_factor=2.5)),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def tiny_deepseek(request, tmp_path_factory):
    arch, overrides = VARIANTS[request.param]
    path = make_tiny_model(tmp_path_factory.mktemp(f"tiny-deepseek-{request.param}"), arch, **overrides)
    return request.param, path, load_hf(path)


def test_deepseek_v2_matches_transformers(tiny_deepseek):
    variant, path, hf = tiny_deepseek
    llm = LLM(model=str(path), num_kv_blocks=256, block_size=4, max_num_batched_tokens=24)
    core = llm.engine.core
    cfg, runner = core.model_config, core.runner
    assert cfg.mla is not None and cfg.moe.sparse_layers == (False, True, True)
    # the cache holds a latent row per token and layer, and sizing counts exactly that
    assert runner.kv_caches[0].shape == (1, 256, 4, 32 + 8)
    assert core.kv_info.bytes_per_token == 3 * (32 + 8) * 4
    if variant == "v2_lora_yarn":
        assert cfg.moe.num_groups == 4 and cfg.rope.softmax_mscale != 1.0 and cfg.rope.attention_factor != 1.0
    if variant == "v3":
        assert cfg.moe.scoring == "sigmoid" and cfg.moe.renormalize
        assert float(runner.model.model.layers[1].mlp.e_score_correction_bias.abs().sum()) > 0
    assert runner.fused_decoder is None
    check_with_prefix_hit(llm, hf)


def test_deepseek_v2_preemption_and_ngram_speculation(tiny_deepseek):
    _, path, hf = tiny_deepseek
    check_under_preemption(path, hf)
    check_ngram_speculation(path, hf)


# DeepSeek-V2-Lite's attention shape (its config.json, less the parts the cache does not see)
V2_LITE = dict(architectures=["DeepseekV2ForCausalLM"], vocab_size=102400, hidden_size=2048, intermediate_size=10944,
               num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512,
               q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
               max_position_embeddings=163840, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
               moe_intermediate_size=1408, first_k_dense_replace=1, topk_method="greedy", rms_norm_eps=1e-6)


def test_latent_cache_bytes_equal_the_planners_and_undercut_per_head_kv():
    from kvserve.config import EngineConfig
    from kvserve.kv_cache.sizing import kv_bytes_per_token, size_kv_cache
    from kvserve.planner.capacity import layers_kv_bytes_per_token
    from kvserve.planner.shape import ModelShape

    engine = size_kv_cache(EngineConfig(dtype="bfloat16"), ModelConfig.from_hf(V2_LITE)).bytes_per_token
    shape = ModelShape.from_hf(V2_LITE)
    assert engine == layers_kv_bytes_per_token(shape, shape.num_layers, 2) == 27 * (512 + 64) * 2
    # the same heads with per-head K and V (keys of nope + rope dims, values padded to them)
    per_head = kv_bytes_per_token(27, 16, 128 + 64, 2)
    assert engine * 10 < per_head


def test_quantized_latent_cache_is_refused():
    from kvserve.config import CacheConfig, EngineConfig
    from kvserve.kv_cache.sizing import size_kv_cache

    with pytest.raises(ValueError, match="kv_cache_dtype='int8'"):
        size_kv_cache(EngineConfig(dtype="bfloat16", cache=CacheConfig(kv_cache_dtype="int8")),
                      ModelConfig.from_hf(V2_LITE))


def test_int8_keeps_the_router_float32_and_kv_b_dense(tmp_path):
    arch, overrides = VARIANTS["v2_lite"]
    path = make_tiny_model(tmp_path, arch, **overrides)
    llm = LLM(model=str(path), dtype="bfloat16", num_kv_blocks=64, block_size=4, quantization="int8")
    layer = llm.engine.core.runner.model.model.layers[1]
    assert layer.mlp.gate.method.name == "dense" and layer.mlp.gate.weight.dtype == torch.float32
    assert all(e.down_proj.method.name.startswith("int8") for e in layer.mlp.experts)
    assert layer.self_attn.kv_b_proj.weight.dtype == torch.bfloat16  # read per head by the absorbed decode
    outs = llm.generate(random_prompts(3, 5, 20, seed=4), SamplingParams(max_tokens=8, temperature=0,
                                                                         ignore_eos=True), use_tqdm=False)
    assert all(len(o.token_ids) == 8 for o in outs)
    assert_no_leak(llm)


@pytest.mark.parametrize("option, value", [("kv_cache_dtype", "int8"), ("kv_cache_dtype", "fp8"),
                                           ("tensor_parallel_size", 2)])
def test_unsupported_options_fail_at_start_up(tmp_path, option, value):
    """A quantized latent cache or tensor parallelism: a ValueError naming the option at start-up."""
    arch, overrides = VARIANTS["v2_lite"]
    path = make_tiny_model(tmp_path, arch, **overrides)
    with pytest.raises(ValueError, match=f"{option}={value!r}"):
        LLM(model=str(path), num_kv_blocks=64, block_size=4, **{option: value})
