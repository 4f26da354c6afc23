"""Learned attention sinks (gpt-oss's ``sink_logits``): each head's softmax denominator gains
exp(sink), a key with no value. Checked against a direct computation over the cache, for the
reference backend and the Triton kernels, with and without a sliding window."""

from __future__ import annotations

import pytest
import torch

from kvserve.model.attention.torch_sdpa import TorchAttentionBackend
from tests.unit.attention_meta import mixed_metadata

CHUNKS = [(0, 1), (20, 1), (0, 37), (33, 20), (9, 30)]  # decodes, a fresh prompt, chunks after a prefix
HEADS, KV_HEADS, DIM, BLOCK = 6, 2, 16, 4


def _direct(q, cache, meta, scale, window, sinks):
    """Each query row from its sequence's keys, read position by position through the block table."""
    out = torch.empty_like(q)
    group = HEADS // KV_HEADS
    for i in range(meta.num_seqs):
        start, end, seq_len = meta.query_start[i], meta.query_start[i + 1], meta.seq_lens[i]
        slots = [int(meta.block_tables[i, p // BLOCK]) * BLOCK + p % BLOCK for p in range(seq_len)]
        keys = cache[0].flatten(0, 1)[slots].repeat_interleave(group, 1)  # [L, Hq, D]
        values = cache[1].flatten(0, 1)[slots].repeat_interleave(group, 1)
        for row in range(start, end):
            p = seq_len - (end - row)
            lo = 0 if window is None else max(0, p - window + 1)
            s = torch.einsum("hd,lhd->hl", q[row], keys[lo:p + 1]) * scale  # [Hq, visible]
            top = torch.maximum(s.max(-1).values, sinks)
            w = (s - top[:, None]).exp()
            w = w / (w.sum(-1) + (sinks - top).exp())[:, None]
            out[row] = torch.einsum("hl,lhd->hd", w, values[lo:p + 1])
    return out


def _inputs(seed=0):
    torch.manual_seed(seed)
    meta = mixed_metadata(CHUNKS, BLOCK, num_blocks=64)
    total = meta.query_start[-1]
    q, k, v = torch.randn(total, HEADS, DIM), torch.randn(total, KV_HEADS, DIM), torch.randn(total, KV_HEADS, DIM)
    cache = torch.randn(2, 64, BLOCK, KV_HEADS, DIM)
    sinks = torch.tensor([-2.0, 0.0, 1.0, 3.0, -30.0, 0.5])
    return meta, q, k, v, cache, sinks


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("use_kernels", [True, False])  # the C++ kernels do not add sinks: they must be bypassed
def test_reference_backend_adds_the_sink_to_the_denominator(window, use_kernels):
    meta, q, k, v, cache, sinks = _inputs()
    got = TorchAttentionBackend(use_kernels=use_kernels).forward(q, k, v, cache, meta, DIM**-0.5, window=window,
                                                                 sink_logits=sinks)
    torch.testing.assert_close(got, _direct(q, cache, meta, DIM**-0.5, window, sinks), atol=2e-6, rtol=2e-5)


def test_a_vanishing_sink_is_plain_attention():
    meta, q, k, v, cache, _ = _inputs(1)
    backend = TorchAttentionBackend(use_kernels=False)
    plain = backend.forward(q, k, v, cache.clone(), meta, DIM**-0.5)
    sunk = backend.forward(q, k, v, cache.clone(), meta, DIM**-0.5, sink_logits=torch.full((HEADS,), -1e4))
    torch.testing.assert_close(sunk, plain, atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("window", [None, 7])
def test_triton_kernel_adds_the_sink(window):
    pytest.importorskip("triton")
    from kvserve.model.attention.triton_paged import TritonAttentionBackend

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    meta, q, k, v, cache, sinks = _inputs(2)
    want = _direct(q, _written(cache, k, v, meta), meta, DIM**-0.5, window, sinks)
    fields = {n: (t.to(device) if isinstance(t, torch.Tensor) else t) for n, t in vars(meta).items()}
    got = TritonAttentionBackend().forward(q.to(device), k.to(device), v.to(device), cache.to(device),
                                           type(meta)(**fields), DIM**-0.5, window=window,
                                           sink_logits=sinks.to(device))
    torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=2e-5)


def _written(cache, k, v, meta):
    """The cache after this step's K/V rows are stored at their slots."""
    cache = cache.clone()
    cache[0].view(-1, KV_HEADS, DIM)[meta.slot_mapping] = k
    cache[1].view(-1, KV_HEADS, DIM)[meta.slot_mapping] = v
    return cache
