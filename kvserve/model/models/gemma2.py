"""Gemma 2: the Llama decoder's attention and projections, with Gemma's differences.

- local (sliding-window) and global layers alternate (``layer_types`` in config.json);
- attention scores and the final logits are soft-capped: cap * tanh(x / cap);
- the attention scale is ``query_pre_attn_scalar ** -0.5``;
- RMSNorm multiplies by (1 + w): the checkpoint's w is stored as 1 + w at load, so the shared
  RMSNorm kernel runs unchanged; each layer normalises before *and* after attention and the MLP;
- a GeGLU MLP (tanh-approximated GELU of the gate, times up);
- the embeddings are scaled by sqrt(hidden_size) (rounded to the model dtype, as transformers does);
  the output head is tied to them.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from kvserve.config import ModelConfig
from kvserve.model.attention.backend import AttentionBackend, AttentionMetadata
from kvserve.model.layers.linear import Linear, VocabEmbedding, load_checkpoint
from kvserve.model.layers.norm import RMSNorm
from kvserve.model.layers.rotary import RotaryEmbedding
from kvserve.model.models.llama import Attention

_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")


class GemmaAttention(Attention):
    """Llama's attention with Gemma's scale and (Gemma 2) soft-capped scores."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, layer: int) -> None:
        super().__init__(cfg, dtype, layer)
        if cfg.query_pre_attn_scalar is not None:
            self.scale = cfg.query_pre_attn_scalar**-0.5
        self.softcap = cfg.attn_logit_softcap


class GeGLU(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        if cfg.hidden_act not in _GELU_TANH:
            raise ValueError(f"hidden_activation={cfg.hidden_act!r} is not supported for Gemma; supported: "
                             f"{', '.join(_GELU_TANH)}")
        inter = cfg.intermediate_size
        self.inter = inter
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * inter, False, dtype,
                                   shards={"gate_proj": (0, inter), "up_proj": (inter, inter)})
        self.down_proj = Linear(inter, cfg.hidden_size, False, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split((self.inter, self.inter), dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma2DecoderLayer(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, layer: int) -> None:
        super().__init__()
        self.self_attn = GemmaAttention(cfg, dtype, layer)
        self.mlp = GeGLU(cfg, dtype)
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, dtype)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, dtype)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, dtype)

    def forward(self, positions, x, residual, rotary, kv_cache, meta, backend) -> tuple[torch.Tensor, torch.Tensor]:
        """As Llama's layer: ``x`` is the previous layer's output, added into ``residual`` by the next norm."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h = self.input_layernorm(x, residual)
        attn = self.post_attention_layernorm(self.self_attn(positions, h, rotary, kv_cache, meta, backend))
        h = self.pre_feedforward_layernorm(attn, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class GemmaBackbone(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, layer_class: type[torch.nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.layers = torch.nn.ModuleList(layer_class(cfg, dtype, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class Gemma2ForCausalLM(torch.nn.Module):
    layer_class: type[torch.nn.Module] = Gemma2DecoderLayer

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = cfg
        self.model = GemmaBackbone(cfg, dtype, self.layer_class)
        self.rotary = self.make_rotary(cfg)
        # transformers multiplies by the scale as a tensor of the weights' dtype
        self.embed_scale = float(torch.tensor(cfg.hidden_size**0.5, dtype=dtype))
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, False, dtype)

    @staticmethod
    def make_rotary(cfg: ModelConfig):
        return RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position)

    def rotary_of(self, layer: int) -> RotaryEmbedding:
        return self.rotary

    def use_kv_groups(self, group_of_layer: list[int]) -> None:
        """Read each layer's KV through its group's block tables (a hybrid KV cache: the runner's
        kv_cache/groups.py layout keeps the local layers' KV to their window)."""
        for layer, group in zip(self.model.layers, group_of_layer, strict=True):
            layer.self_attn.kv_group = group

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        x, residual = self.model.embed_tokens(input_ids) * self.embed_scale, None
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches)):
            x, residual = layer(positions, x, residual, self.rotary_of(i), kv_cache, meta, backend)
        return self.model.norm(x, residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        logits = head.project(hidden)
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF names and values, as Llama's; every RMSNorm weight w is stored as 1 + w (see the
        module doc), added in float64 before rounding to the model dtype (a GGUF file's 1 + w,
        which gguf_file hands out as w in float64, comes back exactly)."""
        norms = {f"{name}.weight" for name, module in self.named_modules() if isinstance(module, RMSNorm)}
        shifted = ((name, tensor.double() + 1.0 if name in norms else tensor) for name, tensor in weights)
        load_checkpoint(self, shifted, skip=("lm_head.",) if self.lm_head is None else ())
