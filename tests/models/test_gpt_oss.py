"""gpt-oss matches transformers token for token: learned per-head sink logits, alternating
sliding-window / full layers (a window shorter than the prompts), q/k/v and o_proj biases, YaRN RoPE,
a biased router that softmaxes only its top k, and biased experts with the clamped SwiGLU (a limit
low enough to clamp); under chunked prefill, a prefix-cache hit, preemption and n-gram speculation.
A checkpoint whose experts are MXFP4 blocks (as released ones are) loads and matches transformers
running the same weights as its own MXFP4 dequantization gives them."""

from __future__ import annotations

import shutil

import pytest
import torch

from kvserve import LLM
from kvserve.model.models.gpt_oss import _hf_to_ours
from kvserve.model.quant.mxfp4 import BLOCK, E2M1_VALUES
from tests.conftest import make_tiny_model
from tests.models.reference import (
    check_ngram_speculation,
    check_under_preemption,
    check_with_prefix_hit,
    generate_and_check,
    load_hf,
    random_prompts,
)

WINDOW = 8
SHAPE = dict(num_hidden_layers=3, sliding_window=WINDOW, num_local_experts=8, num_experts_per_tok=2,
             intermediate_size=32, swiglu_limit=1.0,
             rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0,
                              "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 128})


@pytest.fixture(scope="module")
def tiny_gpt_oss(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("tiny-gpt-oss"), "GptOssForCausalLM", **SHAPE)
    return path, load_hf(path)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gpt_oss_matches_transformers(tiny_gpt_oss, backend):
    if backend == "triton":
        pytest.importorskip("triton")
    path, hf = tiny_gpt_oss
    llm = LLM(model=str(path), attention_backend=backend, num_kv_blocks=256, block_size=4,
              max_num_batched_tokens=24)
    cfg = llm.engine.core.model_config
    assert cfg.layer_windows == (WINDOW, None, WINDOW) and cfg.attention_bias
    assert cfg.rope.rope_type == "yarn" and cfg.rope.attention_factor > 1 and not cfg.rope.truncate
    moe = cfg.moe
    assert moe.scoring == "topk_softmax" and moe.router_bias and moe.expert_bias
    assert (moe.activation, moe.swiglu_limit, moe.swiglu_alpha) == ("clamped_swiglu", 1.0, 1.702)
    assert llm.engine.core.runner.fused_decoder is None
    check_with_prefix_hit(llm, hf)


def test_gpt_oss_preemption_and_ngram_speculation(tiny_gpt_oss):
    path, hf = tiny_gpt_oss
    check_under_preemption(path, hf)
    check_ngram_speculation(path, hf)


def _to_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., rows, cols] rounded to MXFP4: (blocks [..., rows, cols / 32, 16], scales [..., rows, cols / 32]),
    each block's scale the power of two that brings its largest magnitude to at most 6."""
    groups = w.reshape(*w.shape[:-1], -1, BLOCK)
    exponents = torch.ceil(torch.log2(groups.abs().amax(-1).clamp_min(2.0**-100) / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponents)[..., None]
    codes = (scaled[..., None] - torch.tensor(E2M1_VALUES)).abs().argmin(-1).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exponents + 127).to(torch.uint8)


def test_gpt_oss_mxfp4_checkpoint_loads(tiny_gpt_oss, tmp_path):
    """Experts stored as *_blocks / *_scales ([E, out, in] order, as released checkpoints have them);
    transformers' own dequantization puts the same values into its reference model."""
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    path, _ = tiny_gpt_oss
    for f in path.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, tmp_path / f.name)
    hf = load_hf(path)
    state = {}
    for layer_index, layer in enumerate(hf.model.layers):
        experts = layer.mlp.experts
        for proj in ("gate_up_proj", "down_proj"):
            blocks, scales = _to_mxfp4(getattr(experts, proj).data.transpose(1, 2))
            getattr(experts, proj).data = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
            name = f"model.layers.{layer_index}.mlp.experts.{proj}"
            state[f"{name}_blocks"], state[f"{name}_scales"] = blocks, scales
    for name, tensor in hf.state_dict().items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            state[name] = tensor.contiguous()
    save_file(state, str(tmp_path / "model.safetensors"))
    llm = LLM(model=str(tmp_path), num_kv_blocks=256, block_size=4, max_num_batched_tokens=24)
    generate_and_check(llm, hf, random_prompts(4, 10, 40, seed=4), max_tokens=16)


def test_an_mxfp4_half_without_its_partner_is_refused():
    blocks = torch.zeros(2, 8, 2, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="MXFP4 partner"):
        list(_hf_to_ours([("model.layers.0.mlp.experts.down_proj_blocks", blocks)], torch.float32))
