"""Phi-3 GGUF files, written here the way llama.cpp's converter lays them out (fused attn_qkv and
ffn_up, LongRoPE factors as tensors, rotary dims and window in the metadata), read into the same
model as the HF folder: float32 files match transformers token for token; Q8_0 blocks stay blocks."""

from __future__ import annotations

import random

import pytest

from kvserve.config import QuantConfig
from tests.conftest import make_tiny_model
from tests.models.gguf_writer import check_matches_transformers, gguf_core, greedy, write_gguf
from tests.models.reference import random_prompts

gguf = pytest.importorskip("gguf")

ORIGINAL = 64
ROTARY = 12


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
    path = write_gguf(phi4_mini_folder, tmp_path / "phi4-mini.gguf", "phi3")
    core = gguf_core(path)
    cfg = core.model_config
    assert cfg.architecture == "Phi3ForCausalLM" and cfg.tie_word_embeddings and cfg.layer_windows == (None, None)
    assert cfg.rope.rope_type == "longrope" and cfg.rope.rotary_fraction == 0.75
    assert cfg.rope.original_max_position == ORIGINAL
    prompts = random_prompts(3, ORIGINAL + 1, 100, seed=1)  # the long factors: past the original context
    check_matches_transformers(core, phi4_mini_folder, prompts)


def test_phi3_gguf_window_and_q8_blocks(tmp_path):
    folder = make_tiny_model(tmp_path / "hf", "Phi3ForCausalLM", pad_token_id=0, sliding_window=18)
    dense = write_gguf(folder, tmp_path / "phi3-f32.gguf", "phi3")
    core = gguf_core(dense)
    assert core.model_config.layer_windows == (18, 18) and core.model_config.rope.rope_type == "default"
    prompts = random_prompts(3, 20, 60, seed=2)
    check_matches_transformers(core, folder, prompts)
    # Q8_0: the fused matrices' blocks split by rows into the int8 layers, not dequantized
    q8_path = write_gguf(folder, tmp_path / "phi3-q8.gguf", "phi3", quant="Q8_0")
    q8 = gguf_core(q8_path)
    layer = q8.runner.model.model.layers[0]
    assert "int8" in layer.self_attn.qkv_proj.method.describe() and "int8" in layer.mlp.gate_up_proj.method.describe()
    dequantized = gguf_core(q8_path, quant=QuantConfig(quantization="none"))
    assert greedy(q8, prompts, 8) == greedy(dequantized, prompts, 8)
