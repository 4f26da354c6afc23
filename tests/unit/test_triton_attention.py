"""The CUDA backend's Triton kernels agree with the PyTorch reference backend.

Without a GPU the kernels run in Triton's interpreter (conftest.py sets ``TRITON_INTERPRET=1``),
which executes the same kernel code on CPU tensors. bfloat16 is not supported by the interpreter,
so the CPU runs check float32 and float16 and a GPU run adds bfloat16.
"""

from __future__ import annotations

import pytest
import torch

from kvserve.model.attention.backend import AttentionMetadata
from kvserve.model.attention.torch_sdpa import TorchAttentionBackend
from tests.unit.attention_meta import mixed_metadata

pytest.importorskip("triton")

_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

_DTYPES = [(torch.float32, 2e-5), (torch.float16, 2e-3)] + ([(torch.bfloat16, 2e-2)] if _DEVICE.type == "cuda" else [])


@pytest.fixture(scope="module")
def triton_paged():
    import kvserve.model.attention.triton_paged as module

    return module


def _to(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    fields = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in vars(meta).items()}
    return AttentionMetadata(**fields)


@pytest.mark.parametrize("dtype, tol", _DTYPES)
@pytest.mark.parametrize("heads, kv_heads, dim", [(4, 4, 64), (9, 3, 64), (8, 2, 48), (8, 1, 32)])
@pytest.mark.parametrize("block_size", [16, 5])
def test_mixed_step_matches_reference(triton_paged, dtype, tol, heads, kv_heads, dim, block_size):
    """Decodes, a fresh prompt, a chunk after a cached prefix (block-aligned or not) in one launch."""
    torch.manual_seed(0)
    chunks = [(0, 1), (20, 1), (0, 37), (33, 20), (16, 16), (70, 1), (9, 70)]
    meta = mixed_metadata(chunks, block_size, num_blocks=96)
    total = meta.query_start[-1]
    q = torch.randn(total, heads, dim).to(dtype)
    k = torch.randn(total, kv_heads, dim).to(dtype)
    v = torch.randn(total, kv_heads, dim).to(dtype)
    cache = torch.randn(2, 96, block_size, kv_heads, dim).to(dtype)  # the "cached prefix" is whatever is there

    ref_cache = cache.clone()
    expected = TorchAttentionBackend(use_kernels=False).forward(q, k, v, ref_cache, meta, dim**-0.5)
    backend = triton_paged.TritonAttentionBackend()
    got_cache = cache.clone().to(_DEVICE)
    got = backend.forward(q.to(_DEVICE), k.to(_DEVICE), v.to(_DEVICE), got_cache, _to(meta, _DEVICE), dim**-0.5)
    torch.testing.assert_close(got_cache.cpu(), ref_cache, atol=0, rtol=0)
    torch.testing.assert_close(got.cpu().float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype, tol", _DTYPES[:1])
def test_pure_decode_matches_reference(triton_paged, dtype, tol):
    """The decode launch (one query token per sequence, GQA group in the rows) over long contexts."""
    torch.manual_seed(1)
    chunks = [(n - 1, 1) for n in (1, 2, 63, 64, 65, 200, 129)]
    meta = mixed_metadata(chunks, 16, num_blocks=64, seed=3)
    q, kv = torch.randn(7, 6, 64).to(dtype), torch.randn(2, 7, 2, 64).to(dtype)
    cache = torch.randn(2, 64, 16, 2, 64).to(dtype)
    expected = TorchAttentionBackend(use_kernels=False).forward(q, kv[0], kv[1], cache.clone(), meta, 0.125)
    got = triton_paged.TritonAttentionBackend().forward(q.to(_DEVICE), kv[0].to(_DEVICE), kv[1].to(_DEVICE),
                                                        cache.clone().to(_DEVICE), _to(meta, _DEVICE), 0.125)
    torch.testing.assert_close(got.cpu(), expected, atol=tol, rtol=tol)


def test_store_skips_negative_slots(triton_paged):
    """Padded rows of a captured decode graph carry slot -1 and must not write anywhere."""
    cache = torch.zeros(2, 4, 4, 2, 8, device=_DEVICE)
    k = torch.arange(3 * 16, dtype=torch.float32, device=_DEVICE).view(3, 2, 8) + 1
    triton_paged.store_kv(k, -k, cache, torch.tensor([5, -1, 0], device=_DEVICE))
    flat = cache.view(2, 16, 2, 8)
    assert torch.equal(flat[0, 5], k[0]) and torch.equal(flat[1, 0], -k[2])
    assert int((flat != 0).any(dim=(-1, -2)).sum()) == 4  # two slots in each half, nothing else


def test_quantized_cache_uses_reference_path(triton_paged):
    assert isinstance(triton_paged.cuda_backend(kv_cache_dtype="int8"), TorchAttentionBackend)
    assert isinstance(triton_paged.cuda_backend(), triton_paged.TritonAttentionBackend)
