"""Model classes keyed by the `architectures` entry of config.json."""

from __future__ import annotations

import torch

from kvserve.model.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from kvserve.model.models.gemma2 import Gemma2ForCausalLM
from kvserve.model.models.gemma3 import Gemma3ForCausalLM
from kvserve.model.models.gpt_oss import GptOssForCausalLM
from kvserve.model.models.llama import LlamaForCausalLM
from kvserve.model.models.mixtral import MixtralForCausalLM
from kvserve.model.models.olmoe import OlmoeForCausalLM
from kvserve.model.models.phi3 import Phi3ForCausalLM
from kvserve.model.models.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from kvserve.model.models.smollm3 import SmolLM3ForCausalLM

_MODELS: dict[str, type[torch.nn.Module]] = {
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
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
