"""YaRN RoPE (DeepSeek-V2's rope_scaling) equals transformers': frequencies, the cos/sin gain, and
the softmax mscale that DeepSeek's latent attention applies on top."""

from __future__ import annotations

import pytest
import torch

from kvserve.config import RopeConfig
from kvserve.model.layers.rotary import inverse_frequencies

# DeepSeek-V2-Lite's rope_scaling, and the same with the ramp left untruncated and no mscales
CASES = {
    "v2_lite": dict(type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
                    mscale=0.707, mscale_all_dim=0.707),
    "mscales_differ": dict(type="yarn", factor=4.0, original_max_position_embeddings=128, mscale=1.0,
                           mscale_all_dim=0.8),
    "untruncated": dict(type="yarn", factor=8.0, original_max_position_embeddings=2048, truncate=False),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_yarn_matches_transformers(case):
    from transformers import DeepseekV2Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, yarn_apply_mscale

    scaling = CASES[case]
    hf = DeepseekV2Config(hidden_size=256, num_attention_heads=4, qk_rope_head_dim=64, max_position_embeddings=163840,
                          rope_scaling=dict(scaling), rope_theta=10000.0)
    hf_inv_freq, hf_gain = ROPE_INIT_FUNCTIONS["yarn"](hf)
    ours = RopeConfig.from_hf({"rope_theta": 10000.0, "rope_scaling": scaling, "max_position_embeddings": 163840})
    assert ours.rope_type == "yarn"
    assert torch.equal(inverse_frequencies(ours, 64), hf_inv_freq)
    assert ours.attention_factor == pytest.approx(hf_gain, rel=1e-12)
    scale = 192**-0.5
    assert scale * ours.softmax_mscale == pytest.approx(yarn_apply_mscale(hf.rope_parameters, scale), rel=1e-12)
