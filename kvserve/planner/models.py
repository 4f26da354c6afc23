"""Well-known model configs shipped as data, and how `kvserve plan MODEL` turns MODEL into a config.

The table holds the fields of each model's HF ``config.json`` that sizing needs, copied from the
published configs, so a plan for a popular model works offline and without downloading weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_LLAMA = {"architectures": ["LlamaForCausalLM"], "rms_norm_eps": 1e-5, "tie_word_embeddings": False}

MODEL_TABLE: dict[str, dict[str, Any]] = {
    "SmolLM2-135M": {
        **_LLAMA, "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
        "max_position_embeddings": 8192, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    },
    "Llama-3.1-8B": {
        **_LLAMA, "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "max_position_embeddings": 131072, "torch_dtype": "bfloat16",
    },
    "Llama-3.1-70B": {
        **_LLAMA, "vocab_size": 128256, "hidden_size": 8192, "intermediate_size": 28672,
        "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
        "max_position_embeddings": 131072, "torch_dtype": "bfloat16",
    },
    "Mistral-7B-v0.1": {
        "architectures": ["MistralForCausalLM"], "vocab_size": 32000, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "max_position_embeddings": 32768, "sliding_window": 4096,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
    "Qwen2.5-7B": {
        "architectures": ["Qwen2ForCausalLM"], "vocab_size": 152064, "hidden_size": 3584,
        "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
        "num_key_value_heads": 4, "max_position_embeddings": 131072, "sliding_window": 131072,
        "use_sliding_window": False, "max_window_layers": 28, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
    "Mixtral-8x7B-v0.1": {
        "architectures": ["MixtralForCausalLM"], "vocab_size": 32000, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
        "max_position_embeddings": 32768, "rope_theta": 1000000.0, "sliding_window": None,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
    "Qwen3-30B-A3B": {
        "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936, "hidden_size": 2048,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
        "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
    "DeepSeek-V3": {
        "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 129280, "hidden_size": 7168,
        "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
        "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
        "first_k_dense_replace": 3, "topk_method": "noaux_tc", "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
}

DEFAULT_MODEL = "SmolLM2-135M"
_ALIASES = {"default": DEFAULT_MODEL, "smollm2-135m-instruct": DEFAULT_MODEL,
            "mistral-7b": "Mistral-7B-v0.1", "deepseek-v3-base": "DeepSeek-V3"}


def known_models() -> list[str]:
    return sorted(MODEL_TABLE)


def resolve_model(spec: str) -> tuple[str, dict[str, Any]]:
    """(display name, HF-style config) for a table name, a model folder or a .gguf file."""
    path = Path(spec)
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
        return path.name, load_config(path)
    name = _table_name(spec)
    if name is None:
        raise ValueError(f"model={spec!r} is neither a folder with config.json, a .gguf file, nor a known "
                         f"model; known models: {', '.join(known_models())} (or 'default')")
    return name, dict(MODEL_TABLE[name])


def _table_name(spec: str) -> str | None:
    key = spec.split("/")[-1].lower()
    key = _ALIASES.get(key, key)
    return next((n for n in MODEL_TABLE if n.lower() == key.lower()), None)


def load_config(path: Path) -> dict[str, Any]:
    """Read config.json from a folder, or GGUF metadata through the engine's own loader.

    Using the engine's reader for GGUF means the planner sizes exactly the shape the engine builds.
    """
    if path.is_dir():
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ValueError(f"model folder {str(path)!r} has no config.json")
        return json.loads(cfg_file.read_text())
    from kvserve.model.loader import load_hf_config  # imports torch: only when a GGUF file is planned

    return load_hf_config(path)
