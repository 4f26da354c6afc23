"""Shared fixtures: tiny random-weight models written to disk, the default model, leak checks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kvserve.bench.random_model import TINY_SHAPE, write_random_model

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Without a GPU, the CUDA backend's Triton kernels run in Triton's interpreter on CPU tensors. The
# variable must be set before triton is first imported (its library functions are decorated then);
# nothing but triton reads it.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

TINY_VOCAB = TINY_SHAPE["vocab_size"]


# make_tiny_model(path, arch, seed=0, **overrides): a tiny random-weight HF checkpoint written to ``path``.
make_tiny_model = write_random_model


def check_report(out: Path, plots: tuple[str, ...], data_file: str = "results.json") -> tuple[str, dict]:
    """A `kvserve bench ... --report` folder: ``plots`` are real PNGs, embedded in a report.html that
    loads nothing from elsewhere; returns the page's text and the saved figures."""
    import json

    for name in plots:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    page = (out / "report.html").read_text()
    assert page.count("data:image/png;base64,") == len(plots) and 'src="http' not in page
    return page, json.loads((out / data_file).read_text())


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
