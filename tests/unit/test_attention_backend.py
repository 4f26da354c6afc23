"""The compiled paged decode kernel agrees with the gather + SDPA reference path."""

from __future__ import annotations

import random

import pytest
import torch

from kvserve.model.attention.backend import AttentionMetadata
from kvserve.model.attention.torch_sdpa import TorchAttentionBackend
from kvserve.model.cpu_kernels import load_kernels as load_cpu_kernels
from tests.unit.attention_meta import mixed_metadata


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


def _assert_same_decode(fast, ref, cache, meta, seqs, heads, kv_heads, dim, dtype, tol):
    """One decode step of random q/k/v through both backends, each on its own copy of the cache."""
    q = torch.randn(seqs, heads, dim).to(dtype)
    k = torch.randn(seqs, kv_heads, dim).to(dtype)
    v = torch.randn(seqs, kv_heads, dim).to(dtype)
    out_fast = fast.forward(q, k, v, cache.clone(), meta, dim**-0.5)
    out_ref = ref.forward(q, k, v, cache.clone(), meta, dim**-0.5)
    torch.testing.assert_close(out_fast.float(), out_ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads, kv_heads", [(8, 2), (4, 4), (6, 1)])
@pytest.mark.parametrize("dim", [32, 48, 64])  # bf16 with dim % 32 == 0 takes the vectorised path
def test_kernel_matches_reference(dtype, tol, heads, kv_heads, dim):
    if load_cpu_kernels() is None:
        pytest.skip("C++ kernels could not be built on this machine")
    torch.manual_seed(0)
    bs = 8
    fast, ref = TorchAttentionBackend(), TorchAttentionBackend(use_kernels=False)
    cache = torch.randn(2, 64, bs, kv_heads, dim).to(dtype)
    # Six sequences: a task per sequence (all its kv heads); two: a task per (sequence, kv head).
    for lens in ([1, 5, 16, 17, 90, 33], [90, 33]):
        meta = _decode_meta(lens, bs, num_blocks=64)
        _assert_same_decode(fast, ref, cache, meta, len(lens), heads, kv_heads, dim, dtype, tol)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads, kv_heads", [(3, 3), (9, 3), (8, 2), (8, 1)])  # GQA groups 1, 3, 4, 8
@pytest.mark.parametrize("dim", [48, 64, 128])
def test_kernel_matches_reference_cache_kinds(kv_cache_dtype, dtype, tol, heads, kv_heads, dim):
    """Every cache kind, contexts of 1 token, not a multiple of the block size or of 16, and 3000+."""
    if load_cpu_kernels() is None:
        pytest.skip("C++ kernels could not be built on this machine")
    torch.manual_seed(0)
    lens, bs = [1, 15, 16, 17, 47, 3001], 16
    num_blocks = sum(-(-n // bs) for n in lens) + 4
    meta = _decode_meta(lens, bs, num_blocks)
    fast = TorchAttentionBackend(kv_cache_dtype=kv_cache_dtype)
    ref = TorchAttentionBackend(use_kernels=False, kv_cache_dtype=kv_cache_dtype)
    cache = fast.allocate_kv_cache(num_blocks, bs, kv_heads, dim, dtype, torch.device("cpu"))
    # Fill every slot with random keys and values (as the cache would hold them), then decode.
    flat = cache.view(2, num_blocks * bs, kv_heads, -1)
    for i in range(2):
        x = (torch.randn(num_blocks * bs, kv_heads, dim) * 2).to(dtype)
        flat[i] = x if fast.kv_format is None else fast.kv_format.quantize(x)
    _assert_same_decode(fast, ref, cache, meta, len(lens), heads, kv_heads, dim, dtype, tol)


@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (8, 1), (4, 4)])  # GQA groups 3, 8 (two score blocks), 1
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("lens", [[3001], [700, 5], [130, 64, 17], [63, 1]])
def test_bf16_kernel_splits_few_sequences(heads, kv_heads, dim, lens):
    """A bf16 cache's kernel cuts the tokens of fewer sequences than two per thread into ranges on
    several threads and merges their softmax states: long and short sequences, odd chunk ends."""
    if load_cpu_kernels() is None:
        pytest.skip("C++ kernels could not be built on this machine")
    torch.manual_seed(0)
    bs = 16
    num_blocks = sum(-(-n // bs) for n in lens) + 4
    meta = _decode_meta(lens, bs, num_blocks)
    cache = (torch.randn(2, num_blocks, bs, kv_heads, dim) * 2).to(torch.bfloat16)
    fast, ref = TorchAttentionBackend(), TorchAttentionBackend(use_kernels=False)
    for threads in (1, 2, 4):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            _assert_same_decode(fast, ref, cache, meta, len(lens), heads, kv_heads, dim, torch.bfloat16, 2e-2)
        finally:
            torch.set_num_threads(before)


def test_kernel_fp8_decodes_every_value():
    """One cached token: the output is its value row, so every e4m3 bit pattern (subnormals too) must
    dequantize exactly as torch's float8_e4m3fn does."""
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("C++ kernels could not be built on this machine")
    dim, patterns = 64, [b for b in range(256) if b & 0x7F != 0x7F]  # all but the NaNs
    rows = torch.tensor(patterns + [0] * (dim * 4 - len(patterns)), dtype=torch.uint8).view(4, dim)
    scale = torch.tensor([0.75], dtype=torch.float16).view(torch.uint8).expand(4, 2)
    cache = torch.zeros(2, 4, 1, 1, dim + 2, dtype=torch.uint8)  # 4 blocks of 1 token, 1 kv head
    cache[1, :, 0, 0] = torch.cat((rows, scale), dim=1)
    q = torch.randn(4, 1, dim)
    out = kernels.paged_decode_attention(q, cache[0], cache[1], torch.arange(4).view(4, 1),
                                         torch.ones(4, dtype=torch.int64), dim**-0.5, 2, 0)
    expected = rows.view(torch.float8_e4m3fn).float() * 0.75
    torch.testing.assert_close(out[:, 0], expected, atol=0, rtol=1e-6)


def _naive_step(q, cache, meta, scale, window):
    """Each query row against its sequence's keys, gathered one position at a time: the semantics."""
    out = torch.empty_like(q)
    bs = meta.block_size
    for i in range(meta.num_seqs):
        start, end, seq_len = meta.query_start[i], meta.query_start[i + 1], meta.seq_lens[i]
        table = meta.block_tables[i]
        for row in range(start, end):
            pos = seq_len - (end - row)
            first = 0 if window is None else max(0, pos - window + 1)
            slots = [int(table[t // bs]) * bs + t % bs for t in range(first, pos + 1)]
            keys = cache[0].flatten(0, 1)[slots].float()  # [L, Hkv, D]
            values = cache[1].flatten(0, 1)[slots].float()
            group = q.shape[1] // keys.shape[1]
            scores = torch.einsum("hd,lhd->hl", q[row].float(), keys.repeat_interleave(group, 1)) * scale
            out[row] = torch.einsum("hl,lhd->hd", scores.softmax(-1), values.repeat_interleave(group, 1)).to(q.dtype)
    return out


@pytest.mark.parametrize("use_kernels", [False, True])
@pytest.mark.parametrize("window", [1, 5, 17, 64])
@pytest.mark.parametrize("dim", [48, 64])  # 48: the scalar decode kernel, 64: the vectorised ones
def test_sliding_window_matches_naive(use_kernels, window, dim):
    """A mixed step (decodes, fresh prompts longer and shorter than the window, chunks after a
    cached prefix) with a sliding window, against attention over each row's last ``window`` keys."""
    if use_kernels and load_cpu_kernels() is None:
        pytest.skip("C++ kernels could not be built on this machine")
    torch.manual_seed(0)
    bs, heads, kv_heads = 4, 6, 2
    chunks = [(0, 1), (30, 1), (0, 37), (33, 20), (9, 1), (70, 3), (3, 2)]
    meta = mixed_metadata(chunks, bs, num_blocks=128)
    backend = TorchAttentionBackend(use_kernels=use_kernels)
    cache = torch.randn(2, 128, bs, kv_heads, dim)
    total = meta.query_start[-1]
    q, k, v = torch.randn(total, heads, dim), torch.randn(total, kv_heads, dim), torch.randn(total, kv_heads, dim)
    out = backend.forward(q, k, v, cache, meta, dim**-0.5, window=window)  # writes k, v into the cache
    torch.testing.assert_close(out, _naive_step(q, cache, meta, dim**-0.5, window), atol=1e-5, rtol=1e-5)
    # a pure decode step too (the kernels' batched decode path)
    decodes = _decode_meta([1, 5, 16, 17, 90, 33], bs, num_blocks=128)
    q = torch.randn(6, heads, dim)
    out = backend.forward(q, torch.randn(6, kv_heads, dim), torch.randn(6, kv_heads, dim), cache, decodes,
                          dim**-0.5, window=window)
    torch.testing.assert_close(out, _naive_step(q, cache, decodes, dim**-0.5, window), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 3, 40])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8"])
@pytest.mark.parametrize("heads, kv_heads, dim", [(9, 3, 64), (8, 2, 128), (4, 4, 64), (8, 1, 64)])
@pytest.mark.parametrize("block_size", [16, 5])
def test_paged_prefill_matches_sdpa(kv_cache_dtype, heads, kv_heads, dim, block_size, window):
    """A bf16 mixed step (decodes, fresh prompts, chunks after a cached prefix, a chunk longer than a
    64-token task) through the paged prefill kernel and through SDPA, each on its own cache copy; a
    quantized cache is dequantized by both as the reference does."""
    kernels = load_cpu_kernels()
    if kernels is None or not kernels.paged_prefill_supported(dim):
        pytest.skip("no paged prefill kernel on this machine (needs AVX512-BF16)")
    torch.manual_seed(0)
    chunks = [(0, 1), (0, 37), (33, 100), (20, 1), (0, 150), (16, 16), (128, 70), (5, 2)]
    num_blocks = 160 if block_size == 16 else 400
    meta = mixed_metadata(chunks, block_size, num_blocks)
    total = meta.query_start[-1]
    q = torch.randn(total, heads, dim).bfloat16()
    k, v = torch.randn(total, kv_heads, dim).bfloat16(), torch.randn(total, kv_heads, dim).bfloat16()
    fast = TorchAttentionBackend(kv_cache_dtype=kv_cache_dtype)
    ref = TorchAttentionBackend(use_kernels=False, kv_cache_dtype=kv_cache_dtype)
    cache = fast.allocate_kv_cache(num_blocks, block_size, kv_heads, dim, torch.bfloat16, torch.device("cpu"))
    flat = cache.view(2, num_blocks * block_size, kv_heads, -1)  # the "cached prefix": random rows
    for i in range(2):
        x = torch.randn(num_blocks * block_size, kv_heads, dim).bfloat16()
        flat[i] = x if fast.kv_format is None else fast.kv_format.quantize(x)
    assert fast._paged_prefill(q, cache)
    out_fast = fast.forward(q, k, v, cache.clone(), meta, dim**-0.5, window=window)
    out_ref = ref.forward(q, k, v, cache.clone(), meta, dim**-0.5, window=window)
    # bf16 outputs and bf16 attention weights (as SDPA rounds them too): a step or two apart
    torch.testing.assert_close(out_fast.float(), out_ref.float(), atol=2e-2, rtol=2e-2)
    assert (out_fast.float() - out_ref.float()).abs().mean() < 2e-3


def _fused_views(tokens: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype):
    """q, k, v as the model makes them: views into one fused qkv output, rows strided."""
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).to(dtype)
    q, k, v = qkv.split((heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)
    return q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim), v.view(tokens, kv_heads, dim)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [16, 40])  # 40: the writer's scalar tail after 16-wide vectors
def test_kernel_writes_the_cache_as_index_copy_does(kv_cache_dtype, dtype, dim):
    """The C++ writer stores the same bytes as KVQuantFormat.quantize + index_copy_: every rounding
    tie, zero row and scale alike (the fused decoder and the eager step share it)."""
    if load_cpu_kernels() is None:
        pytest.skip("C++ kernels could not be built on this machine")
    torch.manual_seed(0)
    num_blocks, bs, kv_heads = 12, 4, 3
    fast = TorchAttentionBackend(kv_cache_dtype=kv_cache_dtype)
    ref = TorchAttentionBackend(use_kernels=False, kv_cache_dtype=kv_cache_dtype)
    cache = fast.allocate_kv_cache(num_blocks, bs, kv_heads, dim, dtype, torch.device("cpu"))
    if fast.kv_format is None:
        cache.copy_(torch.randn(cache.shape).to(dtype))
    _, k, v = _fused_views(7, 9, kv_heads, dim, dtype)
    with torch.no_grad():
        k[0, 1] = 0  # an all-zero row: the smallest scale, zero values
        v.mul_(torch.tensor([1e-3, 1.0, 300.0])[:, None])  # tiny, unit and large rows
        if fast.kv_format is not None:  # a row whose scale is 1/16 exactly, and values on rounding ties
            ties = {"int8": [127.0, 0.5, 1.5, 2.5, -0.5, -3.5, 60.5], "fp8": [448.0, 116.0, -116.0, 17.0, 9.5, -0.75]}
            row = torch.tensor(ties[fast.kv_format.name])
            k[1, 0] = torch.cat([torch.zeros(dim - len(row)), row]) / 16  # ties in the last values
    assert not k.is_contiguous()
    meta = _decode_meta([1] * 7, bs, num_blocks)
    meta.slot_mapping = torch.tensor([5, 0, 47, 12, 13, 30, 2])
    got, want = cache.clone(), cache.clone()
    fast._write(k, v, got, meta)
    ref._write(k, v, want, meta)
    assert torch.equal(got, want) and not torch.equal(got, cache)
    meta.slot_mapping = torch.tensor([5, 0, 48, 12, 13, 30, 2])  # 48 = num_blocks * bs: one past the end
    with pytest.raises(RuntimeError, match="outside the KV cache"):
        fast._write(k, v, got, meta)


def test_paged_prefill_reads_strided_queries():
    """The prefill kernel takes q as the view into the qkv output it is, with the same result as a copy."""
    kernels = load_cpu_kernels()
    if kernels is None or not kernels.paged_prefill_supported(64):
        pytest.skip("no paged prefill kernel on this machine (needs AVX512-BF16)")
    torch.manual_seed(0)
    meta = mixed_metadata([(0, 37), (33, 70), (0, 1)], 16, 40)
    q, k, v = _fused_views(meta.query_start[-1], 9, 3, 64, torch.bfloat16)
    backend = TorchAttentionBackend()
    cache = backend.allocate_kv_cache(40, 16, 3, 64, torch.bfloat16, torch.device("cpu"))
    cache.copy_(torch.randn_like(cache, dtype=torch.float32).bfloat16())
    strided = backend.forward(q, k, v, cache.clone(), meta, 0.125)
    copied = backend.forward(q.contiguous(), k, v, cache.clone(), meta, 0.125)
    assert torch.equal(strided, copied)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, dim", [(9, 3, 64), (8, 2, 128), (4, 4, 64)])
def test_verify_rows_are_bitwise_plain_decode_rows(dtype, heads, kv_heads, dim):
    """A verify step hands the kernel each sequence's last token and proposals as rows sharing its
    block table, with ``split_batch`` = the sequences: row j of every sequence must come out bitwise
    as in the plain decode step of those sequences at that position, so greedy verification emits
    plain decoding's tokens. One sequence (short, or long enough for a bf16 cache to be cut over the
    threads) and two at once; lengths end mid-chunk and cross blocks."""
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("C++ kernels could not be built on this machine")
    torch.manual_seed(0)
    bs, rows = 16, 4
    for firsts in ([40], [3001], [300, 31]):  # each sequence's length at its first verify row
        meta = _decode_meta([n + rows - 1 for n in firsts], bs, num_blocks=sum(-(-n // bs) for n in firsts) + 8)
        cache = (torch.randn(2, meta.block_tables.max().item() + 1, bs, kv_heads, dim) * 2).to(dtype)
        tables = meta.block_tables.repeat_interleave(rows, dim=0).contiguous()
        lens = torch.tensor([n + j for n in firsts for j in range(rows)])
        q = torch.randn(len(lens), heads, dim).to(dtype)
        verify = kernels.paged_decode_attention(q, cache[0], cache[1], tables, lens, dim**-0.5, 0, 0, len(firsts))
        for j in range(rows):  # the plain step in which every sequence decodes its row j
            pick = [i * rows + j for i in range(len(firsts))]
            plain = kernels.paged_decode_attention(q[pick].contiguous(), cache[0], cache[1], meta.block_tables,
                                                   lens[pick], dim**-0.5, 0, 0, 0)
            assert torch.equal(verify[pick], plain), f"lengths {firsts}, row {j}"
