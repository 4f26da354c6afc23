"""YaRN RoPE scaling: the frequencies and cos/sin gain transformers computes, bit for bit."""

from __future__ import annotations

import pytest
import torch

from kvserve.config import RopeConfig
from kvserve.model.layers.rotary import inverse_frequencies

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("params", [
    # gpt-oss's own: no truncation of the ramp
    dict(factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False, original_max_position_embeddings=4096),
    # the defaults: truncated, betas 32 / 1, a smaller stretch
    dict(factor=4.0, original_max_position_embeddings=256),
    # an explicit gain
    dict(factor=8.0, original_max_position_embeddings=512, attention_factor=0.8, beta_fast=16.0, beta_slow=2.0),
])
@pytest.mark.parametrize("head_dim", [16, 64])
def test_yarn_matches_transformers(params, head_dim):
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_parameters = {"rope_type": "yarn", "rope_theta": 150000.0, **params}
    hf_cfg = GptOssConfig(head_dim=head_dim, hidden_size=4 * head_dim, num_attention_heads=4,
                          max_position_embeddings=int(params["factor"] * params["original_max_position_embeddings"]),
                          rope_parameters=dict(rope_parameters))
    want_freq, want_gain = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg)
    ours = RopeConfig.from_hf({"rope_parameters": rope_parameters,
                               "max_position_embeddings": hf_cfg.max_position_embeddings})
    assert ours.rope_type == "yarn" and ours.attention_factor == pytest.approx(want_gain, rel=1e-12)
    torch.testing.assert_close(inverse_frequencies(ours, head_dim), want_freq, atol=0, rtol=0)


def test_yarn_factor_defaults_to_the_context_stretch():
    cfg = {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "original_max_position_embeddings": 1024},
           "max_position_embeddings": 8192}
    rope = RopeConfig.from_hf(cfg)
    assert rope.factor == 8.0 and rope.attention_factor == pytest.approx(0.1 * torch.log(torch.tensor(8.0)).item() + 1)
