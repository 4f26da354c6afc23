"""Random-weight Hugging Face checkpoints of any Llama-family shape, for tests and benchmarks.

No model can be downloaded here, so the tests write tiny ones and the GPU check ~1B and ~8B ones:
config.json + safetensors from transformers' own model classes (the parity reference), and a
word-level tokenizer ("w3", "w4", ...) covering the vocabulary so outputs can be detokenized.
"""

from __future__ import annotations

from pathlib import Path

import torch

_MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                "MistralForCausalLM": "mistral", "Gemma2ForCausalLM": "gemma2",
                "Gemma3ForCausalLM": "gemma3_text", "SmolLM3ForCausalLM": "smollm3",
                "Phi3ForCausalLM": "phi3",
                "MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe",
                "Qwen3MoeForCausalLM": "qwen3_moe", "OlmoeForCausalLM": "olmoe", "GptOssForCausalLM": "gpt_oss",
                "DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v3"}

# Tiny defaults: 2 layers, GQA 4/2, head_dim 16; overridden per call.
TINY_SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=False)
# TinyLlama-1.1B's shape: the GPU check's throughput model.
LLAMA_1B_SHAPE = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                      num_attention_heads=32, num_key_value_heads=4, head_dim=64, max_position_embeddings=4096,
                      tie_word_embeddings=False)
# Llama-3-8B's shape: large enough that a decode step is bound by its weights, not by kernel launches.
LLAMA_8B_SHAPE = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
                      rope_theta=500000.0, tie_word_embeddings=False)


def word_tokenizer(vocab_size: int):
    """A word-level tokenizer over ``vocab_size`` tokens (0 = <unk>, 1 = <s>, 2 = </s>, then w3...)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def write_random_model(path: Path, arch: str = "LlamaForCausalLM", seed: int = 0, dtype: torch.dtype = torch.float32,
                       device: str = "cpu", **overrides) -> Path:
    """Write a random-weight checkpoint of ``arch`` (TINY_SHAPE unless overridden) to ``path``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type = _MODEL_TYPES[arch]
    kwargs = dict(TINY_SHAPE, bos_token_id=1, eos_token_id=2, initializer_range=0.15, architectures=[arch])
    kwargs.update(overrides)
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if model_type in ("qwen2", "qwen2_moe"):  # make the qkv biases non-zero so they are exercised
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    if model_type == "deepseek_v3":  # the routers' correction biases start at 0: make them matter
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                torch.nn.init.normal_(buffer, std=0.3)
    if model_type.startswith("gemma"):  # Gemma norms start at w = 0 (a gain of 1 + w): make them matter
        for name, param in model.named_parameters():
            if "norm" in name:
                torch.nn.init.normal_(param, std=0.3)
    if model_type == "gpt_oss":  # biases and sinks start at zero or tiny: make them change tokens
        for name, param in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                torch.nn.init.normal_(param, std=1.0)
    model.save_pretrained(path)
    word_tokenizer(config.vocab_size).save_pretrained(path)
    return Path(path)
