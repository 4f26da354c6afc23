"""What a GGUF file's metadata says of each architecture, as the HF config.json keys kvserve reads.

llama.cpp's converter writes only part of a model's config: what llama.cpp's C++ hard-codes per
architecture is not in the file. Those values are taken here as llama.cpp takes them, and named:
- Gemma 2 / Gemma 3: every 2nd / 6th layer global (``sliding_window_pattern`` where a file has
  it); the attention scale from head_dim, or hidden / heads for the 27B models (no key holds
  ``query_pre_attn_scalar``); Gemma 3's local RoPE base 10000 unless ``rope.freq_base_swa`` says;
  the tanh-approximated GELU;
- SmolLM3: every 4th layer without RoPE (no key holds the interval);
- MoE: the top-k weights renormalised for Mixtral (``llama`` with experts) and Qwen3-MoE, not for
  Qwen2-MoE and OLMoE, unless ``expert_weights_norm`` says; experts in every layer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Field = Callable[..., Any]  # field(key, default=None): a metadata value

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                 "gemma3": "Gemma3ForCausalLM", "smollm3": "SmolLM3ForCausalLM",
                 "qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM"}
_MOE = {"qwen2moe", "qwen3moe", "olmoe"}
# llama.cpp's global-layer period and the layer count of the 27B models, which scale by hidden / heads
_GEMMA_PATTERN = {"gemma2": 2, "gemma3": 6}
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_GEMMA2_SOFTCAPS = (50.0, 30.0)  # llama.cpp's defaults for the attention and final caps
SMOLLM3_NO_ROPE_INTERVAL = 4


def architecture(arch: str, field: Field) -> str:
    """The HF architecture of a GGUF ``general.architecture`` (Mixtral is ``llama`` with experts)."""
    if arch == "llama" and int(field("llama.expert_count", 0) or 0) > 0:
        return "MixtralForCausalLM"
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {sorted(ARCHITECTURES)}")
    return ARCHITECTURES[arch]


def extra_config(arch: str, field: Field, cfg: dict[str, Any]) -> dict[str, Any]:
    """Config keys beyond the Llama ones that ``cfg`` already holds, for ``arch``'s file."""
    extra = rope_scaling(arch, field)
    if arch in _GEMMA_PATTERN:
        extra.update(gemma_config(arch, field, cfg))
    if arch == "smollm3":
        layers = cfg["num_hidden_layers"]
        extra["no_rope_layers"] = [int((i + 1) % SMOLLM3_NO_ROPE_INTERVAL != 0) for i in range(layers)]
    if arch in _MOE or cfg["architectures"] == ["MixtralForCausalLM"]:
        extra.update(moe_config(arch, field, cfg))
    return extra


def rope_scaling(arch: str, field: Field) -> dict[str, Any]:
    """Linear RoPE scaling (Gemma 3's global layers); other types are read per architecture (Phi-3)."""
    kind = field(f"{arch}.rope.scaling.type")
    if kind != "linear":
        return {}
    return {"rope_scaling": {"rope_type": "linear", "factor": float(field(f"{arch}.rope.scaling.factor", 1.0))}}


def gemma_config(arch: str, field: Field, cfg: dict[str, Any]) -> dict[str, Any]:
    layers, head_dim = cfg["num_hidden_layers"], cfg["head_dim"]
    window = field(f"{arch}.attention.sliding_window", 4096 if arch == "gemma2" else None)
    sliding = _sliding_layers(field(f"{arch}.attention.sliding_window_pattern", _GEMMA_PATTERN[arch]), layers)
    scalar = cfg["hidden_size"] // cfg["num_attention_heads"] if layers == _GEMMA_27B_LAYERS[arch] else head_dim
    extra: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": int(window) if window else None,
        "layer_types": ["sliding_attention" if s and window else "full_attention" for s in sliding],
        "query_pre_attn_scalar": scalar,
        "final_logit_softcapping": field(f"{arch}.final_logit_softcapping"),
    }
    if arch == "gemma2":
        extra["attn_logit_softcapping"] = field(f"{arch}.attn_logit_softcapping", _GEMMA2_SOFTCAPS[0])
        extra["final_logit_softcapping"] = field(f"{arch}.final_logit_softcapping", _GEMMA2_SOFTCAPS[1])
    else:
        extra["rope_local_base_freq"] = float(field(f"{arch}.rope.freq_base_swa", 10000.0))
    return extra


def _sliding_layers(pattern: int | list, layers: int) -> list[bool]:
    """Per layer, whether it slides: a per-layer list as written, or a period n in which layer i
    slides unless i % n == n - 1 (llama.cpp's rule; 0 or 1: none slides)."""
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise ValueError(f"GGUF sliding_window_pattern has {len(pattern)} entries for {layers} layers")
        return [bool(x) for x in pattern]
    n = int(pattern)
    return [n > 1 and i % n < n - 1 for i in range(layers)]


def moe_config(arch: str, field: Field, cfg: dict[str, Any]) -> dict[str, Any]:
    experts, used = int(field(f"{arch}.expert_count", 0)), int(field(f"{arch}.expert_used_count", 0))
    if arch == "llama":  # Mixtral: the experts' width is feed_forward_length
        return {"num_local_experts": experts, "num_experts_per_tok": used}
    extra: dict[str, Any] = {
        "num_experts": experts,
        "num_experts_per_tok": used,
        "norm_topk_prob": bool(field(f"{arch}.expert_weights_norm", arch == "qwen3moe")),
    }
    if arch == "olmoe":
        extra["clip_qkv"] = field(f"{arch}.attention.clamp_kqv")
    else:
        extra["moe_intermediate_size"] = int(field(f"{arch}.expert_feed_forward_length", cfg["intermediate_size"]))
        extra["shared_expert_intermediate_size"] = int(field(f"{arch}.expert_shared_feed_forward_length", 0))
    return extra
