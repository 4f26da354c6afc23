"""Mixture-of-experts GGUF files (Mixtral as llama with experts, Qwen2-MoE with its gated shared
expert, Qwen3-MoE, OLMoE), written the way llama.cpp's converter lays them out
(tests/models/gguf_writer.py: each layer's experts stacked in one 3-D tensor per projection), match
transformers on the HF folder token for token. In a Q8_0 file every expert keeps its blocks."""

from __future__ import annotations

import pytest

from kvserve.config import QuantConfig
from kvserve.model import gguf_file
from tests.conftest import make_tiny_model
from tests.models.gguf_writer import check_matches_transformers, gguf_core, greedy, write_gguf
from tests.models.reference import random_prompts

gguf = pytest.importorskip("gguf")

# family: (GGUF architecture, HF architecture, overrides)
FAMILIES = {
    "mixtral": ("llama", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("qwen2moe", "Qwen2MoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2,
                                                          moe_intermediate_size=32,
                                                          shared_expert_intermediate_size=64, norm_topk_prob=False)),
    # llama.cpp's qwen3moe has experts in every layer and always renormalises their weights
    "qwen3_moe": ("qwen3moe", "Qwen3MoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2,
                                                          moe_intermediate_size=32, norm_topk_prob=True)),
    "olmoe": ("olmoe", "OlmoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2, pad_token_id=0)),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_moe_gguf_matches_transformers(family, tmp_path):
    arch, hf_arch, overrides = FAMILIES[family]
    folder = make_tiny_model(tmp_path / "hf", hf_arch, **overrides)
    path = write_gguf(folder, tmp_path / f"{family}.gguf", arch)
    assert any(len(t.shape) == 3 for t in gguf.GGUFReader(str(path)).tensors)  # stacked experts
    core = gguf_core(path)
    cfg = core.model_config
    assert cfg.architecture == hf_arch and cfg.moe.num_experts == 4 and cfg.moe.experts_per_token == 2
    if family == "qwen2_moe":
        assert cfg.moe.shared_intermediate_size == 64 and cfg.attention_bias and not cfg.moe.renormalize
    if family == "qwen3_moe":
        assert cfg.moe.renormalize and cfg.qk_norm
    if family == "mixtral":
        assert cfg.moe.renormalize and cfg.moe.float32_weights
    check_matches_transformers(core, folder, random_prompts(3, 10, 40, seed=1))


def test_qwen2_moe_q8_gguf_keeps_expert_blocks(tmp_path):
    arch, hf_arch, overrides = FAMILIES["qwen2_moe"]
    folder = make_tiny_model(tmp_path / "hf", hf_arch, **overrides)
    path = write_gguf(folder, tmp_path / "qwen2moe-q8.gguf", arch, quant="Q8_0")
    types = gguf_file.tensor_types(path)
    assert types["model.layers.0.mlp.experts.3.down_proj.weight"] == "Q8_0"
    assert types["model.layers.0.mlp.gate.weight"] == "F32"
    q8 = gguf_core(path)
    block = q8.runner.model.model.layers[0].mlp
    assert all("int8" in e.gate_up_proj.method.describe() and "int8" in e.down_proj.method.describe()
               for e in block.experts)
    assert "int8" in block.shared_expert.gate_up_proj.method.describe()
    assert block.gate.method.name == block.shared_expert_gate.method.name == "dense"
    prompts = random_prompts(3, 10, 30, seed=2)
    dequantized = gguf_core(path, quant=QuantConfig(quantization="none"))
    assert greedy(q8, prompts, 8) == greedy(dequantized, prompts, 8)
