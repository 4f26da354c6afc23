"""Zeroed CPU tensors over fresh pages (the KV cache): zero, writable, and alive as long as a view is."""

from __future__ import annotations

import gc

import pytest
import torch

from kvserve.model.attention.kv_quant import KVQuantFormat
from kvserve.model.attention.torch_sdpa import TorchAttentionBackend
from kvserve.runtime.host_memory import zeroed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
@pytest.mark.parametrize("shape", [(2, 3), (2, 300, 16, 3, 64)])  # below a page, and many pages
def test_zeroed_is_zero_and_writable(shape, dtype):
    t = zeroed(shape, dtype, torch.device("cpu"))
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and not t.any()
    view = t[-1]
    del t
    gc.collect()
    view.fill_(3)  # the pages outlive the tensor they were made for
    assert (view == 3).all()


def test_kv_caches_start_zeroed():
    cpu = torch.device("cpu")
    cache = TorchAttentionBackend().allocate_kv_cache(64, 16, 3, 64, torch.bfloat16, cpu)
    assert cache.shape == (2, 64, 16, 3, 64) and not cache.any()
    rows = KVQuantFormat("int8").allocate(64, 16, 3, 64, cpu)
    assert not rows.any() and not KVQuantFormat("int8").dequantize(rows, torch.float32).isnan().any()


def test_a_kv_cache_larger_than_free_memory_is_refused_at_start(tiny_llama, monkeypatch):
    """Its pages are committed only as they are written, so the check has to be made up front."""
    from kvserve import LLM
    from kvserve.runtime import host_memory

    monkeypatch.setattr(host_memory, "available_bytes", lambda: 2**20)
    with pytest.raises(ValueError, match=r"the KV cache needs 0\.0\d GiB but only 0\.00 GiB .* lower --kv-cache-memory"):
        LLM(model=str(tiny_llama), kv_cache_memory_bytes=64 * 2**20)
    monkeypatch.setattr(host_memory, "available_bytes", lambda: None)  # unknown: no check
    LLM(model=str(tiny_llama), kv_cache_memory_bytes=64 * 2**20)


def test_available_bytes_reads_the_os():
    from kvserve.runtime.host_memory import available_bytes

    free = available_bytes()
    assert free is None or 0 < free < 2**50
