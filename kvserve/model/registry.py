"""Model classes keyed by the `architectures` entry of config.json."""

from __future__ import annotations

import torch

from kvserve.model.models.gemma2 import Gemma2ForCausalLM
from kvserve.model.models.gemma3 import Gemma3ForCausalLM
from kvserve.model.models.llama import LlamaForCausalLM
from kvserve.model.models.phi3 import Phi3ForCausalLM
from kvserve.model.models.smollm3 import SmolLM3ForCausalLM

_MODELS: dict[str, type[torch.nn.Module]] = {
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def model_class(architecture: str) -> type[torch.nn.Module]:
    if architecture not in _MODELS:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(supported_architectures())}"
        )
    return _MODELS[architecture]
