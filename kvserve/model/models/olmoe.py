"""OLMoE: the MoE decoder whose q and k norms run over the whole projection (all heads at once, not
per head as Qwen3's), with q, k and v optionally clamped to [-clip_qkv, clip_qkv] after it.
"""

from __future__ import annotations

import torch

from kvserve.config import ModelConfig
from kvserve.model.attention.backend import AttentionBackend, AttentionMetadata
from kvserve.model.layers.linear import Linear
from kvserve.model.layers.norm import RMSNorm
from kvserve.model.layers.rotary import RotaryEmbedding
from kvserve.model.models.llama import Attention
from kvserve.model.models.moe_decoder import MoeDecoderLayer, MoeForCausalLM


class OlmoeAttention(Attention):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, layer: int) -> None:
        super().__init__(cfg, dtype, layer)
        q, kv, _ = self.splits
        self.q_norm = RMSNorm(q, cfg.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(kv, cfg.rms_norm_eps, dtype)
        self.o_proj = Linear(q, cfg.hidden_size, cfg.attention_bias, dtype)  # OLMoE biases o_proj too
        self.clip = cfg.clip_qkv

    def forward(self, positions: torch.Tensor, x: torch.Tensor, rotary: RotaryEmbedding, kv_cache: torch.Tensor,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.splits, dim=-1)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.use_rope:
            rotary(positions, q, k)
        out = backend.forward(q, k, v, kv_cache, meta, self.scale, window=self.window, softcap=self.softcap)
        return self.o_proj(out.reshape(out.shape[0], -1))


class OlmoeDecoderLayer(MoeDecoderLayer):
    attention_class = OlmoeAttention


class OlmoeForCausalLM(MoeForCausalLM):
    layer_class = OlmoeDecoderLayer
