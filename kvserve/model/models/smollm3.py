"""SmolLM3: the Llama decoder in which every fourth layer (``no_rope_layers``) uses no rotary
embedding at all (NoPE): its q and k carry no position, the causal mask alone orders tokens.

The Llama modules read the per-layer flag (``ModelConfig.uses_rope``); this class exists so the
fused C++ decode step, which rotates in every layer, is not built for it (llama_decode.py builds
only for classes that keep ``fused_decode``).
"""

from __future__ import annotations

import torch

from kvserve.config import ModelConfig
from kvserve.model.models.llama import LlamaForCausalLM


class SmolLM3ForCausalLM(LlamaForCausalLM):
    fused_decode = False

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        if cfg.rope_layers and len(cfg.rope_layers) != cfg.num_layers:
            raise ValueError(f"config.json: no_rope_layers has {len(cfg.rope_layers)} entries for "
                             f"{cfg.num_layers} layers")
        super().__init__(cfg, dtype)
