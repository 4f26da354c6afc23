"""Mixture-of-experts families match transformers token for token: Mixtral (renormalised float32
routing weights), Qwen3-MoE (q/k norm per head, dense layers by decoder_sparse_step and
mlp_only_layers, norm_topk_prob), Qwen2-MoE (q/k/v bias, a sigmoid-gated shared expert) and OLMoE
(q/k norm over the whole projection, clip_qkv); under chunked prefill, a prefix-cache hit,
preemption and n-gram speculation."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from tests.conftest import assert_no_leak, make_tiny_model
from tests.models.reference import (
    check_ngram_speculation,
    check_under_preemption,
    check_with_prefix_hit,
    load_hf,
    random_prompts,
)

FAMILIES = {
    "mixtral": ("MixtralForCausalLM", dict(num_local_experts=8, num_experts_per_tok=2)),
    # 4 layers, sparse every 2nd (1 and 3) but layer 3 kept dense: only layer 1 routes
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(num_hidden_layers=4, num_experts=8, num_experts_per_tok=3,
                                              moe_intermediate_size=32, decoder_sparse_step=2,
                                              mlp_only_layers=[3], norm_topk_prob=True)),
    "qwen2_moe": ("Qwen2MoeForCausalLM", dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                                              shared_expert_intermediate_size=96, norm_topk_prob=False)),
    "olmoe": ("OlmoeForCausalLM", dict(num_experts=8, num_experts_per_tok=2, clip_qkv=1.0, pad_token_id=0)),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def tiny_moe(request, tmp_path_factory):
    arch, overrides = FAMILIES[request.param]
    path = make_tiny_model(tmp_path_factory.mktemp(f"tiny-{request.param}"), arch, **overrides)
    return request.param, path, load_hf(path)


def test_moe_matches_transformers(tiny_moe):
    family, path, hf = tiny_moe
    llm = LLM(model=str(path), num_kv_blocks=256, block_size=4, max_num_batched_tokens=24)
    model, cfg = llm.engine.core.runner.model, llm.engine.core.model_config
    moe = cfg.moe
    if family == "qwen3_moe":
        assert moe.sparse_layers == (False, True, False, False) and moe.renormalize and cfg.qk_norm
    if family == "qwen2_moe":
        assert moe.shared_intermediate_size == 96 and cfg.attention_bias and not moe.renormalize
    if family == "mixtral":
        assert moe.renormalize and moe.float32_weights
    if family == "olmoe":
        assert cfg.clip_qkv == 1.0 and model.model.layers[0].self_attn.q_norm.weight.numel() == cfg.hidden_size
    # softmax-routed families decode in the fused C++ step (MoeSpec); shared experts, OLMoE's norms do not
    assert (llm.engine.core.runner.fused_decoder is not None) == (family in ("mixtral", "qwen3_moe"))
    check_with_prefix_hit(llm, hf)


def test_moe_preemption_and_ngram_speculation(tiny_moe):
    family, path, hf = tiny_moe
    check_under_preemption(path, hf)
    shared = [7, 8, 9, 10] * 6
    check_ngram_speculation(path, hf, [shared + [11, 12], shared + [13], random_prompts(1, 20, 30, seed=3)[0] * 2])


def test_moe_int8_quantizes_experts_but_not_the_router(tmp_path):
    arch, overrides = FAMILIES["qwen2_moe"]
    path = make_tiny_model(tmp_path, arch, **overrides)
    llm = LLM(model=str(path), num_kv_blocks=64, block_size=4, quantization="int8")
    block = llm.engine.core.runner.model.model.layers[0].mlp
    assert block.gate.method.name == block.shared_expert_gate.method.name == "dense"
    assert all(e.down_proj.method.name.startswith("int8") for e in block.experts)
    outs = llm.generate(random_prompts(3, 5, 20, seed=4), SamplingParams(max_tokens=8, temperature=0,
                                                                         ignore_eos=True), use_tqdm=False)
    assert all(len(o.token_ids) == 8 for o in outs)
    assert_no_leak(llm)


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_moe_cpu_expert_paths_agree_in_bf16(tmp_path, quantization):
    """bf16 (packed experts) and int4: the experts' C++ call and the per-expert torch calls give the
    same tokens and bitwise the same logprobs, batched and with the prompts prefilled together."""
    arch, overrides = FAMILIES["mixtral"]
    path = make_tiny_model(tmp_path, arch, **overrides)
    # no prefix cache: the second run would skip the prompts, and in bf16 other row counts round otherwise
    llm = LLM(model=str(path), dtype="bfloat16", quantization=quantization, num_kv_blocks=256, block_size=4,
              enable_prefix_caching=False)
    blocks = [layer.mlp for layer in llm.engine.core.runner.model.model.layers]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2)
    prompts = random_prompts(6, 5, 30, seed=5)
    runs = {}
    for cpp in (True, False):
        for block in blocks:
            block.use_cpu_kernel = cpp
        runs[cpp] = [[(lp.token_id, lp.logprob) for lp in out.outputs[0].logprobs]
                     for out in llm.generate(prompts, params, use_tqdm=False)]
    assert blocks[0]._cpu_kernel is not None
    assert runs[True] == runs[False]
    assert_no_leak(llm)
