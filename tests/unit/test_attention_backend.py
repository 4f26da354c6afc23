"""The compiled paged decode kernel agrees with the gather + SDPA reference path."""

from __future__ import annotations

import random

import pytest
import torch

from kvserve.model.attention.backend import AttentionMetadata
from kvserve.model.attention.cpu_kernels import load_cpu_kernels
from kvserve.model.attention.torch_sdpa import TorchAttentionBackend


def _decode_meta(lens: list[int], block_size: int, num_blocks: int) -> AttentionMetadata:
    rng = random.Random(0)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lens]
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    b = len(lens)
    slots = torch.tensor([bt[i, (n - 1) // block_size] * block_size + (n - 1) % block_size for i, n in enumerate(lens)])
    return AttentionMetadata(num_seqs=b, query_start=list(range(b + 1)), seq_lens=lens, slot_mapping=slots,
                             block_tables=bt, seq_lens_t=torch.tensor(lens), decode_seqs=list(range(b)),
                             prefill_seqs=[], decode_token_index=torch.arange(b), decode_block_tables=bt,
                             decode_seq_lens=torch.tensor(lens), block_size=block_size)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads, kv_heads", [(8, 2), (4, 4), (6, 1)])
@pytest.mark.parametrize("dim", [32, 48, 64])  # bf16 with dim % 32 == 0 takes the vectorised path
def test_kernel_matches_reference(dtype, tol, heads, kv_heads, dim):
    if load_cpu_kernels() is None:
        pytest.skip("C++ kernels could not be built on this machine")
    torch.manual_seed(0)
    lens, bs = [1, 5, 16, 17, 90, 33], 8
    meta = _decode_meta(lens, bs, num_blocks=64)
    fast, ref = TorchAttentionBackend(), TorchAttentionBackend(use_kernels=False)
    cache = torch.randn(2, 64, bs, kv_heads, dim).to(dtype)
    q = torch.randn(len(lens), heads, dim).to(dtype)
    k = torch.randn(len(lens), kv_heads, dim).to(dtype)
    v = torch.randn(len(lens), kv_heads, dim).to(dtype)
    out_fast = fast.forward(q, k, v, cache.clone(), meta, dim**-0.5)
    out_ref = ref.forward(q, k, v, cache.clone(), meta, dim**-0.5)
    torch.testing.assert_close(out_fast.float(), out_ref.float(), atol=tol, rtol=tol)
