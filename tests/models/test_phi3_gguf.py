"""Phi-3 GGUF files, written here the way llama.cpp's converter lays them out (fused attn_qkv and
ffn_up, LongRoPE factors as tensors, rotary dims and window in the metadata), read into the same
model as the HF folder: float32 files match transformers token for token; Q8_0 blocks stay blocks."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

from kvserve.config import CacheConfig, EngineConfig, QuantConfig
from kvserve.engine.core import EngineCore
from kvserve.types import SamplingParams
from tests.conftest import make_tiny_model
from tests.models.reference import check_greedy_matches, load_hf, random_prompts

gguf = pytest.importorskip("gguf")

ORIGINAL = 64
ROTARY = 12

_LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
          "self_attn.qkv_proj.weight": "attn_qkv.weight", "self_attn.o_proj.weight": "attn_output.weight",
          "mlp.gate_up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}


def write_phi3_gguf(folder, out, quant=None):
    """llama.cpp's phi3 layout of an HF Phi-3 folder; ``quant`` (e.g. Q8_0) for the 2-D matrices."""
    from safetensors.numpy import load_file

    cfg = json.loads((folder / "config.json").read_text())
    rope = cfg.get("rope_parameters") or {}
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    writer = gguf.GGUFWriter(str(out), "phi3")
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_rope_scaling_orig_ctx_len(cfg["original_max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * hidden) // heads)
    writer.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    writer.add_sliding_window(cfg.get("sliding_window") or 0)
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    if rope.get("rope_type") == "longrope":
        scale = cfg["max_position_embeddings"] / cfg["original_max_position_embeddings"]
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(ORIGINAL)))
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    for name, array in load_file(str(folder / "model.safetensors")).items():
        if name in _GLOBAL:
            gguf_name = _GLOBAL[name]
        else:
            layer, rest = name.split(".")[2], name.split(".", 3)[3]
            gguf_name = f"blk.{layer}.{_LAYER[rest]}"
        array = array.astype(np.float32)
        if quant is not None and array.ndim == 2:
            qtype = gguf.GGMLQuantizationType[quant]
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _generate(core: EngineCore, prompts, max_tokens):
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.add_request(str(i), prompt, params)
    outs: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while core.has_unfinished():
        for update in core.step():
            outs[update.request.request_id] += update.new_token_ids
    return [outs[str(i)] for i in range(len(prompts))]


def _core(path, **kw):
    return EngineCore(EngineConfig(model=str(path), dtype="float32", cache=CacheConfig(block_size=4, num_kv_blocks=256),
                                   **kw))



@pytest.fixture(scope="module")
def phi4_mini_folder(tmp_path_factory):
    rng = random.Random(0)
    return make_tiny_model(tmp_path_factory.mktemp("gguf-phi4-mini"), "Phi3ForCausalLM", pad_token_id=0,
                           max_position_embeddings=256, original_max_position_embeddings=ORIGINAL,
                           partial_rotary_factor=ROTARY / 16, tie_word_embeddings=True,
                           rope_scaling={"type": "longrope",
                                         "short_factor": [round(rng.uniform(1.0, 1.5), 3) for _ in range(6)],
                                         "long_factor": [round(rng.uniform(2.0, 40.0), 3) for _ in range(6)]})


def test_phi4_mini_gguf_matches_transformers(phi4_mini_folder, tmp_path):
    path = write_phi3_gguf(phi4_mini_folder, tmp_path / "phi4-mini.gguf")
    core = _core(path)
    cfg = core.model_config
    assert cfg.architecture == "Phi3ForCausalLM" and cfg.tie_word_embeddings and cfg.layer_windows == (None, None)
    assert cfg.rope.rope_type == "longrope" and cfg.rope.rotary_fraction == 0.75
    assert cfg.rope.original_max_position == ORIGINAL
    hf = load_hf(phi4_mini_folder)
    prompts = random_prompts(3, ORIGINAL + 1, 100, seed=1)  # the long factors: past the original context
    compared = sum(check_greedy_matches(hf, p, o) for p, o in zip(prompts, _generate(core, prompts, 16)))
    assert compared >= len(prompts) * 16 // 2


def test_phi3_gguf_window_and_q8_blocks(tmp_path):
    folder = make_tiny_model(tmp_path / "hf", "Phi3ForCausalLM", pad_token_id=0, sliding_window=18)
    dense = write_phi3_gguf(folder, tmp_path / "phi3-f32.gguf")
    core = _core(dense)
    assert core.model_config.layer_windows == (18, 18) and core.model_config.rope.rope_type == "default"
    prompts = random_prompts(3, 20, 60, seed=2)
    compared = sum(check_greedy_matches(load_hf(folder), p, o) for p, o in zip(prompts, _generate(core, prompts, 16)))
    assert compared >= len(prompts) * 16 // 2
    # Q8_0: the fused matrices' blocks split by rows into the int8 layers, not dequantized
    q8_path = write_phi3_gguf(folder, tmp_path / "phi3-q8.gguf", quant="Q8_0")
    q8 = _core(q8_path)
    layer = q8.runner.model.model.layers[0]
    assert "int8" in layer.self_attn.qkv_proj.method.describe() and "int8" in layer.mlp.gate_up_proj.method.describe()
    dequantized = _core(q8_path, quant=QuantConfig(quantization="none"))
    assert _generate(q8, prompts, 8) == _generate(dequantized, prompts, 8)
