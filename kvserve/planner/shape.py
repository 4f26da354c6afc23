"""The parts of a model's shape that memory and speed depend on, read from an HF-style config dict.

Kept separate from the engine's ``ModelConfig`` because the planner also sizes models the engine
cannot run (MLA, mixture of experts, mixed sliding/full attention): it needs their shapes, not
their layers. Parameters are listed as groups of identical matrices so that quantization schemes
with per-row or per-group scales can be costed exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvserve.config import MoeConfig, layer_windows


@dataclass(frozen=True)
class MlaShape:
    """Multi-head latent attention (DeepSeek-V2/V3): K and V are rebuilt from one cached latent."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None


@dataclass(frozen=True)
class MoeShape:
    """Mixture of experts: every expert is held in memory, only ``experts_per_token`` run per token."""

    num_experts: int
    experts_per_token: int
    expert_intermediate_size: int
    shared_intermediate_size: int
    num_moe_layers: int
    router_bias: bool
    shared_gate: bool = False  # Qwen2-MoE: the shared expert is scaled by sigmoid(x w), w one row


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer as far as memory and FLOPs are concerned."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    qk_norm_full: bool = False  # OLMoE: the q/k norms span the whole projection, not one head
    sliding_window: int | None = None
    num_sliding_layers: int = 0
    mla: MlaShape | None = None
    moe: MoeShape | None = None

    @property
    def attention_kind(self) -> str:
        """MLA, MHA (one KV head per query head), MQA (one KV head) or GQA (in between)."""
        if self.mla is not None:
            return "MLA"
        if self.num_kv_heads == self.num_heads:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else "GQA"

    @staticmethod
    def from_hf(cfg: dict[str, Any], name: str = "model") -> ModelShape:
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        layers = int(cfg["num_hidden_layers"])
        window, num_sliding = _sliding_layers(cfg, layers)
        archs = cfg.get("architectures") or [""]
        return ModelShape(
            name=name,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg.get("intermediate_size") or 4 * hidden),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            max_position=int(cfg.get("max_position_embeddings") or 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", False)) or archs[0].startswith("Qwen2"),
            qk_norm=archs[0].startswith("Qwen3") or archs[0] == "OlmoeForCausalLM",
            qk_norm_full=archs[0] == "OlmoeForCausalLM",
            sliding_window=window,
            num_sliding_layers=num_sliding,
            mla=_mla(cfg),
            moe=_moe(cfg, layers),
        )


def _sliding_layers(cfg: dict[str, Any], num_layers: int) -> tuple[int | None, int]:
    """(window, how many layers use it): the engine's own per-layer rule (config.layer_windows)."""
    windows = [w for w in layer_windows(cfg, num_layers) if w is not None]
    return (windows[0], len(windows)) if windows else (None, 0)


def _mla(cfg: dict[str, Any]) -> MlaShape | None:
    if not cfg.get("kv_lora_rank"):
        return None
    q_rank = cfg.get("q_lora_rank")
    return MlaShape(
        kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
        qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
        v_head_dim=int(cfg["v_head_dim"]),
        q_lora_rank=int(q_rank) if q_rank else None,
    )


def _moe(cfg: dict[str, Any], num_layers: int) -> MoeShape | None:
    """DeepSeek (n_routed_experts), Mixtral (num_local_experts) and Qwen-MoE (num_experts) styles.

    The families the engine runs are read through its own ``MoeConfig`` (which layers are sparse,
    the experts' width), so the planner sizes what the engine builds."""
    arch = (cfg.get("architectures") or [""])[0]
    engine = MoeConfig.from_hf(cfg, arch, num_layers)
    if engine is not None:
        return MoeShape(
            num_experts=engine.num_experts,
            experts_per_token=engine.experts_per_token,
            expert_intermediate_size=engine.expert_intermediate_size,
            shared_intermediate_size=engine.shared_intermediate_size,
            num_moe_layers=sum(engine.is_sparse(i) for i in range(num_layers)),
            # E values a layer: gpt-oss's bias on the logits, DeepSeek-V3's bias on the choice
            router_bias=engine.router_bias or engine.scoring == "sigmoid",
            shared_gate=engine.shared_intermediate_size > 0 and engine.shared_expert_gated,
        )
    experts = cfg.get("n_routed_experts") or cfg.get("num_local_experts") or cfg.get("num_experts")
    if not experts:
        return None
    expert_inter = int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
    shared = int(cfg.get("n_shared_experts") or 0) * expert_inter
    shared = int(cfg.get("shared_expert_intermediate_size") or shared)
    first_dense = int(cfg.get("first_k_dense_replace") or 0)
    return MoeShape(
        num_experts=int(experts),
        experts_per_token=int(cfg["num_experts_per_tok"]),
        expert_intermediate_size=expert_inter,
        shared_intermediate_size=shared,
        num_moe_layers=num_layers - first_dense,
        router_bias=cfg.get("topk_method") == "noaux_tc",
    )


@dataclass(frozen=True)
class Matrix:
    """``count`` identical linear weights of ``rows`` outputs by ``cols`` inputs."""

    name: str
    rows: int
    cols: int
    count: int
    routed: bool = False  # a routed expert: only experts_per_token / num_experts of these run per token

    @property
    def params(self) -> int:
        return self.rows * self.cols * self.count


@dataclass(frozen=True)
class Inventory:
    """Every parameter of the model, grouped the way quantization and FLOP counting need them."""

    matrices: tuple[Matrix, ...]
    embedding: Matrix  # vocab rows of hidden values
    lm_head: Matrix  # count 0 when tied: the output projection reuses the embedding table
    vector_params: int  # norms and biases: small, never quantized
    active_expert_fraction: float  # experts_per_token / num_experts, 1.0 for dense models

    @property
    def linear_params(self) -> int:
        return sum(m.params for m in self.matrices)

    @property
    def total_params(self) -> int:
        return self.linear_params + self.embedding.params + self.lm_head.params + self.vector_params

    @property
    def active_params(self) -> int:
        """Parameters one token touches: routed experts scaled by the share that runs."""
        routed = sum(m.params for m in self.matrices if m.routed)
        return self.total_params - round(routed * (1 - self.active_expert_fraction))


def inventory(shape: ModelShape) -> Inventory:
    """List the model's parameters: embeddings, attention (incl. GQA/MLA), MLP or experts, norms."""
    attn, attn_vectors = _attention_matrices(shape)
    mlp, mlp_vectors = _mlp_matrices(shape)
    embed = Matrix("embed_tokens", shape.vocab_size, shape.hidden_size, 1)
    head = Matrix("lm_head", shape.vocab_size, shape.hidden_size, 0 if shape.tie_word_embeddings else 1)
    norms = shape.num_layers * 2 * shape.hidden_size + shape.hidden_size
    fraction = shape.moe.experts_per_token / shape.moe.num_experts if shape.moe else 1.0
    return Inventory(
        matrices=attn + mlp,
        embedding=embed,
        lm_head=head,
        vector_params=norms + attn_vectors + mlp_vectors,
        active_expert_fraction=fraction,
    )


def _attention_matrices(s: ModelShape) -> tuple[tuple[Matrix, ...], int]:
    """Attention projections per layer (times num_layers) and the bias/norm vectors they carry."""
    n, h = s.num_layers, s.hidden_size
    if s.mla is not None:
        return _mla_matrices(s)
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    mats = (Matrix("q_proj", q, h, n), Matrix("k_proj", kv, h, n), Matrix("v_proj", kv, h, n),
            Matrix("o_proj", h, q, n))
    norm_width = q + kv if s.qk_norm_full else 2 * s.head_dim
    vectors = n * (q + 2 * kv) * s.qkv_bias + n * norm_width * s.qk_norm
    return mats, vectors


def _mla_matrices(s: ModelShape) -> tuple[tuple[Matrix, ...], int]:
    """DeepSeek MLA: low-rank Q, one shared KV latent plus a rotary key, then per-head K/V up-projections."""
    m, n, h, heads = s.mla, s.num_layers, s.hidden_size, s.num_heads
    qk_dim = m.qk_nope_head_dim + m.qk_rope_head_dim
    if m.q_lora_rank:
        q = (Matrix("q_a_proj", m.q_lora_rank, h, n), Matrix("q_b_proj", heads * qk_dim, m.q_lora_rank, n))
    else:
        q = (Matrix("q_proj", heads * qk_dim, h, n),)
    kv = (Matrix("kv_a_proj_with_mqa", m.kv_lora_rank + m.qk_rope_head_dim, h, n),
          Matrix("kv_b_proj", heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank, n),
          Matrix("o_proj", h, heads * m.v_head_dim, n))
    return q + kv, n * (m.kv_lora_rank + (m.q_lora_rank or 0))


def _mlp_matrices(s: ModelShape) -> tuple[tuple[Matrix, ...], int]:
    """Gated MLP (gate, up, down) on dense layers; router, routed and shared experts on MoE layers."""
    h, moe = s.hidden_size, s.moe
    dense_layers = s.num_layers - (moe.num_moe_layers if moe else 0)
    mats = _gated_mlp("mlp", h, s.intermediate_size, dense_layers) if dense_layers else ()
    if moe is None:
        return mats, 0
    n = moe.num_moe_layers
    mats += (Matrix("router", moe.num_experts, h, n),)
    mats += _gated_mlp("expert", h, moe.expert_intermediate_size, n * moe.num_experts, routed=True)
    if moe.shared_intermediate_size:
        mats += _gated_mlp("shared_expert", h, moe.shared_intermediate_size, n)
    if moe.shared_gate:
        mats += (Matrix("shared_expert_gate", 1, h, n),)
    return mats, n * moe.num_experts * moe.router_bias


def _gated_mlp(name: str, hidden: int, inter: int, count: int, routed: bool = False) -> tuple[Matrix, ...]:
    return (Matrix(f"{name}.gate_proj", inter, hidden, count, routed),
            Matrix(f"{name}.up_proj", inter, hidden, count, routed),
            Matrix(f"{name}.down_proj", hidden, inter, count, routed))
