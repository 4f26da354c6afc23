"""YaRN RoPE scaling equals transformers' for gpt-oss's and DeepSeek's configs: the frequencies bit for
bit, the cos/sin gain, and the softmax mscale that DeepSeek's latent attention applies on top."""

from __future__ import annotations

import pytest
import torch

from kvserve.config import RopeConfig
from kvserve.model.layers.rotary import inverse_frequencies

transformers = pytest.importorskip("transformers")

# (config class, rope_theta, YaRN parameters). The context is factor * original positions long.
CASES = {
    # gpt-oss's own: no truncation of the ramp
    "gpt_oss": ("GptOssConfig", 150000.0, dict(factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                                                original_max_position_embeddings=4096)),
    # the defaults: truncated, betas 32 / 1, a smaller stretch
    "defaults": ("GptOssConfig", 150000.0, dict(factor=4.0, original_max_position_embeddings=256)),
    "explicit_gain": ("GptOssConfig", 150000.0, dict(factor=8.0, original_max_position_embeddings=512,
                                                      attention_factor=0.8, beta_fast=16.0, beta_slow=2.0)),
    # DeepSeek-V2-Lite's rope_scaling: equal mscales, so no gain on cos/sin but a softmax mscale
    "deepseek_v2_lite": ("DeepseekV2Config", 10000.0, dict(factor=40.0, original_max_position_embeddings=4096,
                                                           beta_fast=32, beta_slow=1, mscale=0.707,
                                                           mscale_all_dim=0.707)),
    "deepseek_mscales_differ": ("DeepseekV2Config", 10000.0, dict(factor=4.0, original_max_position_embeddings=128,
                                                                  mscale=1.0, mscale_all_dim=0.8)),
    "deepseek_v3": ("DeepseekV3Config", 10000.0, dict(factor=40.0, original_max_position_embeddings=4096,
                                                      beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)),
}


def _hf_config(class_name: str, head_dim: int, max_position: int, rope_parameters: dict):
    """A transformers config whose rotary dims are ``head_dim`` (DeepSeek: its rotary key's width)."""
    extra = dict(qk_rope_head_dim=head_dim) if class_name.startswith("Deepseek") else dict(head_dim=head_dim)
    return getattr(transformers, class_name)(hidden_size=4 * head_dim, num_attention_heads=4,
                                             max_position_embeddings=max_position,
                                             rope_parameters=dict(rope_parameters), **extra)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("head_dim", [16, 64])
def test_yarn_matches_transformers(case, head_dim):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, yarn_apply_mscale

    class_name, theta, params = CASES[case]
    rope_parameters = {"rope_type": "yarn", "rope_theta": theta, **params}
    max_position = int(params["factor"] * params["original_max_position_embeddings"])
    hf = _hf_config(class_name, head_dim, max_position, rope_parameters)
    want_freq, want_gain = ROPE_INIT_FUNCTIONS["yarn"](hf)
    ours = RopeConfig.from_hf({"rope_parameters": rope_parameters, "max_position_embeddings": max_position})
    assert ours.rope_type == "yarn" and ours.attention_factor == pytest.approx(want_gain, rel=1e-12)
    torch.testing.assert_close(inverse_frequencies(ours, head_dim), want_freq, atol=0, rtol=0)
    scale = 192**-0.5
    assert scale * ours.softmax_mscale == pytest.approx(yarn_apply_mscale(hf.rope_parameters, scale), rel=1e-12)


def test_deepseek_rope_scaling_spelling_reads_the_same():
    """DeepSeek's config.json says ``rope_scaling`` with ``type``; transformers 5 says ``rope_parameters``."""
    _, theta, params = CASES["deepseek_mscales_differ"]
    old = RopeConfig.from_hf({"rope_theta": theta, "rope_scaling": {"type": "yarn", **params}})
    new = RopeConfig.from_hf({"rope_parameters": {"rope_type": "yarn", "rope_theta": theta, **params}})
    assert old == new and old.softmax_mscale != 1.0 and old.attention_factor != 1.0


def test_yarn_factor_defaults_to_the_context_stretch():
    cfg = {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "original_max_position_embeddings": 1024},
           "max_position_embeddings": 8192}
    rope = RopeConfig.from_hf(cfg)
    assert rope.factor == 8.0 and rope.attention_factor == pytest.approx(0.1 * torch.log(torch.tensor(8.0)).item() + 1)
    assert rope.softmax_mscale == 1.0  # no mscale_all_dim: the softmax keeps its scale
