"""Qwen3-MoE (q/k norm per head, as Qwen3) and Qwen2-MoE (q/k/v bias, and a shared expert gated by
sigmoid(x w) beside the routed ones). Both put the sparse block in the layers that
``decoder_sparse_step`` selects and ``mlp_only_layers`` does not exclude (config.MoeConfig), and
renormalise the top-k weights only if ``norm_topk_prob``.
"""

from __future__ import annotations

import torch

from kvserve.config import ModelConfig
from kvserve.model.models.moe_decoder import MoeForCausalLM


class Qwen3MoeForCausalLM(MoeForCausalLM):
    fused_decode = True

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        if not cfg.qk_norm:
            raise ValueError("Qwen3-MoE normalises q and k per head; this config does not say so")
        super().__init__(cfg, dtype)


class Qwen2MoeForCausalLM(MoeForCausalLM):
    pass
