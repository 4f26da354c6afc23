"""The MoE block (model/layers/moe.py): routing equals transformers' routers, the grouped expert
computation equals transformers' sparse blocks, and each active expert runs once per forward
(its weights read once, on the C++ path too)."""

from __future__ import annotations

import pytest
import torch

from kvserve.config import MoeConfig
from kvserve.model.layers.moe import SparseMoeBlock, route
from kvserve.model.layers.moe_kernel import weight_bytes

HIDDEN = 32


def _hf_block(model_type: str, dtype: torch.dtype, **overrides):
    from transformers import AutoConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    blocks = {"mixtral": MixtralSparseMoeBlock, "qwen2_moe": Qwen2MoeSparseMoeBlock,
              "qwen3_moe": Qwen3MoeSparseMoeBlock}
    cfg = AutoConfig.for_model(model_type, hidden_size=HIDDEN, intermediate_size=48, moe_intermediate_size=48,
                               num_experts_per_tok=2, **overrides)
    torch.manual_seed(0)
    block = blocks[model_type](cfg).to(dtype).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    return block


def _ours(hf, moe: MoeConfig, dtype: torch.dtype) -> SparseMoeBlock:
    block = SparseMoeBlock(HIDDEN, moe, dtype)
    inter = moe.expert_intermediate_size
    with torch.no_grad():
        block.gate.weight.copy_(hf.gate.weight)
        for e, expert in enumerate(block.experts):
            expert.gate_up_proj.weight.copy_(hf.experts.gate_up_proj[e])
            expert.down_proj.weight.copy_(hf.experts.down_proj[e])
        if moe.shared_intermediate_size:
            s = hf.shared_expert
            block.shared_expert.gate_up_proj.weight.copy_(torch.cat([s.gate_proj.weight, s.up_proj.weight]))
            block.shared_expert.down_proj.weight.copy_(s.down_proj.weight)
            block.shared_expert_gate.weight.copy_(hf.shared_expert_gate.weight)
    assert block.experts[0].gate_up_proj.weight.shape == (2 * inter, HIDDEN)
    return block


CASES = {
    "mixtral": (dict(num_local_experts=8), MoeConfig(8, 2, 48, renormalize=True, float32_weights=True)),
    "qwen3_moe": (dict(num_experts=8, norm_topk_prob=False), MoeConfig(8, 2, 48)),
    "qwen3_moe_norm": (dict(num_experts=8, norm_topk_prob=True), MoeConfig(8, 2, 48, renormalize=True)),
    "qwen2_moe": (dict(num_experts=6, shared_expert_intermediate_size=40),
                  MoeConfig(6, 2, 48, shared_intermediate_size=40)),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_matches_transformers(case, dtype):
    overrides, moe = CASES[case]
    hf = _hf_block(case.removesuffix("_norm"), dtype, **overrides)
    ours = _ours(hf, moe, dtype)
    x = torch.randn(1, 40, HIDDEN, dtype=dtype)
    with torch.no_grad():
        _, hf_weights, hf_ids = hf.gate(x[0])
        weights, ids = route(ours.gate(x[0]), moe)
        assert torch.equal(ids, hf_ids)
        assert weights.dtype == hf_weights.dtype
        torch.testing.assert_close(weights, hf_weights, rtol=0, atol=0)
        # bf16: bitwise (the same kernels); float32: the CPU kernels sum in another order
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=0, atol=0)
        torch.testing.assert_close(ours(x[0]), hf(x)[0], **tol)


@pytest.mark.parametrize("cpp", [False, True], ids=["torch", "cpp"])
def test_each_active_expert_runs_once_per_forward(cpp):
    """Torch path: one call per active expert, none for idle ones. Both paths (the C++ call has no
    per-expert calls to hook): each active expert's weights read once, idle ones' not at all."""
    moe = MoeConfig(8, 2, 48)
    block = SparseMoeBlock(HIDDEN, moe, torch.float32)
    block.use_cpu_kernel = cpp
    x = torch.randn(32, HIDDEN)  # a decode step at batch 32
    if cpp and block._kernel_for(x) is None:
        pytest.skip("the C++ kernels are not built here")
    torch.manual_seed(1)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    calls = [0] * moe.num_experts
    rows = [0] * moe.num_experts
    for e, expert in enumerate(block.experts):
        def hook(module, args, e=e):
            calls[e] += 1
            rows[e] += args[0].shape[0]
        expert.register_forward_pre_hook(hook)
    block.bytes_read = torch.zeros(moe.num_experts, 2, dtype=torch.long)
    with torch.no_grad():
        _, ids = route(block.gate(x), moe)
        block(x)
    chosen = torch.bincount(ids.flatten(), minlength=moe.num_experts).tolist()
    if not cpp:
        assert rows == chosen  # every (token, expert) pair went to its expert
        assert calls == [1 if n else 0 for n in chosen]  # one matmul per active expert, none for idle ones
    sizes = torch.tensor([[weight_bytes(e.gate_up_proj), weight_bytes(e.down_proj)] for e in block.experts])
    assert torch.equal(block.bytes_read, sizes * (torch.tensor(chosen) > 0)[:, None])
    assert sum(n > 0 for n in chosen) >= 2


def test_sparse_layers_follow_decoder_sparse_step_and_mlp_only_layers():
    cfg = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8, "decoder_sparse_step": 2,
           "mlp_only_layers": [3]}
    moe = MoeConfig.from_hf(cfg, "Qwen3MoeForCausalLM", 6)
    assert moe.sparse_layers == (False, True, False, False, False, True)
    mixtral = MoeConfig.from_hf({"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 16},
                                "MixtralForCausalLM", 2)
    assert mixtral.renormalize and mixtral.expert_intermediate_size == 16 and mixtral.sparse_layers == (True, True)
    assert MoeConfig.from_hf(cfg, "LlamaForCausalLM", 6) is None
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        MoeConfig.from_hf({**cfg, "num_experts_per_tok": 5}, "Qwen3MoeForCausalLM", 6)


DEEPSEEK_ROUTERS = {
    "v2_greedy": ("deepseek_v2", dict(topk_method="greedy", routed_scaling_factor=1.5)),
    "v2_group_limited": ("deepseek_v2", dict(topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                             routed_scaling_factor=16.0)),
    "v3": ("deepseek_v3", dict(n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)),
}


@pytest.mark.parametrize("case", sorted(DEEPSEEK_ROUTERS))
def test_deepseek_routing_matches_transformers(case):
    """Group-limited top k (by each group's best expert, or V3's two best biased scores), scaled weights."""
    from transformers import AutoConfig
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    model_type, overrides = DEEPSEEK_ROUTERS[case]
    hf_cfg = AutoConfig.for_model(model_type, hidden_size=HIDDEN, n_routed_experts=16, num_experts_per_tok=3,
                                  moe_intermediate_size=8, first_k_dense_replace=0, **overrides)
    arch = "DeepseekV3ForCausalLM" if model_type == "deepseek_v3" else "DeepseekV2ForCausalLM"
    moe = MoeConfig.from_hf(hf_cfg.to_dict(), arch, 1)
    torch.manual_seed(2)
    hf = (DeepseekV3TopkRouter if model_type == "deepseek_v3" else DeepseekV2TopkRouter)(hf_cfg)
    with torch.no_grad():
        hf.weight.normal_(0, 0.5)
        bias = None
        if model_type == "deepseek_v3":
            bias = hf.e_score_correction_bias.normal_(0, 0.3)
        x = torch.randn(64, HIDDEN)
        _, hf_weights, hf_ids = hf(x)
        weights, ids = route(x @ hf.weight.T, moe, bias)
    order, hf_order = ids.argsort(dim=-1), hf_ids.argsort(dim=-1)  # transformers leaves the top k unsorted
    assert torch.equal(ids.gather(1, order), hf_ids.gather(1, hf_order))
    torch.testing.assert_close(weights.gather(1, order), hf_weights.gather(1, hf_order), rtol=0, atol=0)
    if model_type == "deepseek_v2" and moe.num_groups > 1:  # the group limit really changed some choices
        assert not torch.equal(ids.sort(-1).values, torch.softmax(x @ hf.weight.T, -1).topk(3).indices.sort(-1).values)


def test_deepseek_sparse_layers_and_experts_from_config():
    cfg = {"n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "n_shared_experts": 2,
           "first_k_dense_replace": 1, "moe_layer_freq": 2}
    moe = MoeConfig.from_hf(cfg, "DeepseekV2ForCausalLM", 5)
    assert moe.sparse_layers == (False, False, True, False, True)
    assert moe.shared_intermediate_size == 32 and not moe.shared_expert_gated and moe.float32_weights
    # DeepSeek's own V2 code renormalises instead of scaling; V3 does both
    v2_norm = MoeConfig.from_hf({**cfg, "norm_topk_prob": True, "routed_scaling_factor": 16.0},
                                "DeepseekV2ForCausalLM", 5)
    assert v2_norm.renormalize and v2_norm.routed_scaling_factor == 1.0
    v3 = MoeConfig.from_hf({**cfg, "norm_topk_prob": True, "routed_scaling_factor": 2.5}, "DeepseekV3ForCausalLM", 5)
    assert v3.renormalize and v3.routed_scaling_factor == 2.5 and v3.scoring == "sigmoid"
    with pytest.raises(ValueError, match="topk_method"):
        MoeConfig.from_hf({**cfg, "topk_method": "noaux_tc"}, "DeepseekV2ForCausalLM", 5)
    with pytest.raises(ValueError, match="n_group"):
        MoeConfig.from_hf({**cfg, "topk_method": "group_limited_greedy", "n_group": 3}, "DeepseekV2ForCausalLM", 5)
    with pytest.raises(ValueError, match="scoring"):
        MoeConfig(8, 2, 16, scoring="sparsemixer")
