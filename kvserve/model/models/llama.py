"""One decoder covering the Llama family: Llama 2/3, Mistral, Qwen2/2.5 (qkv bias), Qwen3 (q/k norm),
SmolLM2. MHA, GQA and MQA differ only in ``num_kv_heads``.

The forward pass takes a flat batch of tokens from many requests at once (no padding, no batch
dimension); attention is delegated to the backend, which reads and writes the paged KV cache.
Q/K/V and gate/up projections are fused into one matmul each.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from kvserve.config import ModelConfig
from kvserve.model.attention.backend import AttentionBackend, AttentionMetadata
from kvserve.model.layers.linear import Linear, VocabEmbedding, load_checkpoint
from kvserve.model.layers.norm import RMSNorm
from kvserve.model.layers.rotary import RotaryEmbedding, partial_rotary_order, rotary_dims


class Attention(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, layer: int = 0) -> None:
        super().__init__()
        self.window = cfg.window_of(layer)  # sliding window of this layer, None: full attention
        self.use_rope = cfg.uses_rope(layer)  # False: a NoPE layer (SmolLM3)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, q + 2 * kv, cfg.attention_bias, dtype,
                               shards={"q_proj": (0, q), "k_proj": (q, kv), "v_proj": (q + kv, kv)})
        self.o_proj = Linear(q, cfg.hidden_size, False, dtype)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.scale = cfg.head_dim**-0.5
        self.softcap: float | None = None  # Gemma 2 caps the attention scores (gemma2.py)
        self.splits = (q, kv, kv)
        self.sinks = 0  # attention sinks: see LlamaForCausalLM.use_attention_sinks
        self.kv_group = 0  # a hybrid model's KV group: which block tables this layer reads (meta.of_group)

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, heads, head_dim], k and v [T, kv_heads, head_dim] from one fused matmul."""
        q, k, v = self.qkv_proj(x).split(self.splits, dim=-1)
        return (q.view(-1, self.num_heads, self.head_dim), k.view(-1, self.num_kv_heads, self.head_dim),
                v.view(-1, self.num_kv_heads, self.head_dim))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, rotary: RotaryEmbedding, kv_cache: torch.Tensor,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        q, k, v = self.project_qkv(x)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        sink_q = None
        if self.sinks:
            # the queries as if at the last place of a full cache (sinks + window): what they score
            # the sink keys with once the window has moved past them
            sink_q = q.clone()
            if self.use_rope:
                place = torch.full_like(positions, self.sinks + self.window - 1)
                rotary.rotate(place, sink_q)
        if self.use_rope:
            rotary(positions, q, k)
        if self.kv_group:
            meta = meta.of_group(self.kv_group)
        if sink_q is not None:
            out = backend.forward(q, k, v, kv_cache, meta, self.scale, window=self.window, sinks=self.sinks,
                                  sink_q=sink_q)
        else:
            out = backend.forward(q, k, v, kv_cache, meta, self.scale, window=self.window, softcap=self.softcap)
        return self.o_proj(out.reshape(out.shape[0], -1))


class MLP(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * inter, False, dtype,
                                   shards={"gate_proj": (0, inter), "up_proj": (inter, inter)}, gated=True)
        self.down_proj = Linear(inter, cfg.hidden_size, False, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.project_silu_mul(x))


class DecoderLayer(torch.nn.Module):
    attention_class: type[Attention] = Attention

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, layer: int = 0) -> None:
        super().__init__()
        self.self_attn = self.attention_class(cfg, dtype, layer)
        self.mlp = self.make_mlp(cfg, dtype, layer)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, positions, x, residual, rotary, kv_cache, meta, backend) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's MLP output, not yet added into ``residual`` (the stream of sums),
        which is updated in place; the first layer gets the embeddings and no residual. Returns
        (this layer's MLP output, residual): deferring each add into the next norm fuses the two."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h = self.input_layernorm(x, residual)
        h = self.post_attention_layernorm(self.self_attn(positions, h, rotary, kv_cache, meta, backend), residual)
        return self.mlp(h), residual

    def make_mlp(self, cfg: ModelConfig, dtype: torch.dtype, layer: int) -> torch.nn.Module:
        """This layer's MLP: a module from [T, hidden] to [T, hidden] (mixture-of-experts families swap it)."""
        return MLP(cfg, dtype)


class Backbone(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, layer_class: type[DecoderLayer] = DecoderLayer) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.layers = torch.nn.ModuleList(layer_class(cfg, dtype, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class LlamaForCausalLM(torch.nn.Module):
    """Parameter names follow Hugging Face checkpoints, except the fused qkv/gate_up projections."""

    fused_decode = True  # llama_decode.py may run its pure decode steps as one C++ call
    layer_class: type[DecoderLayer] = DecoderLayer

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg, dtype, self.layer_class)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, False, dtype)
        # The output head reads the final norm's output: column j is scaled by that norm's weight j.
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        head.input_importance = lambda: self.model.norm.weight.detach().float() ** 2

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        """Hidden states [T, hidden] for a flat batch of T tokens."""
        x, residual = self.model.embed_tokens(input_ids), None  # a fresh tensor: the residual grows in it
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x, residual = layer(positions, x, residual, self.rotary, kv_cache, meta, backend)
        return self.model.norm(x, residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        return head.project(hidden)

    @property
    def attention_sinks(self) -> int:
        return self.model.layers[0].self_attn.sinks

    def use_attention_sinks(self, sinks: int, window: int) -> None:
        """StreamingLLM: every layer attends to the first ``sinks`` positions and the latest
        ``window``; a sequence may then outgrow the model's context with bounded KV.

        The paper numbers positions by place in the cache. Keys here stay rotated at their own
        positions, which the paged cache (shared prefixes, no re-writes) needs; the window is
        contiguous and ends at the query, so its distances are the cache-place ones already, and the
        sink keys (at places 0 .. sinks - 1, their own positions) are scored with the query rotated
        to the cache's last place instead of its own: the paper's scores, with no key re-rotated."""
        if any(layer.self_attn.window is not None for layer in self.model.layers):
            raise ValueError("attention_sinks: this model has a sliding window of its own; sinks are for "
                             "models that attend fully")
        if sinks < 1 or window < 1:
            raise ValueError(f"attention_sinks={sinks} with a window of {window}: both must be >= 1")
        for layer in self.model.layers:
            layer.self_attn.sinks, layer.self_attn.window = sinks, window
        self.rotary.any_position = True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fill every weight from checkpoint tensors (HF names); q/k/v and gate/up go into the fused
        projections by rows. Raises ValueError if a tensor is left unfilled or has the wrong shape."""
        # tied embeddings: some checkpoints still carry a copy of the output head
        cfg = self.config
        if rotary_dims(cfg.rope, cfg.head_dim) < cfg.head_dim:
            weights = _reorder_partial_rotary(weights, cfg)
        load_checkpoint(self, weights, skip=("lm_head.",) if self.lm_head is None else ())


_ROTATED = ("self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight", "self_attn.k_proj.bias",
            "self_attn.q_norm.weight", "self_attn.k_norm.weight")


def _reorder_partial_rotary(weights: Iterable[tuple[str, torch.Tensor]], cfg: ModelConfig):
    """Put q and k's rotating dims where the full-head rotary kernels pair them (layers/rotary.py)."""
    order = torch.tensor(partial_rotary_order(cfg.head_dim, rotary_dims(cfg.rope, cfg.head_dim)))
    for name, tensor in weights:
        if name.endswith(_ROTATED):
            rows = tensor.shape[0]
            index = (torch.arange(0, rows, cfg.head_dim)[:, None] + order[None, :]).reshape(-1)
            tensor = tensor[index] if isinstance(tensor, torch.Tensor) else tensor.take_rows(index.numpy())
        yield name, tensor
