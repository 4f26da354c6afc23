"""Gemma 3 text models: Gemma 2's layer (pre/post norms, GeGLU, scaled embeddings, (1 + w) norms)
with q/k norms instead of soft-capping, five local layers per global one (``layer_types``), and a
RoPE of their own for the local layers (another base, unscaled) while the global ones may scale.
"""

from __future__ import annotations

import torch

from kvserve.config import ModelConfig
from kvserve.model.layers.rotary import RotaryEmbedding
from kvserve.model.models.gemma2 import Gemma2ForCausalLM


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        if not cfg.qk_norm:
            raise ValueError("Gemma 3 normalises q and k per head; this config does not say so")
        super().__init__(cfg, dtype)
        local = cfg.local_rope
        self.local_rotary = None if local is None else RotaryEmbedding(local, cfg.head_dim, cfg.max_position)

    def rotary_of(self, layer: int) -> RotaryEmbedding:
        if self.local_rotary is not None and self.config.window_of(layer) is not None:
            return self.local_rotary
        return self.rotary
