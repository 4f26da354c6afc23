"""Gemma 2, Gemma 3 and SmolLM3 GGUF files, written the way llama.cpp's converter lays them out
(tests/models/gguf_writer.py), match transformers on the HF folder token for token: Gemma's 1 + w
norm weights, soft caps, windows and global-layer pattern, Gemma 3's q/k norms and local RoPE base,
SmolLM3's NoPE layers. A Q8_0 Gemma 3 file keeps its blocks and generates as its dequantized self."""

from __future__ import annotations

import pytest

from kvserve.config import QuantConfig
from kvserve.model import gguf_file
from tests.conftest import make_tiny_model
from tests.models.gguf_writer import check_matches_transformers, gguf_core, greedy, write_gguf
from tests.models.reference import random_prompts

gguf = pytest.importorskip("gguf")

WINDOW = 16
HEAD_DIM = 16  # llama.cpp scales Gemma's attention by head_dim (27B: hidden / heads); no key holds another


def test_gemma2_gguf_matches_transformers(tmp_path):
    folder = make_tiny_model(tmp_path / "hf", "Gemma2ForCausalLM", num_hidden_layers=4, sliding_window=WINDOW,
                             query_pre_attn_scalar=HEAD_DIM, attn_logit_softcapping=2.0,
                             final_logit_softcapping=3.0, tie_word_embeddings=True)
    core = gguf_core(write_gguf(folder, tmp_path / "gemma2.gguf", "gemma2"))
    cfg = core.model_config
    assert cfg.architecture == "Gemma2ForCausalLM" and cfg.layer_windows == (WINDOW, None, WINDOW, None)
    assert (cfg.attn_logit_softcap, cfg.final_logit_softcap, cfg.query_pre_attn_scalar) == (2.0, 3.0, HEAD_DIM)
    # the file's norm weights are 1 + w; the model's are too, not 2 + w
    norm = core.runner.model.model.layers[0].input_layernorm.weight
    stored = dict(gguf_file.iter_weights(tmp_path / "gemma2.gguf", gguf_file.read_config(tmp_path / "gemma2.gguf")))
    assert norm.equal((stored["model.layers.0.input_layernorm.weight"] + 1).float())
    check_matches_transformers(core, folder, random_prompts(3, 20, 50, seed=1))


@pytest.fixture(scope="module")
def gemma3_folder(tmp_path_factory):
    # five local layers and a global one; the global RoPE scaled linearly, the local one on its own base
    return make_tiny_model(tmp_path_factory.mktemp("gguf-gemma3"), "Gemma3ForCausalLM", num_hidden_layers=6,
                           sliding_window=WINDOW, query_pre_attn_scalar=HEAD_DIM, tie_word_embeddings=True,
                           rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                                               "rope_theta": 1000000.0},
                                            "sliding_attention": {"rope_type": "default", "rope_theta": 20000.0}})


def test_gemma3_gguf_matches_transformers(gemma3_folder, tmp_path):
    core = gguf_core(write_gguf(gemma3_folder, tmp_path / "gemma3.gguf", "gemma3"))
    cfg = core.model_config
    assert cfg.architecture == "Gemma3ForCausalLM" and cfg.layer_windows == (WINDOW,) * 5 + (None,)
    assert cfg.qk_norm and cfg.local_rope.theta == 20000.0 and cfg.rope.theta == 1000000.0
    assert cfg.rope.rope_type == "linear" and cfg.rope.factor == 4.0
    check_matches_transformers(core, gemma3_folder, random_prompts(3, 20, 50, seed=2))


def test_gemma3_q8_gguf_keeps_blocks(gemma3_folder, tmp_path):
    path = write_gguf(gemma3_folder, tmp_path / "gemma3-q8.gguf", "gemma3", quant="Q8_0")
    q8 = gguf_core(path)
    layer = q8.runner.model.model.layers[0]
    assert "int8" in layer.self_attn.qkv_proj.method.describe() and "int8" in layer.mlp.gate_up_proj.method.describe()
    prompts = random_prompts(2, 20, 40, seed=3)
    assert greedy(q8, prompts, 8) == greedy(gguf_core(path, quant=QuantConfig(quantization="none")), prompts, 8)


def test_smollm3_gguf_matches_transformers(tmp_path):
    # llama.cpp's SmolLM3 leaves every 4th layer unrotated (no key holds the interval)
    folder = make_tiny_model(tmp_path / "hf", "SmolLM3ForCausalLM", num_hidden_layers=4, no_rope_layer_interval=4,
                             pad_token_id=0)
    core = gguf_core(write_gguf(folder, tmp_path / "smollm3.gguf", "smollm3"))
    assert core.model_config.architecture == "SmolLM3ForCausalLM"
    assert core.model_config.rope_layers == (True, True, True, False)
    check_matches_transformers(core, folder, random_prompts(3, 10, 40, seed=4))


def test_gemma_27b_shape_scales_by_hidden_over_heads(tmp_path):
    """llama.cpp's rule for the 27B models (46 layers in Gemma 2): query_pre_attn_scalar = hidden / heads."""
    path = tmp_path / "gemma2-27b-header.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma2")
    for add, value in [("add_block_count", 46), ("add_embedding_length", 4608), ("add_feed_forward_length", 36864),
                       ("add_head_count", 32), ("add_head_count_kv", 16), ("add_key_length", 128),
                       ("add_sliding_window", 4096)]:
        getattr(writer, add)(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    cfg = gguf_file.read_config(path)
    assert cfg["query_pre_attn_scalar"] == 144 and cfg["attn_logit_softcapping"] == 50.0
    assert cfg["layer_types"][:2] == ["sliding_attention", "full_attention"]
