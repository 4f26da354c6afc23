"""Configuration dataclasses, one per concern.

Every user-facing value is defined here, once: its name, default, help text and allowed values
(``option``); the CLI flags and ``LLM(...)`` keywords are made from these fields (``engine_options``).
Every value is checked here too, and a bad one raises ``ValueError`` naming the field, the value and
the allowed range, so the rest of the engine can trust its config.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
QUANTIZATIONS = ("none", "int8", "int4")
QUANT_GROUP_SIZES = (-1, 32, 64, 128)  # -1: one scale per output channel (int8 only)
ACTIVATION_QUANTIZATIONS = ("auto", "int8", "none")


def option(default: Any = None, help: str = "", *, name: str | None = None, choices: tuple | None = None,
           flag: str | None = None, parse: Callable[[str], Any] | None = None) -> Any:
    """A config field users set. ``name``: its flat option name (``LLM(name=...)``, ``--name``) where the
    field's own would be ambiguous; ``flag``: a CLI flag other than ``--name``; ``parse``: how the CLI
    reads the flag's text when it is not the field's own type (e.g. GiB for a byte count)."""
    meta = {"help": help, "name": name, "choices": choices, "flag": flag, "parse": parse}
    return field(default=default, metadata={"option": meta})


def _gib(text: str) -> int:
    return int(float(text) * 1024**3)


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """Map a dtype name ("float32", "bfloat16", "float16") to a torch dtype."""
    if isinstance(name, torch.dtype):
        return name
    if name not in _DTYPES:
        raise ValueError(f"dtype={name!r} is not supported; choose one of {sorted(_DTYPES)} or 'auto'")
    return _DTYPES[name]


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters, normalised from `rope_theta` or transformers-5 `rope_parameters`."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    # LongRoPE (Phi-3, Phi-4-mini): per-pair divisors of the frequencies within the original context
    # and beyond it, and the gain on cos/sin that goes with the stretched context.
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0
    rotary_fraction: float = 1.0  # partial_rotary_factor: the share of each head's dims that rotate
    # YaRN (gpt-oss, DeepSeek): pairs turning fewer than beta_slow times over the original context are
    # interpolated (divided by factor), more than beta_fast kept, a linear ramp between; ``truncate``
    # rounds the ramp's ends outwards to whole dims. The gain on cos/sin is ``attention_factor``;
    # DeepSeek's MLA also scales its softmax by mscale(factor, mscale_all_dim) squared (``softmax_mscale``).
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    mscale_all_dim: float = 0.0

    @property
    def softmax_mscale(self) -> float:
        """The factor DeepSeek's attention multiplies its softmax scale by (transformers' yarn_apply_mscale)."""
        if self.rope_type == "default" or not self.mscale_all_dim:
            return 1.0
        return _yarn_mscale(self.factor, self.mscale_all_dim) ** 2

    @staticmethod
    def from_hf(cfg: dict[str, Any], layer_type: str = "full_attention") -> RopeConfig:
        """``layer_type``: which entry of per-layer-type ``rope_parameters`` (Gemma 3) to read."""
        params = dict(cfg.get("rope_parameters") or {})
        if layer_type in params or "full_attention" in params:
            params = dict(params.get(layer_type) or {})
        scaling = cfg.get("rope_scaling") or {}
        params = {**scaling, **params}
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_type = str(params.get("rope_type", params.get("type", "default")) or "default")
        if rope_type == "su" or (rope_type == "yarn" and cfg.get("model_type") == "phi3"):
            rope_type = "longrope"  # Phi-3's earlier names for it, as transformers reads them
        original = int(params.get("original_max_position_embeddings",
                                  cfg.get("original_max_position_embeddings", 8192)))
        attention_factor = 1.0
        factor = params.get("factor")
        if rope_type == "longrope":
            attention_factor = _longrope_attention_factor(params, cfg, original)
        if rope_type == "yarn":
            if factor is None:  # transformers' rule: the stretch from the original context
                factor = int(cfg.get("max_position_embeddings", 4096)) / original
            attention_factor = _yarn_attention_factor(params, float(factor))
        return RopeConfig(
            theta=float(theta),
            rope_type=rope_type,
            factor=float(factor or 1.0),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position=original,
            short_factor=tuple(float(x) for x in params.get("short_factor") or ()),
            long_factor=tuple(float(x) for x in params.get("long_factor") or ()),
            attention_factor=attention_factor,
            rotary_fraction=float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            truncate=bool(params.get("truncate", True)),
            mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        )


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature: 0.1 * mscale * ln(factor) + 1, and 1 for no stretch."""
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_attention_factor(params: dict[str, Any], factor: float) -> float:
    """transformers' rule: the configured ``attention_factor``, else mscale(factor, mscale) /
    mscale(factor, mscale_all_dim) when both are given (DeepSeek), else mscale(factor)."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all_dim))
    return _yarn_mscale(factor)


def _longrope_attention_factor(params: dict[str, Any], cfg: dict[str, Any], original: int) -> float:
    """transformers' rule: the configured ``attention_factor``, else sqrt(1 + ln s / ln original) for
    the stretch s = ``factor`` (Phi-3: max_position_embeddings / original when absent)."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = params.get("factor")
    if factor is None:
        factor = int(cfg.get("max_position_embeddings", 4096)) / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


@dataclass(frozen=True)
class MoeConfig:
    """Mixture-of-experts MLPs (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3, gpt-oss), as transformers
    routes them (layers/moe.py ``route``). By ``scoring``:

    - "softmax": softmax over the router's logits in float32, the top ``experts_per_token`` (with
      ``num_groups`` > 1, DeepSeek-V2's "group_limited_greedy": only among the experts of the
      ``topk_groups`` groups whose best expert scores highest);
    - "sigmoid" (DeepSeek-V3's "noaux_tc"): sigmoid scores, experts chosen by score plus a learnt
      correction bias, groups ranked by the sum of their two best biased scores;
    - "topk_softmax" (gpt-oss): the top k logits first, then a softmax over those k alone.

    The weights are then renormalised to sum to 1 if ``renormalize`` (Mixtral always; the others by
    ``norm_topk_prob``) and multiplied by ``routed_scaling_factor``."""

    num_experts: int
    experts_per_token: int
    expert_intermediate_size: int
    renormalize: bool = False
    # Mixtral weighs the experts' outputs by the float32 routing weights; the others round them to
    # the model dtype first.
    float32_weights: bool = False
    shared_intermediate_size: int = 0  # a shared expert on every token (Qwen2-MoE, DeepSeek: n_shared_experts wide)
    shared_expert_gated: bool = True  # Qwen2-MoE scales it by sigmoid(x w); DeepSeek adds it as it is
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    scoring: str = "softmax"  # "softmax", "sigmoid" or "topk_softmax" (see above)
    float32_router: bool = False  # DeepSeek: transformers keeps the router's weight and logits in float32
    # Per layer: whether its MLP is the sparse block (Qwen-MoE's decoder_sparse_step / mlp_only_layers)
    sparse_layers: tuple[bool, ...] = ()
    router_bias: bool = False  # gpt-oss: the router's logits have a bias
    expert_bias: bool = False  # gpt-oss: the experts' gate/up and down projections have biases
    # The experts' activation: "silu" (SiLU(gate) * up) or "clamped_swiglu" (gpt-oss, layers/moe.py),
    # with its sigmoid gain ``swiglu_alpha`` and clamp ``swiglu_limit``.
    activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def is_sparse(self, layer: int) -> bool:
        return self.sparse_layers[layer] if self.sparse_layers else True

    def __post_init__(self) -> None:
        if self.scoring not in _MOE_SCORINGS:
            raise ValueError(f"MoE scoring={self.scoring!r} is not supported; supported: {', '.join(_MOE_SCORINGS)}")
        if self.num_experts % self.num_groups or not 1 <= self.topk_groups <= self.num_groups:
            raise ValueError(f"config.json: n_group={self.num_groups} must divide the {self.num_experts} experts "
                             f"and topk_group={self.topk_groups} must be in [1, n_group]")
        if self.experts_per_token > self.topk_groups * (self.num_experts // self.num_groups):
            raise ValueError(f"config.json: num_experts_per_tok={self.experts_per_token} exceeds the experts of "
                             f"topk_group={self.topk_groups} groups")

    @staticmethod
    def from_hf(cfg: dict[str, Any], arch: str, num_layers: int) -> MoeConfig | None:
        if arch in _DEEPSEEK_ARCHITECTURES:
            return MoeConfig._deepseek(cfg, arch, num_layers)
        if arch == "GptOssForCausalLM":
            return MoeConfig._gpt_oss(cfg)
        if arch not in _MOE_ARCHITECTURES:
            return None
        mixtral = arch == "MixtralForCausalLM"
        # Hub configs say num_local_experts (Mixtral) or num_experts; transformers 5 writes the former
        experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
        per_token = int(cfg.get("num_experts_per_tok") or 0)
        if experts < 1 or not 1 <= per_token <= experts:
            raise ValueError(f"config.json: {arch} needs 1 <= num_experts_per_tok ({per_token}) <= the number of "
                             f"experts ({experts})")
        qwen = arch.startswith("Qwen")
        inter = cfg.get("moe_intermediate_size" if qwen else "intermediate_size")
        if not inter:
            raise ValueError(f"config.json: {arch} needs {'moe_' if qwen else ''}intermediate_size, the experts' width")
        step = int(cfg.get("decoder_sparse_step") or 1) if qwen else 1
        dense = set(cfg.get("mlp_only_layers") or ()) if qwen else set()
        return MoeConfig(
            num_experts=experts,
            experts_per_token=per_token,
            expert_intermediate_size=int(inter),
            renormalize=mixtral or bool(cfg.get("norm_topk_prob", False)),
            float32_weights=mixtral,
            shared_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0)
            if arch == "Qwen2MoeForCausalLM" else 0,
            sparse_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers)),
        )

    @staticmethod
    def _deepseek(cfg: dict[str, Any], arch: str, num_layers: int) -> MoeConfig:
        """DeepSeek-V2/V3: ``n_routed_experts`` routed and ``n_shared_experts`` shared experts of
        ``moe_intermediate_size`` each; layers from ``first_k_dense_replace`` on, every
        ``moe_layer_freq``-th, are sparse. V2 routes by ``topk_method``; V3 always as "noaux_tc"
        (transformers' DeepSeek-V3 reads no topk_method). V2 with ``norm_topk_prob`` renormalises
        instead of scaling, as DeepSeek's own V2 code does (transformers' V2 ignores the flag; the
        released V2 configs all leave it false); V3 renormalises, then scales."""
        v3 = arch == "DeepseekV3ForCausalLM"
        method = "noaux_tc" if v3 else cfg.get("topk_method") or "greedy"
        if not v3 and method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"config.json: topk_method={method!r} is not supported for {arch}; supported: greedy, "
                             "group_limited_greedy")
        grouped = method != "greedy"
        inter = int(cfg["moe_intermediate_size"])
        renormalize = bool(cfg.get("norm_topk_prob", False)) and int(cfg["num_experts_per_tok"]) > 1
        scale = float(cfg.get("routed_scaling_factor") or 1.0)
        first, freq = int(cfg.get("first_k_dense_replace") or 0), int(cfg.get("moe_layer_freq") or 1)
        return MoeConfig(
            num_experts=int(cfg["n_routed_experts"]),
            experts_per_token=int(cfg["num_experts_per_tok"]),
            expert_intermediate_size=inter,
            renormalize=renormalize,
            float32_weights=True,  # transformers weighs the experts' outputs in float32
            shared_intermediate_size=inter * int(cfg.get("n_shared_experts") or 0),
            shared_expert_gated=False,
            num_groups=int(cfg.get("n_group") or 1) if grouped else 1,
            topk_groups=int(cfg.get("topk_group") or 1) if grouped else 1,
            routed_scaling_factor=1.0 if renormalize and not v3 else scale,
            scoring="sigmoid" if v3 else "softmax",
            float32_router=True,
            sparse_layers=tuple(i >= first and i % freq == 0 for i in range(num_layers)),
        )

    @staticmethod
    def _gpt_oss(cfg: dict[str, Any]) -> MoeConfig:
        experts, per_token = int(cfg.get("num_local_experts") or 0), int(cfg.get("num_experts_per_tok") or 0)
        if experts < 1 or not 1 <= per_token <= experts:
            raise ValueError(f"config.json: GptOssForCausalLM needs 1 <= num_experts_per_tok ({per_token}) <= "
                             f"num_local_experts ({experts})")
        return MoeConfig(
            num_experts=experts, experts_per_token=per_token,
            expert_intermediate_size=int(cfg["intermediate_size"]),
            scoring="topk_softmax", router_bias=True, expert_bias=True, activation="clamped_swiglu",
            # transformers' defaults, for configs that leave them out (the released ones omit alpha)
            swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)), swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
        )


_MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM")
_DEEPSEEK_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
_MOE_SCORINGS = ("softmax", "sigmoid", "topk_softmax")


@dataclass(frozen=True)
class MlaConfig:
    """Multi-head latent attention (DeepSeek-V2): keys and values of every head are rebuilt from one
    ``kv_lora_rank`` latent per token, plus a ``qk_rope_head_dim`` rotary key shared by the heads;
    queries come through a ``q_lora_rank`` bottleneck, or straight from the hidden state (None)."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rope_interleaved: bool = True  # the checkpoint pairs rotary dims (2i, 2i + 1); V3's rope_interleave

    @property
    def latent_width(self) -> int:
        """Values one token stores per layer: the latent and the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @staticmethod
    def from_hf(cfg: dict[str, Any]) -> MlaConfig | None:
        if not cfg.get("kv_lora_rank"):
            return None
        q_rank = cfg.get("q_lora_rank")
        return MlaConfig(int(cfg["kv_lora_rank"]), int(cfg["qk_rope_head_dim"]), int(cfg["qk_nope_head_dim"]),
                         int(cfg["v_head_dim"]), int(q_rank) if q_rank else None,
                         rope_interleaved=bool(cfg.get("rope_interleave", True)))




@dataclass(frozen=True)
class ModelConfig:
    """The shape of a decoder-only transformer, read from an HF `config.json` (or GGUF metadata)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None
    # Per layer: the sliding window it attends over, or None for full attention (see layer_windows).
    layer_windows: tuple[int | None, ...] = ()
    hidden_act: str = "silu"  # the gated MLP's activation (Gemma: gelu_pytorch_tanh)
    query_pre_attn_scalar: float | None = None  # Gemma: attention scale = this ** -0.5 instead of head_dim's
    attn_logit_softcap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_logit_softcap: float | None = None  # Gemma 2: logits -> cap * tanh(logits / cap)
    local_rope: RopeConfig | None = None  # Gemma 3: the sliding-window layers' own RoPE (another base)
    # SmolLM3: per layer, whether it rotates q and k (0 in ``no_rope_layers``: a NoPE layer); () = all do
    rope_layers: tuple[bool, ...] = ()
    moe: MoeConfig | None = None  # the experts of a mixture-of-experts model, None for a dense one
    clip_qkv: float | None = None  # OLMoE: q, k and v clamped to [-clip, clip] after projection
    mla: MlaConfig | None = None  # DeepSeek-V2's latent attention; head_dim is then its rotary key's

    def uses_rope(self, layer: int) -> bool:
        return self.rope_layers[layer] if self.rope_layers else True

    def window_of(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def all_layers_windowed(self) -> int | None:
        """The window when every layer slides over the same one (then old KV blocks can be freed), else None."""
        windows = set(self.layer_windows)
        return windows.pop() if len(windows) == 1 and None not in windows else None

    @staticmethod
    def from_hf(cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry; cannot pick a model class")
        arch = archs[0]
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        use_sw = cfg.get("use_sliding_window", cfg.get("sliding_window") is not None)
        # Qwen2-MoE names the q/k/v bias qkv_bias
        bias = cfg["qkv_bias"] if cfg.get("qkv_bias") is not None else cfg.get("attention_bias", arch.startswith("Qwen2"))
        mla = MlaConfig.from_hf(cfg)
        return ModelConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            # MLA rotates only the decoupled key: transformers makes head_dim that width too
            head_dim=int(mla.qk_rope_head_dim if mla else cfg.get("head_dim") or hidden // num_heads),
            max_position=int(cfg.get("max_position_embeddings", 4096)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_hf(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(bias),
            qk_norm=arch.startswith(("Qwen3", "Gemma3")),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=cfg.get("sliding_window") if use_sw else None,
            layer_windows=layer_windows(cfg, int(cfg["num_hidden_layers"])),
            hidden_act=str(cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"),
            query_pre_attn_scalar=_optional_float(cfg.get("query_pre_attn_scalar")),
            attn_logit_softcap=_optional_float(cfg.get("attn_logit_softcapping")),
            final_logit_softcap=_optional_float(cfg.get("final_logit_softcapping")),
            local_rope=_local_rope(cfg),
            rope_layers=tuple(bool(x) for x in cfg.get("no_rope_layers") or ()),
            moe=MoeConfig.from_hf(cfg, arch, int(cfg["num_hidden_layers"])),
            clip_qkv=_optional_float(cfg.get("clip_qkv")),
            mla=mla,
        )


def _local_rope(cfg: dict[str, Any]) -> RopeConfig | None:
    """Gemma 3's RoPE of its local layers: per layer type in ``rope_parameters`` (transformers 5) or
    ``rope_local_base_freq`` (earlier configs, default scaling)."""
    if "sliding_attention" in (cfg.get("rope_parameters") or {}):
        return RopeConfig.from_hf(cfg, "sliding_attention")
    if cfg.get("rope_local_base_freq") is not None:
        return RopeConfig(theta=float(cfg["rope_local_base_freq"]))
    return None


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def layer_windows(cfg: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention), following transformers' rules per config
    style; the engine and the capacity planner both read windows through this."""
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if types:
        if len(types) != num_layers:
            raise ValueError(f"config.json: layer_types has {len(types)} entries for {num_layers} layers")
        return tuple(int(window) if t == "sliding_attention" and window else None for t in types)
    if not window or cfg.get("use_sliding_window") is False:
        return (None,) * num_layers
    if cfg.get("use_sliding_window") and "max_window_layers" in cfg:
        # Qwen2 style: layers at index >= max_window_layers slide, the first ones attend fully.
        first = min(int(cfg["max_window_layers"]), num_layers)
        return (None,) * first + (int(window),) * (num_layers - first)
    if cfg.get("sliding_window_pattern"):
        # Gemma 3 style: every pattern-th layer is global.
        pattern = int(cfg["sliding_window_pattern"])
        return tuple(None if (i + 1) % pattern == 0 else int(window) for i in range(num_layers))
    return (int(window),) * num_layers  # Mistral v0.1 style: every layer slides.


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: block size and how many blocks (or how many bytes) to preallocate."""

    block_size: int = option(16, "tokens per KV-cache block")
    num_kv_blocks: int | None = option(None, "KV blocks to preallocate (default: as many as the KV-cache budget holds); "
                                      "a hybrid model's block holds one KV group's layers")
    kv_cache_memory_bytes: int = option(1024**3, "KV-cache budget in GiB (default 1)", flag="--kv-cache-memory",
                                        parse=_gib)
    enable_prefix_caching: bool = option(True, "reuse the KV of full blocks shared with earlier requests",
                                         flag="--prefix-caching")
    # one byte per value plus a float16 scale per token and head: about half a bf16 cache's bytes per token
    kv_cache_dtype: str = option("auto", "KV cache values: auto = the model dtype; int8, or fp8 (e4m3), with a "
                                 "scale per token and head (model/attention/kv_quant.py)", choices=KV_CACHE_DTYPES)
    attention_sinks: int = option(0, "StreamingLLM: keep the KV of the first N tokens and of the latest "
                                  "max_model_len - N, so a sequence outgrows max_model_len with bounded KV "
                                  "(models without a sliding window; 0: off)")

    def __post_init__(self) -> None:
        if self.attention_sinks < 0:
            raise ValueError(f"attention_sinks={self.attention_sinks} must be >= 0")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} must be one of {list(KV_CACHE_DTYPES)}")
        if self.block_size < 1 or self.block_size > 1024:
            raise ValueError(f"block_size={self.block_size} must be in [1, 1024]")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks={self.num_kv_blocks} must be >= 1 (or None to size from memory)")
        if self.kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes={self.kv_cache_memory_bytes} must be > 0")


@dataclass(frozen=True)
class QuantConfig:
    """Weight quantization (kvserve/model/quant/). ``quantization``:

    None (unset): keep a GGUF file's own block quantization (Q4_0/Q4_1/Q4_K as int4, Q8_0/Q5/Q6_K as
    int8 kernels); float checkpoints stay in the engine dtype.
    "none": everything dense in the engine dtype (GGUF blocks dequantized at load).
    "int8": weight-only int8, a scale per ``group_size`` inputs (default 32; -1 = per output channel).
    "int4": weight-only int4 with zero points per ``group_size`` inputs (default 32; see quant/plan.py).
    Both round to nearest at load.

    ``activation_quantization``: how the CPU's int4 / int8 linears take x in decode steps (a few rows:
    decode, speculative verification, small batches; on AVX2 every batch). "int8": x is quantized
    to int8 per 32 inputs (step amax / 127) and multiplied with the weights' bytes in integer SIMD
    (AVX512-VNNI, or AVX2's vpmaddubsw); "none": each weight is dequantized to float and x stays as
    it is, exact to float rounding. "auto": int8, except in a float32 run by choice: ``dtype="float32"``
    asked for (what quality comparisons run in), or a float32 checkpoint under dtype "auto". Where
    dtype "auto" picks float32 only because the CPU lacks bf16 (a 16-bit or GGUF checkpoint on an
    AVX2 CPU), x is quantized: that run wants the fast path. ``int8_activations`` resolves it.
    """

    quantization: str | None = option(None, "weights: unset keeps a GGUF file's own 4/8-bit blocks; none = dense "
                                      "in the engine dtype; int8 / int4 quantized at load", choices=QUANTIZATIONS)
    group_size: int | None = option(None, "inputs per scale for int8/int4 (default 32); -1 = one scale per output "
                                    "channel (int8)", name="quantization_group_size", choices=QUANT_GROUP_SIZES)
    activation_quantization: str = option("auto", "int4/int8 linears on the CPU, few rows of x (decode): int8 = x "
                                          "quantized to int8 per 32 inputs and multiplied in integers (fast); none "
                                          "= x kept float, weights dequantized (exact); auto = int8 unless the run "
                                          "is float32 by choice (--dtype float32, or a float32 checkpoint)",
                                          choices=ACTIVATION_QUANTIZATIONS)

    def __post_init__(self) -> None:
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization={self.quantization!r} is not supported; choose one of "
                             f"{list(QUANTIZATIONS)} or leave it unset to keep the checkpoint's own format")
        if self.group_size is not None and self.group_size not in QUANT_GROUP_SIZES:
            raise ValueError(f"quantization_group_size={self.group_size} must be one of {list(QUANT_GROUP_SIZES)}")
        if self.group_size is not None and self.quantization not in ("int8", "int4"):
            raise ValueError(f"quantization_group_size={self.group_size} needs quantization='int8' or 'int4'")
        if self.group_size == -1 and self.quantization != "int8":
            raise ValueError("quantization_group_size=-1 (one scale per output channel) is for quantization='int8'")
        if self.activation_quantization not in ACTIVATION_QUANTIZATIONS:
            raise ValueError(f"activation_quantization={self.activation_quantization!r} must be one of "
                             f"{list(ACTIVATION_QUANTIZATIONS)}")

    def int8_activations(self, float32_by_choice: bool) -> bool:
        """Whether quantized linears take int8 x (``activation_quantization`` resolved);
        ``float32_by_choice``: the run is float32 because the user or the checkpoint asked for it."""
        if self.activation_quantization == "auto":
            return not float32_by_choice
        return self.activation_quantization == "int8"


SCHEDULING_POLICIES = ("fcfs", "shortest-first")
CUDA_TOKEN_BUDGET = 8192  # max_num_batched_tokens on CUDA unless given (SchedulerConfig's docstring)


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits: requests per step and tokens per step (the token budget).

    ``policy``: which waiting request is admitted next, within a priority. "shortest-first" (the
    default): the one with the fewest tokens left to compute (prompt minus cached prefix), so a
    burst's short prompts get their first token without queueing behind long ones; a request passed
    over by four steps' token budget of later arrivals goes next, so long prompts wait a bounded time
    (scheduler/policies.py). "fcfs": arrival order (preferring a cached prefix among the next few).

    ``max_num_batched_tokens``: 1024 by default on the CPU, where a step's time grows with its tokens:
    a burst's prompts then come out in steps of about a quarter second on two cores, and running
    requests stall half as long as at 2048 for the same throughput. On CUDA ``engine_config`` makes it
    ``CUDA_TOKEN_BUDGET`` unless given, since an eager GPU step is mostly kernel launches.
    """

    max_num_seqs: int = option(64, "requests running at once")
    max_num_batched_tokens: int = option(1024, f"tokens per step (default 1024 on the CPU, {CUDA_TOKEN_BUDGET} on "
                                         "CUDA)")
    max_model_len: int | None = option(None, "longest prompt + output in tokens (default: the model's context)")
    policy: str = option("shortest-first", "admission order within a priority: fewest tokens to compute first "
                         "(shortest-first: lower time to first token under bursts, bounded wait for long prompts), "
                         "or arrival order (fcfs)", name="scheduling_policy", choices=SCHEDULING_POLICIES)

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= 1")
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy={self.policy!r} must be one of {list(SCHEDULING_POLICIES)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len={self.max_model_len} must be >= 1")


SPECULATIVE_METHODS = ("ngram", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: a proposer guesses up to ``num_speculative_tokens`` tokens per request and
    one target forward pass verifies them all. ``max_batch_size``: speculate only while at most this
    many requests are decoding, since at large batches decode is no longer memory-bound."""

    method: str | None = option(None, "speculative decoding: off (unset), ngram (prompt lookup) or draft (a "
                                "smaller model)", name="speculative_method", choices=SPECULATIVE_METHODS)
    num_speculative_tokens: int = option(7, "most tokens proposed per request and step (each request's k "
                                         "follows its acceptance)")
    verify_token_cost: float = option(0.25, "cost of verifying one more token, in decode steps (CPU ~0.25, a "
                                      "GPU far less): with the acceptance it sets each request's k",
                                      name="speculative_verify_token_cost")
    model: str | None = option(None, "draft model (same tokenizer) for --speculative-method draft",
                               name="speculative_model")
    ngram_min: int = option(1, "shortest n-gram matched", name="speculative_ngram_min")
    ngram_max: int = option(4, "longest n-gram matched", name="speculative_ngram_max")
    max_batch_size: int = option(8, "speculate only while at most this many requests are decoding",
                                 name="speculative_max_batch_size")

    def __post_init__(self) -> None:
        if self.method is not None and self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_method={self.method!r} must be None, 'ngram' or 'draft'")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens={self.num_speculative_tokens} must be in [1, 16]")
        if self.method == "draft" and not self.model:
            raise ValueError("speculative_method='draft' needs speculative_model (a smaller model, same tokenizer)")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"ngram window [{self.ngram_min}, {self.ngram_max}] must satisfy 1 <= min <= max")
        if self.max_batch_size < 1:
            raise ValueError(f"speculative max_batch_size={self.max_batch_size} must be >= 1")
        if not 0 <= self.verify_token_cost <= 1:
            raise ValueError(f"speculative verify_token_cost={self.verify_token_cost} must be in [0, 1]")


ATTENTION_BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs; built by `LLM` or the server from user options."""

    model: str | None = option(None, "HF model folder or .gguf file (default: the bundled SmolLM2-135M-Instruct)")
    # EngineCore replaces "auto" with the name it resolves to before anything reads torch_dtype.
    dtype: str = option("auto", "auto: bfloat16 for a 16-bit or GGUF checkpoint where the device computes it "
                        "natively, else float32 (model/loader.py auto_dtype)", choices=("auto", *_DTYPES))
    seed: int = option(0, "seed of the sampler's shared random stream")
    device: str = option("cpu", "cpu, cuda or cuda:N")
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    attention_backend: str = option("auto", "auto: C++ kernels on the CPU, Triton on CUDA; torch: the PyTorch "
                                    "reference path; triton: the Triton kernels (on the CPU under TRITON_INTERPRET=1)",
                                    choices=ATTENTION_BACKENDS)
    enforce_eager: bool = option(False, "CUDA: run decode steps eagerly instead of replaying CUDA graphs")
    async_scheduling: bool | None = option(None, "schedule and prepare step N+1 while the device runs step N, "
                                           "reading sampled tokens one step late (engine/core.py); default: on "
                                           "for CUDA, off on the CPU, where the forward pass is synchronous and "
                                           "it measured no faster (benchmarks/async_scheduling.py)")
    num_threads: int | None = option(None, "torch threads for this process (default: $KVSERVE_NUM_THREADS, else "
                                     "every available core; runtime/threads.py)")
    tensor_parallel_size: int = option(1, "processes that split the model's heads and MLP between them "
                                       "(Megatron-style tensor parallelism, worker/tensor_parallel.py): gloo on "
                                       "the CPU, NCCL on CUDA (one GPU per rank)")
    chat_template: str | None = option(None, "Jinja chat template for chat requests instead of the model's own "
                                       "(or for a model without one): a file holding it, or the template itself")
    weight_cache_gb: float = option(4.0, "keep the weights as converted at load (GGUF blocks repacked, or "
                                    "quantized at load) under $KVSERVE_CACHE_DIR, up to this many GiB in all (least "
                                    "recently used out first), and read them back on a later start; 0: convert "
                                    "every time (model/weight_cache.py)")

    def __post_init__(self) -> None:
        if self.dtype != "auto":
            parse_dtype(self.dtype)
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device={self.device!r} must be 'cpu' or 'cuda[:N]'")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend={self.attention_backend!r} must be one of {ATTENTION_BACKENDS}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads={self.num_threads} must be >= 1")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} must be >= 1")
        if not self.weight_cache_gb >= 0:
            raise ValueError(f"weight_cache_gb={self.weight_cache_gb} must be >= 0")
        if self.chat_template is not None and (not isinstance(self.chat_template, str) or not self.chat_template.strip()):
            raise ValueError("chat_template must be a file holding a Jinja template, or the template itself")
        if self.async_scheduling and self.tensor_parallel_size > 1:
            raise ValueError("async_scheduling does not combine with tensor_parallel_size > 1 yet")

    @property
    def overlap_steps(self) -> bool:
        """Whether the engine schedules a step while the previous one runs (``async_scheduling``
        resolved: unset means on for CUDA, off on the CPU)."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        return self.device.startswith("cuda") and self.tensor_parallel_size == 1

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            raise RuntimeError("dtype='auto' is resolved when the engine loads the model (EngineCore)")
        return parse_dtype(self.dtype)


_SECTIONS = {"cache": CacheConfig, "scheduler": SchedulerConfig, "speculative": SpeculativeConfig, "quant": QuantConfig}


@dataclass(frozen=True)
class Option:
    """One user option, read off its config field: ``LLM(name=...)`` and the CLI flag ``flag``."""

    name: str
    section: str | None  # the EngineConfig section holding the field, None for EngineConfig's own
    field: str
    default: Any
    kind: str  # the field's type: "int", "float", "str" or "bool"
    help: str
    choices: tuple | None
    flag: str
    parse: Callable[[str], Any] | None


@functools.cache
def engine_options() -> tuple[Option, ...]:
    """Every option of EngineConfig and its sections, in definition order."""
    out = []
    for section, cls in [(None, EngineConfig), *_SECTIONS.items()]:
        for f in dataclasses.fields(cls):
            meta = f.metadata.get("option")
            if meta is None:
                continue
            name = meta["name"] or f.name
            kind = next(t.strip() for t in str(f.type).split("|") if t.strip() != "None")
            out.append(Option(name, section, f.name, f.default, kind, meta["help"], meta["choices"],
                              meta["flag"] or "--" + name.replace("_", "-"), meta["parse"]))
    return tuple(out)


def engine_config(**options: Any) -> EngineConfig:
    """The EngineConfig for flat options (``engine_options``): what ``LLM(...)`` and the CLI build.

    Unknown names raise ValueError listing the known ones; each value is checked by its section.
    """
    known = {o.name: o for o in engine_options()}
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"unknown engine option(s) {unknown}; known: {sorted(known)}")
    if options.get("max_num_batched_tokens") is None:  # the device's default token budget
        options["max_num_batched_tokens"] = (CUDA_TOKEN_BUDGET if str(options.get("device", "cpu")).startswith("cuda")
                                             else SchedulerConfig.max_num_batched_tokens)
    own: dict[str, Any] = {}
    sections: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
    for name, value in options.items():
        o = known[name]
        (own if o.section is None else sections[o.section])[o.field] = value
    return EngineConfig(**own, **{name: cls(**sections[name]) for name, cls in _SECTIONS.items()})
