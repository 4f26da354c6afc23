"""DeepSeek-V2 (and V2-Lite) and DeepSeek-V3 (less its multi-token prediction): multi-head latent
attention and DeepSeek's mixture of experts on the Llama decoder's skeleton (pre-norm layers,
residual stream, output head).

- Attention (``MlaAttention``): keys and values come from one compressed latent per token, which is
  what the paged cache stores with the decoupled rotary key (attention/mla.py); queries come
  through a low-rank bottleneck with its own RMSNorm (``q_lora_rank``) or straight from ``q_proj``
  (V2-Lite). With YaRN RoPE the softmax scale carries DeepSeek's mscale squared.
- MLP: the first ``first_k_dense_replace`` layers are dense; the others route each token to
  ``num_experts_per_tok`` of ``n_routed_experts`` (greedy or group-limited top k, times
  ``routed_scaling_factor``) and add ungated shared experts (layers/moe.py). V3 differs only in
  its routing (sigmoid scores with a correction bias, config.MoeConfig).
- The checkpoint's rotary dims are interleaved pairs (2i, 2i + 1) (unless V3's rope_interleave is
  false); they are reordered at load to the rotate-half layout (i, i + D/2) the rotary kernels
  use, in q and k alike, so scores are kept.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from kvserve.config import ModelConfig
from kvserve.model.attention.backend import AttentionBackend, AttentionMetadata
from kvserve.model.attention.mla import mla_attention, write_latents
from kvserve.model.layers.linear import Linear, load_checkpoint
from kvserve.model.layers.norm import RMSNorm
from kvserve.model.layers.rotary import RotaryEmbedding
from kvserve.model.models.moe_decoder import MoeDecoderLayer, MoeForCausalLM

_LATENT_NORM_EPS = 1e-6  # transformers builds q_a_layernorm and kv_a_layernorm with their default eps


class PlainWeight(torch.nn.Module):
    """A weight read as a tensor, not applied as a layer: MLA splits ``kv_b_proj`` per head into the
    up-projections a decode absorbs, so it stays dense in the model dtype under any quantization."""

    def __init__(self, rows: int, cols: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(rows, cols, dtype=dtype), requires_grad=False)


class MlaAttention(torch.nn.Module):
    window = None  # no sliding window; attention sinks are refused (DeepseekV2ForCausalLM)
    sinks = 0

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, layer: int = 0) -> None:
        super().__init__()
        m, heads, hidden, bias = cfg.mla, cfg.num_heads, cfg.hidden_size, cfg.attention_bias
        self.num_heads, self.nope, self.rope, self.v_head_dim = heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        self.rank = m.kv_lora_rank
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        self.q_lora = m.q_lora_rank is not None
        if not self.q_lora:
            self.q_proj = Linear(hidden, heads * qk, False, dtype)
        else:
            self.q_a_proj = Linear(hidden, m.q_lora_rank, bias, dtype)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, _LATENT_NORM_EPS, dtype)
            self.q_b_proj = Linear(m.q_lora_rank, heads * qk, False, dtype)
        self.kv_a_proj_with_mqa = Linear(hidden, m.latent_width, bias, dtype)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, _LATENT_NORM_EPS, dtype)
        self.kv_b_proj = PlainWeight(heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank, dtype)
        self.o_proj = Linear(heads * m.v_head_dim, hidden, bias, dtype)
        self.scale = qk**-0.5 * cfg.rope.softmax_mscale

    def forward(self, positions: torch.Tensor, x: torch.Tensor, rotary: RotaryEmbedding, kv_cache: torch.Tensor,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        """``backend`` is unused: the latent cache has its own attention (attention/mla.py)."""
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q_nope, q_rope = q.view(-1, self.num_heads, self.nope + self.rope).split((self.nope, self.rope), dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split((self.rank, self.rope), dim=-1)
        q_rope, k_rope = q_rope.contiguous(), k_rope.contiguous().view(-1, 1, self.rope)
        rotary(positions, q_rope, k_rope)
        write_latents(kv_cache, self.kv_a_layernorm(latent.contiguous()), k_rope.view(-1, self.rope), meta.slot_mapping)
        out = mla_attention(q_nope, q_rope, kv_cache, meta, self.scale, self.kv_b_proj.weight, self.v_head_dim)
        return self.o_proj(out.reshape(out.shape[0], -1))


class DeepseekV2DecoderLayer(MoeDecoderLayer):
    attention_class = MlaAttention


class DeepseekV2ForCausalLM(MoeForCausalLM):
    layer_class = DeepseekV2DecoderLayer

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        if cfg.mla is None:
            raise ValueError(f"{cfg.architecture}: config.json has no kv_lora_rank (multi-head latent attention)")
        super().__init__(cfg, dtype)

    def use_attention_sinks(self, sinks: int, window: int) -> None:
        raise ValueError(f"attention_sinks: not supported for {self.config.architecture} (latent attention)")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF names; ``shared_experts`` load into the MoE block's ``shared_expert``, the rotary rows
        are reordered (see the module doc) and multi-token-prediction layers past the last are skipped."""
        cfg = self.config
        weights = _renamed(weights, cfg.num_layers)
        if cfg.mla.rope_interleaved:
            weights = _rotary_rows_to_halves(weights, cfg)
        load_checkpoint(self, weights, skip=("lm_head.",) if self.lm_head is None else ())


def _renamed(weights: Iterable[tuple[str, torch.Tensor]], num_layers: int):
    for name, tensor in weights:
        if name.startswith("model.layers.") and int(name.split(".")[2]) >= num_layers:
            continue  # DeepSeek-V3's multi-token-prediction layers
        name = name.replace(".mlp.shared_experts.", ".mlp.shared_expert.")
        yield name.replace(".mlp.gate.e_score_correction_bias", ".mlp.e_score_correction_bias"), tensor


def _rotary_rows_to_halves(weights: Iterable[tuple[str, torch.Tensor]], cfg: ModelConfig):
    """Reorder the output rows that become rotary dims from interleaved pairs to rotate-half pairs."""
    m = cfg.mla
    rope = m.qk_rope_head_dim
    to_halves = torch.cat((torch.arange(0, rope, 2), torch.arange(1, rope, 2)))
    qk = m.qk_nope_head_dim + rope
    q_rows = torch.arange(cfg.num_heads * qk).view(cfg.num_heads, qk)
    q_rows[:, m.qk_nope_head_dim:] = q_rows[:, m.qk_nope_head_dim:][:, to_halves]
    kv_rows = torch.arange(m.latent_width)
    kv_rows[m.kv_lora_rank:] = kv_rows[m.kv_lora_rank:][to_halves]
    for name, tensor in weights:
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight")):
            tensor = _take_rows(tensor, q_rows.flatten())
        elif name.endswith(("self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_proj_with_mqa.bias")):
            tensor = _take_rows(tensor, kv_rows)
        yield name, tensor


def _take_rows(tensor, rows: torch.Tensor):
    return tensor[rows] if isinstance(tensor, torch.Tensor) else tensor.take_rows(rows.numpy())


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """V2's model; the routing differences are the config's (MoeConfig.scoring)."""
