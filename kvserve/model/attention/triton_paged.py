"""CUDA attention backend: two Triton kernels over the paged KV cache.

- ``_store_kv``: writes this step's K and V rows at their slots (one program per token; a slot of
  -1 is skipped, which is how padded rows of a captured CUDA graph write nothing).
- ``_paged_attention``: one kernel for prefill chunks and decodes alike. A program owns one
  sequence, one tile of its query tokens and one kv head; its rows are (query token, query head of
  that kv head's group) pairs, so a decode's GQA group fills the rows of one matrix product. It walks
  the sequence's keys tile by tile through the block table with an online softmax, stopping at the
  tile's last query position (causal), and reads the cached prefix and the new chunk the same way:
  K/V are stored before attention runs, so chunked prefill, prefix-cache hits and speculative
  verification need no special case.

Nothing in the launch depends on host values in a pure decode step (the key loop's bound is read
from ``seq_lens`` on the device), so a decode step can be captured in a CUDA graph and replayed
with new contents in the same buffers.

Same cache layout and semantics as ``TorchAttentionBackend`` (the reference the tests compare
with): ``[2, num_blocks, block_size, num_kv_heads, head_dim]``. Quantized caches (int8 / fp8) are
served by the reference backend's PyTorch path on CUDA.

The tests run these kernels on the CPU through Triton's interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.model.attention.backend import AttentionMetadata, register_backend
from kvserve.model.attention.torch_sdpa import TorchAttentionBackend

_ROWS = 64  # query rows (tokens x group heads) per prefill program
_TILE = 64  # keys per inner-loop step


@triton.jit
def _store_kv(key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
              kv_stride_t, cache_stride_slot,
              ROW: tl.constexpr, ROW_PAD: tl.constexpr):
    """K/V rows of token t ([Hkv * D] each, contiguous) go to slot ``slot_ptr[t]`` unless it is < 0."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        cols = tl.arange(0, ROW_PAD)
        ok = cols < ROW
        k = tl.load(key_ptr + t * kv_stride_t + cols, mask=ok)
        v = tl.load(value_ptr + t * kv_stride_t + cols, mask=ok)
        tl.store(key_cache_ptr + slot * cache_stride_slot + cols, k, mask=ok)
        tl.store(value_cache_ptr + slot * cache_stride_slot + cols, v, mask=ok)


@triton.jit
def _paged_attention(
    out_ptr, q_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr, sink_ptr,
    scale,
    q_stride_t, q_stride_h, out_stride_t, out_stride_h,
    cache_stride_block, cache_stride_tok, cache_stride_head, table_stride,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    TOKENS: tl.constexpr, ROWS: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr, WINDOW: tl.constexpr,
    SINKS: tl.constexpr,
):
    seq = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_first = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_first
    if q_tile * TOKENS < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        context = seq_len - q_len  # tokens cached before this step's chunk

        rows = tl.arange(0, ROWS)
        tok = q_tile * TOKENS + rows // GROUP  # query token of each row, within the chunk
        head = kv_head * GROUP + rows % GROUP
        row_ok = (rows < TOKENS * GROUP) & (tok < q_len)
        dims = tl.arange(0, DIM_PAD)
        dim_ok = dims < HEAD_DIM
        q = tl.load(q_ptr + (q_first + tok)[:, None] * q_stride_t + head[:, None] * q_stride_h + dims[None, :],
                    mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        q_pos = context + tok
        kv_end = tl.minimum(context + (q_tile + 1) * TOKENS, seq_len)  # this tile's last query sees up to here

        # A finite start for the running max: fully masked rows (padding) stay at 0 instead of NaN.
        m_i = tl.full([ROWS], -1.0e30, tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        if SINKS:  # a learned sink logit per head: the softmax starts with it as a key with no value
            m_i = tl.load(sink_ptr + head, mask=row_ok, other=-1.0e30).to(tl.float32)
            l_i = tl.where(row_ok, 1.0, 0.0)
        acc = tl.zeros([ROWS, DIM_PAD], tl.float32)
        cols = tl.arange(0, TILE)
        kv_begin = 0
        if WINDOW > 0:  # a sliding window: the tile's first query sees nothing before here
            kv_begin = tl.maximum(context + q_tile * TOKENS - WINDOW + 1, 0)
        for start in range(kv_begin, kv_end, TILE):
            pos = start + cols
            pos_ok = pos < kv_end
            block = tl.load(block_tables_ptr + seq * table_stride + pos // BLOCK_SIZE, mask=pos_ok, other=0)
            offs = block.to(tl.int64) * cache_stride_block + (pos % BLOCK_SIZE) * cache_stride_tok \
                + kv_head * cache_stride_head
            k = tl.load(key_cache_ptr + offs[None, :] + dims[:, None], mask=pos_ok[None, :] & dim_ok[:, None],
                        other=0.0)  # [DIM_PAD, TILE]
            s = tl.dot(q, k, input_precision=PRECISION) * scale
            visible = (pos[None, :] <= q_pos[:, None]) & pos_ok[None, :]
            if WINDOW > 0:
                visible = visible & (pos[None, :] > q_pos[:, None] - WINDOW)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(value_cache_ptr + offs[:, None] + dims[None, :], mask=pos_ok[:, None] & dim_ok[None, :],
                        other=0.0)  # [TILE, DIM_PAD]
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        out = acc / tl.maximum(l_i, 1.0e-30)[:, None]
        tl.store(out_ptr + (q_first + tok)[:, None] * out_stride_t + head[:, None] * out_stride_h + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(n))


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v [T, Hkv, D] into the cache at ``slot_mapping`` [T] (slots < 0 are skipped)."""
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    k, v = k.reshape(num_tokens, -1), v.reshape(num_tokens, -1)
    if k.stride(1) != 1 or v.stride(1) != 1 or k.stride(0) != v.stride(0):
        k, v = k.contiguous(), v.contiguous()
    row = k.shape[1]
    _store_kv[(num_tokens,)](k, v, kv_cache[0], kv_cache[1], slot_mapping, k.stride(0), row,
                             ROW=row, ROW_PAD=triton.next_power_of_2(row))


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start: torch.Tensor, max_query_len: int, scale: float,
                    out: torch.Tensor | None = None, window: int | None = None,
                    sink_logits: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of the flat queries q [T, Hq, D] over each sequence's cached keys (with
    ``window``, position p sees positions (p - window, p] only; with ``sink_logits`` [Hq], each
    head's softmax denominator also counts exp(sink), backend.py).

    Sequence i owns query rows ``query_start[i]:query_start[i + 1]``, the last of its
    ``seq_lens[i]`` cached tokens; ``block_tables`` [num_seqs, width] maps its positions to blocks.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    if q.stride(2) != 1:
        q = q.contiguous()
    tokens = 1 if max_query_len == 1 else max(1, _ROWS // group)
    rows = _pow2(tokens * group)
    num_seqs = seq_lens.shape[0]
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    grid = (num_seqs, triton.cdiv(max_query_len, tokens), num_kv_heads)
    _paged_attention[grid](
        out, q, key_cache, value_cache, block_tables, seq_lens, query_start,
        q if sink_logits is None else sink_logits, scale,  # q: a placeholder pointer the kernel never reads
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0),
        GROUP=group, BLOCK_SIZE=block_size, HEAD_DIM=head_dim, DIM_PAD=_pow2(head_dim),
        TOKENS=tokens, ROWS=rows, TILE=_TILE,
        # float32 products in full precision (Triton's default for them is TF32, ~1e-3 relative):
        # a float32 model must match its float32 reference.
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        WINDOW=window or 0, SINKS=sink_logits is not None,
    )
    return out


class TritonAttentionBackend:
    """Paged attention in Triton for a model-dtype cache; the reference semantics of TorchAttentionBackend."""

    name = "triton"
    supports_cuda_graphs = True  # a decode step's launches read only device buffers (not soft-capped models':
    # their attention takes the reference path, see forward; the runner captures no graphs for them)

    def __init__(self) -> None:
        self._reference = TorchAttentionBackend(use_kernels=False)

    def allocate_kv_cache(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                          dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self._reference.allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device)

    def fused_cache_kind(self, device: torch.device) -> int | None:
        return None  # the fused decode step is the CPU's

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, window: int | None = None,
                softcap: float | None = None, sink_logits: torch.Tensor | None = None) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D]. Writes k, v into the cache, returns [T, Hq, D]."""
        if softcap is not None:  # soft-capped scores (Gemma 2): the reference path, which reads the host lists
            return self._reference.forward(q, k, v, kv_cache, meta, scale, window=window, softcap=softcap,
                                           sink_logits=sink_logits)
        store_kv(k, v, kv_cache, meta.slot_mapping)
        return paged_attention(q, kv_cache, meta.block_tables, meta.seq_lens_t, meta.query_start_device(),
                               meta.max_query_len, scale, window=window, sink_logits=sink_logits)


@register_backend("cuda")
def cuda_backend(kv_cache_dtype: str = "auto"):
    """Triton kernels for a model-dtype cache; the PyTorch reference path for int8 / fp8 caches."""
    if kv_cache_dtype == "auto":
        return TritonAttentionBackend()
    return TorchAttentionBackend(use_kernels=False, kv_cache_dtype=kv_cache_dtype)
