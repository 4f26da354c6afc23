"""The Llama decoder with sparse mixture-of-experts MLPs (layers/moe.py) in the layers the config
marks sparse, and the dense gated MLP in the others (Qwen-MoE's ``mlp_only_layers``). Mixtral,
Qwen2/3-MoE and OLMoE build on it (mixtral.py, qwen_moe.py, olmoe.py).
"""

from __future__ import annotations

import torch

from kvserve.config import ModelConfig
from kvserve.model.layers.moe import SparseMoeBlock
from kvserve.model.models.llama import MLP, DecoderLayer, LlamaForCausalLM


class MoeDecoderLayer(DecoderLayer):
    def make_mlp(self, cfg: ModelConfig, dtype: torch.dtype, layer: int) -> torch.nn.Module:
        if cfg.moe.is_sparse(layer):
            return SparseMoeBlock(cfg.hidden_size, cfg.moe, dtype)
        return MLP(cfg, dtype)


class MoeForCausalLM(LlamaForCausalLM):
    layer_class = MoeDecoderLayer
    # The C++ decode step knows Llama's attention and softmax-routed experts; a family opts in once
    # its layers are those (DeepSeek's latent attention and OLMoE's whole-projection q/k norms are not).
    fused_decode = False

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        if cfg.moe is None:
            raise ValueError(f"{cfg.architecture}: config.json describes no experts")
        if cfg.hidden_act != "silu":
            raise ValueError(f"hidden_act={cfg.hidden_act!r} is not supported for {cfg.architecture}; supported: silu")
        super().__init__(cfg, dtype)
