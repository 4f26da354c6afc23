"""The converted-weights cache (model/weight_cache.py): a load that reads a kept entry back gives the
same tensors, bit for bit, and the same greedy tokens as one that converts the checkpoint; a
changed checkpoint or a damaged entry is converted again; entries past the budget go oldest first."""

from __future__ import annotations

import json
import os

import pytest
import torch

from kvserve.config import CacheConfig, EngineConfig, QuantConfig
from kvserve.engine.core import EngineCore
from kvserve.model import weight_cache
from kvserve.model.cpu_kernels import load_kernels
from tests.conftest import make_tiny_model
from tests.models.gguf_writer import greedy, write_gguf
from tests.models.reference import random_prompts

# name: (HF architecture, overrides, GGUF architecture or None for the HF folder, quantization)
CASES = {
    "llama_gguf_q8": ("LlamaForCausalLM", {}, "llama", None),
    "llama_int4_at_load": ("LlamaForCausalLM", dict(tie_word_embeddings=True), None, "int4"),
    "mixtral_int4_at_load": ("MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2), None, "int4"),
    "deepseek_v2_int8_at_load": ("DeepseekV2ForCausalLM", dict(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, head_dim=8, v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=None,
        topk_method="greedy"), None, "int8"),
}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cache folder of the test's own, kept whatever the model's size; every restore's result."""
    load_kernels()  # from the usual folder, first: the test's own would build them again
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(weight_cache, "MIN_BYTES", 0)
    restored = []
    real = weight_cache.restore
    monkeypatch.setattr(weight_cache, "restore", lambda model, key: restored.append(real(model, key)) or restored[-1])
    return tmp_path / "cache" / "weights", restored


def _checkpoint(tmp_path, case):
    arch, overrides, gguf_arch, quantization = CASES[case]
    folder = make_tiny_model(tmp_path / "hf", arch, **overrides)
    path = folder if gguf_arch is None else write_gguf(folder, tmp_path / "model.gguf", gguf_arch, quant="Q8_0")
    return path, quantization


def _core(path, quantization, weight_cache_gb: float) -> EngineCore:
    return EngineCore(EngineConfig(model=str(path), dtype="float32", weight_cache_gb=weight_cache_gb,
                                   quant=QuantConfig(quantization=quantization),
                                   cache=CacheConfig(block_size=4, num_kv_blocks=256)))


def _tensors(core: EngineCore) -> dict[str, torch.Tensor | None]:
    model = core.runner.model
    return dict([*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)])


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_kept_entry_loads_the_same_model(case, tmp_path, cache):
    folder, restored = cache
    path, quantization = _checkpoint(tmp_path, case)
    prompts = random_prompts(3, 6, 20, seed=2)
    converted = _core(path, quantization, 0)  # no cache: converts, keeps nothing
    assert not folder.exists()
    _core(path, quantization, 1.0)  # converts and keeps
    assert restored == [False] and len(list(folder.iterdir())) == 1
    read_back = _core(path, quantization, 1.0)
    assert restored == [False, True]
    a, b = _tensors(converted), _tensors(read_back)
    assert a.keys() == b.keys()
    for name, x in a.items():
        y = b[name]
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.dtype == y.dtype and x.shape == y.shape and x.stride() == y.stride(), name
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), name
    assert greedy(read_back, prompts, 12) == greedy(converted, prompts, 12)


@pytest.fixture
def kept(tmp_path, cache):
    """A GGUF checkpoint whose entry is kept: (path, prompts, its greedy tokens converted, folder, restores)."""
    folder, restored = cache
    path, _ = _checkpoint(tmp_path, "llama_gguf_q8")
    prompts = random_prompts(2, 6, 20, seed=3)
    expected = greedy(_core(path, None, 0), prompts, 10)
    _core(path, None, 1.0)
    return path, prompts, expected, folder, restored


def test_a_changed_checkpoint_or_a_damaged_entry_is_converted_again(kept):
    path, prompts, expected, folder, restored = kept
    (first,) = folder.iterdir()
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a rewrite of the file: another key
    assert greedy(_core(path, None, 1.0), prompts, 10) == expected
    assert restored == [False, False] and len(list(folder.iterdir())) == 2
    newest = next(e for e in folder.iterdir() if e != first)
    blob = newest / "weights.bin"
    blob.write_bytes(blob.read_bytes()[: blob.stat().st_size // 2])  # cut short
    assert greedy(_core(path, None, 1.0), prompts, 10) == expected
    assert restored[-1] is False
    assert greedy(_core(path, None, 1.0), prompts, 10) == expected  # the damaged entry was replaced
    assert restored[-1] is True


def test_an_index_that_does_not_fit_the_blob_is_not_used(kept):
    path, prompts, expected, folder, restored = kept
    (entry,) = folder.iterdir()
    index = json.loads((entry / "index.json").read_text())
    first = next(t for t in index["tensors"] if t["storage"] is not None)
    first["shape"] = [10**9]  # past the end of its storage
    (entry / "index.json").write_text(json.dumps(index))
    assert greedy(_core(path, None, 1.0), prompts, 10) == expected
    assert restored == [False, False]
    assert greedy(_core(path, None, 1.0), prompts, 10) == expected  # the damaged entry was replaced
    assert restored == [False, False, True]


def test_entries_past_the_budget_go_least_recently_used_first(tmp_path):
    folder = tmp_path / "weights"
    for age, name in enumerate(["newest", "middle", "oldest"]):
        entry = folder / name
        entry.mkdir(parents=True)
        (entry / "weights.bin").write_bytes(bytes(1000))
        os.utime(entry, (1e9 - age * 100, 1e9 - age * 100))
    (folder / "other.123.tmp").mkdir()  # another process's entry in the making: not counted, kept
    (folder / "killed.456.tmp").mkdir()  # left by a process killed a day and more ago: removed
    os.utime(folder / "killed.456.tmp", (1e9, 1e9))
    weight_cache._evict(folder, 2500)
    assert sorted(e.name for e in folder.iterdir()) == ["middle", "newest", "other.123.tmp"]


def test_the_budget_must_not_be_negative():
    with pytest.raises(ValueError, match="weight_cache_gb"):
        EngineConfig(weight_cache_gb=-1)

