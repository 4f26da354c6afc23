"""Shared fixtures: tiny random-weight models written to disk, the default model, leak checks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Without a GPU, the CUDA backend's Triton kernels run in Triton's interpreter on CPU tensors. The
# variable must be set before triton is first imported (its library functions are decorated then);
# nothing but triton reads it.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

TINY_VOCAB = 512


def _tiny_tokenizer():
    """A word-level tokenizer over TINY_VOCAB tokens, so tiny models can detokenize."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, TINY_VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def make_tiny_model(path: Path, arch: str, seed: int = 0, **overrides) -> Path:
    """Write a random-weight HF checkpoint (config.json + safetensors + tokenizer) to ``path``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                  "MistralForCausalLM": "mistral"}[arch]
    kwargs = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, initializer_range=0.15,
                  architectures=[arch])
    kwargs.update(overrides)
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if model_type == "qwen2":  # make the qkv biases non-zero so they are exercised
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    model.save_pretrained(path)
    _tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """Llama with GQA (4 query heads, 2 KV heads)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "LlamaForCausalLM")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    """Qwen2 with qkv bias and MQA-like 1 KV head."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "Qwen2ForCausalLM", num_key_value_heads=1)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> Path:
    """Qwen3 with q/k norm, tied embeddings, MHA."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), "Qwen3ForCausalLM", num_key_value_heads=4,
                           tie_word_embeddings=True)


@pytest.fixture(scope="session")
def default_llm():
    """The bundled default model in float32, shared by the tests that only read from it."""
    from kvserve import LLM

    return LLM(dtype="float32", kv_cache_memory_bytes=256 * 1024**2)


def assert_no_leak(llm) -> None:
    """Every block is back in the pool and the bookkeeping is consistent."""
    kv = llm.engine.core.kv_cache
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_blocks, f"{kv.num_blocks - kv.num_free_blocks} blocks leaked"
    assert not llm.engine.has_unfinished()
