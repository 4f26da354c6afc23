"""Tiny HF folders written as GGUF files the way llama.cpp's convert_hf_to_gguf.py lays them out, and
the engine run on them, for the GGUF model tests (test_phi3_gguf.py, test_gemma_gguf.py, test_moe_gguf.py).

Tensor names come from the `gguf` package's own name map; what the converter changes on the way is
redone here: Q/K rows permuted for the Llama-style RoPE (llama, smollm3), Gemma's norm weights
stored as 1 + w, each layer's experts stacked into one [experts, rows, cols] tensor per projection,
and only the metadata keys the converter writes for the architecture.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from kvserve.config import CacheConfig, EngineConfig
from kvserve.engine.core import EngineCore
from kvserve.types import SamplingParams
from tests.models.reference import check_greedy_matches, load_hf

_PERMUTED_QK = {"llama", "smollm3"}
_NORMS_PLUS_ONE = {"gemma2", "gemma3"}
_EXPERT = re.compile(r"\.experts\.(\d+)\.")
_ROUTERS = (".ffn_gate_inp.weight", ".ffn_gate_inp_shexp.weight")  # kept in float32, as the converter does


def write_gguf(folder: Path, out: Path, arch: str, quant: str | None = None) -> Path:
    """``folder`` (an HF checkpoint) as a GGUF file of llama.cpp ``arch``; ``quant`` (e.g. "Q8_0")
    for the matrices (the routers stay float32)."""
    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((folder / "config.json").read_text())
    writer = gguf.GGUFWriter(str(out), arch)
    _common_metadata(writer, cfg, arch)
    _ARCH_METADATA.get(arch, lambda w, c: None)(writer, cfg)
    tensors = load_file(str(folder / "model.safetensors"))
    if arch == "phi3" and _rope(cfg).get("rope_type") == "longrope":
        for key in ("long_factor", "short_factor"):
            writer.add_tensor(f"rope_factors_{key.split('_')[0]}.weight", np.array(_rope(cfg)[key], dtype=np.float32))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg["num_hidden_layers"])
    for name, array in _converted(tensors, arch, cfg):
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ValueError(f"no GGUF name for {name} in {arch}")
        qtype = None if quant is None else gguf.GGMLQuantizationType[quant]
        # rows that are not whole blocks stay float, as the converter falls back for them
        if qtype is not None and array.ndim >= 2 and not gguf_name.endswith(_ROUTERS) \
                and array.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0:
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _rope(cfg: dict[str, Any]) -> dict[str, Any]:
    return cfg.get("rope_parameters") or {}


def _common_metadata(writer, cfg: dict[str, Any], arch: str) -> None:
    """What the converter's TextModel writes for every architecture (Gemma 2's writes no RoPE base)."""
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_key_length(cfg["head_dim"])
    writer.add_value_length(cfg["head_dim"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    rope = _rope(cfg).get("full_attention", _rope(cfg))
    if "rope_theta" in rope and arch != "gemma2":
        writer.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "linear":
        import gguf

        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg["num_experts_per_tok"])


def _llama(writer, cfg: dict[str, Any]) -> None:
    writer.add_rope_dimension_count(cfg["head_dim"])


def _phi3(writer, cfg: dict[str, Any]) -> None:
    rope, original = _rope(cfg), cfg["original_max_position_embeddings"]
    writer.add_rope_scaling_orig_ctx_len(original)
    rotary = int(rope.get("partial_rotary_factor", 1.0) * cfg["hidden_size"]) // cfg["num_attention_heads"]
    writer.add_rope_dimension_count(rotary)
    writer.add_sliding_window(cfg.get("sliding_window") or 0)
    if rope.get("rope_type") == "longrope":
        scale = cfg["max_position_embeddings"] / original
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))


def _gemma2(writer, cfg: dict[str, Any]) -> None:
    writer.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
    writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    writer.add_sliding_window(cfg["sliding_window"])


def _gemma3(writer, cfg: dict[str, Any]) -> None:
    local = _rope(cfg).get("sliding_attention", {})
    if "rope_theta" in local:
        writer.add_rope_freq_base_swa(local["rope_theta"])
    if cfg.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    writer.add_sliding_window(cfg["sliding_window"])


def _qwen_moe(writer, cfg: dict[str, Any]) -> None:
    writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if cfg.get("shared_expert_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])


_ARCH_METADATA = {"llama": _llama, "smollm3": _llama, "phi3": _phi3, "gemma2": _gemma2, "gemma3": _gemma3,
                  "qwen2moe": _qwen_moe, "qwen3moe": _qwen_moe}


def _converted(tensors: dict[str, np.ndarray], arch: str, cfg: dict[str, Any]):
    """(HF name, float32 array) as the converter hands them to the name map: experts stacked."""
    stacks: dict[str, list[tuple[int, np.ndarray]]] = {}
    for name, array in tensors.items():
        array = array.astype(np.float32)
        if name == "lm_head.weight" and (cfg.get("tie_word_embeddings") or arch == "gemma2"):
            continue  # llama.cpp's Gemma 2 always ties the head to the embeddings
        if arch in _NORMS_PLUS_ONE and name.endswith("norm.weight"):
            array = array + 1
        if arch in _PERMUTED_QK and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg["num_attention_heads"] if "q_proj" in name else cfg["num_key_value_heads"]
            array = _permute_qk(array, heads)
        match = _EXPERT.search(name)
        if match:
            stacks.setdefault(_EXPERT.sub(".experts.", name), []).append((int(match[1]), array))
            continue
        yield name, array
    for name, experts in stacks.items():
        yield name, np.stack([array for _, array in sorted(experts, key=lambda e: e[0])])


def _permute_qk(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's RoPE layout: within each head, the two rotated halves interleaved pairwise."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def gguf_core(path: Path, **kw) -> EngineCore:
    return EngineCore(EngineConfig(model=str(path), dtype="float32",
                                   cache=CacheConfig(block_size=4, num_kv_blocks=256), **kw))


def greedy(core: EngineCore, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy outputs, EOS ignored, of all ``prompts`` run together."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.add_request(str(i), prompt, params)
    outs: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while core.has_unfinished():
        for update in core.step():
            outs[update.request.request_id] += update.new_token_ids
    return [outs[str(i)] for i in range(len(prompts))]


def check_matches_transformers(core: EngineCore, folder: Path, prompts: list[list[int]], max_tokens: int = 16) -> None:
    """The core's greedy outputs are transformers' on the HF folder, most tokens really compared."""
    hf = load_hf(folder)
    outs = greedy(core, prompts, max_tokens)
    compared = sum(check_greedy_matches(hf, p, o) for p, o in zip(prompts, outs))
    assert compared >= len(prompts) * max_tokens // 2
