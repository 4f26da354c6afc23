"""Reference attention backend in plain PyTorch (CPU, and any device as a fallback).

KV cache layout, per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (K then V) in
the model dtype, or with ``kv_cache_dtype`` "int8" / "fp8" the packed uint8 rows of kv_quant.py
(``head_dim`` one-byte values + a float16 scale per token and head).
On the CPU with the C++ kernels, a step's K/V are written (and quantized) by one call,
``write_kv_cache``, which stores the same bytes as kv_quant.py.
Decodes are batched into one SDPA call over their gathered blocks (or the C++ paged kernel, which
reads quantized rows directly). Prefill chunks in bf16 on a CPU with AMX or AVX512-BF16 go to the C++ paged
prefill kernel, all in one call (it dequantizes int8 / fp8 rows as it packs them); otherwise they
run one sequence at a time through SDPA, reading the cached prefix only when there is one
(dequantizing the gathered blocks for a quantized cache).
A sliding window is a start position per sequence for the C++ kernels; on the SDPA paths it reads
only the blocks from the window's start and masks the positions before it. Soft-capped scores
(Gemma 2) and learned sink logits (gpt-oss) take a plain PyTorch path, one sequence at a time
(neither SDPA nor the kernels cap or add a sink to the softmax), and so do StreamingLLM's attention
sinks, whose sink keys are scored with queries of their own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.model.attention.backend import AttentionMetadata, register_backend
from kvserve.model.attention.kv_quant import kv_quant_format
from kvserve.model.cpu_kernels import load_kernels
from kvserve.runtime.host_memory import zeroed

_KERNEL_KINDS = {None: 0, "int8": 1, "fp8": 2}  # cache kinds of paged_decode.cpp and paged_prefill.cpp


@register_backend("torch")
class TorchAttentionBackend:
    """Decodes use the compiled paged kernel on the CPU when it builds, else a gather + SDPA."""

    name = "torch"
    supports_cuda_graphs = False  # decode shapes follow the longest sequence, a host value

    def __init__(self, use_kernels: bool = True, kv_cache_dtype: str = "auto") -> None:
        self.kernels = load_kernels() if use_kernels else None
        self.kv_format = kv_quant_format(kv_cache_dtype)
        self.kernel_kind = _KERNEL_KINDS[None if self.kv_format is None else self.kv_format.name]
        self._prefill_ok: dict[int, bool] = {}  # head_dim -> the paged prefill kernel serves it

    def allocate_kv_cache(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        if self.kv_format is not None:
            return self.kv_format.allocate(num_blocks, block_size, num_kv_heads, head_dim, device)
        # Zeroed, not empty: padded block-table entries and unwritten slots are read under a mask,
        # and a masked 0 weight times a garbage NaN would still poison the output.
        return zeroed((2, num_blocks, block_size, num_kv_heads, head_dim), dtype, device)

    def fused_cache_kind(self, device: torch.device) -> int | None:
        """The cache kind a fused C++ decode step (models/llama_decode.py) passes to the paged kernel
        for this backend's caches, or None if the kernel does not serve ``device``."""
        if self.kernels is None or device.type != "cpu":
            return None
        return self.kernel_kind

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
        window: int | None = None, softcap: float | None = None, sinks: int = 0, sink_q: torch.Tensor | None = None,
        sink_logits: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D]. Writes k, v into the cache, returns [T, Hq, D]; with
        ``window``, position p attends to positions (p - window, p] only; ``softcap``, ``sinks``,
        ``sink_logits``: see backend.py."""
        self._write(k, v, kv_cache, meta)
        if sinks:
            if sink_logits is not None:
                raise ValueError("attention_sinks (StreamingLLM) cannot be combined with a model's learned "
                                 "sink logits")
            return self._with_sinks(q, sink_q, kv_cache, meta, scale, window, sinks)
        if softcap is not None or sink_logits is not None:  # neither SDPA nor the C++ kernels do these
            return self._eager(q, kv_cache, meta, scale, window, softcap, sink_logits)
        if not meta.prefill_seqs:  # a pure decode step (the common one): every row is a sequence's query
            return self._decode(q, kv_cache, meta, scale, window)
        out = torch.empty_like(q)
        if meta.decode_seqs:
            rows = meta.decode_token_index
            out[rows] = self._decode(q[rows], kv_cache, meta, scale, window)
        if self._paged_prefill(q, kv_cache):  # every prefill chunk in one call, straight from the blocks
            self.kernels.paged_prefill_attention(_heads_contiguous(q), kv_cache[0], kv_cache[1], meta.block_tables,
                                                 meta.seq_lens, meta.query_start, meta.prefill_seqs, scale,
                                                 self.kernel_kind, window or 0, out)
            return out
        k, v = self._as_cached(k), self._as_cached(v)
        for i in meta.prefill_seqs:
            start, end = meta.query_start[i], meta.query_start[i + 1]
            out[start:end] = self._prefill(q[start:end], k[start:end], v[start:end], kv_cache, meta, i, scale, window)
        return out

    def _paged_prefill(self, q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        """Whether the paged prefill kernel serves this call: bf16 queries, a bf16 or int8 / fp8 cache, AVX512-BF16."""
        if self.kernels is None or q.device.type != "cpu" or q.dtype != torch.bfloat16:
            return False
        if self.kv_format is None and kv_cache.dtype != q.dtype:
            return False
        head_dim = q.shape[-1]
        if head_dim not in self._prefill_ok:
            self._prefill_ok[head_dim] = bool(self.kernels.paged_prefill_supported(head_dim))
        return self._prefill_ok[head_dim]

    def _write(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> None:
        """Store k, v at their slots (quantized for an int8 / fp8 cache)."""
        if self.kernels is not None and k.device.type == "cpu":
            # a row per token straight from the qkv output (index_copy_ is slow on these strided views,
            # and quantizing with tensor ops costs ~10 dispatched ops per call); the same bytes either way
            self.kernels.write_kv_cache(_heads_contiguous(k), _heads_contiguous(v), kv_cache, meta.slot_mapping,
                                        self.kernel_kind)
            return
        flat = kv_cache.view(2, -1, *kv_cache.shape[3:])
        if self.kv_format is not None:
            k, v = self.kv_format.quantize(k), self.kv_format.quantize(v)
        flat[0].index_copy_(0, meta.slot_mapping, k)
        flat[1].index_copy_(0, meta.slot_mapping, v)

    def _as_cached(self, x: torch.Tensor) -> torch.Tensor:
        """x as the cache holds it (after quantizing): what attention reads, for every chunk alike."""
        return x if self.kv_format is None else self.kv_format.dequantize(self.kv_format.quantize(x), x.dtype)

    def _gather(self, cache: torch.Tensor, table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Blocks ``table`` of one half (K or V) of the cache, dequantized: [*table.shape, bs, Hkv, D]."""
        blocks = cache[table]
        return blocks if self.kv_format is None else self.kv_format.dequantize(blocks, dtype)

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                window: int | None = None) -> torch.Tensor:
        tables, seq_lens = meta.decode_block_tables, meta.decode_seq_lens  # [B, nb], [B]
        if self.kernels is not None and q.device.type == "cpu":
            return self.kernels.paged_decode_attention(q.contiguous(), kv_cache[0], kv_cache[1], tables, seq_lens,
                                                       scale, self.kernel_kind, window or 0)
        first = 0
        if window is not None:  # gather from the block holding the earliest window start, no further back
            first = max(0, min(meta.seq_lens[i] for i in meta.decode_seqs) - window) // meta.block_size
            tables = tables[:, first:]
        keys = self._gather(kv_cache[0], tables, q.dtype).flatten(1, 2).transpose(1, 2)  # [B, Hkv, L, D]
        values = self._gather(kv_cache[1], tables, q.dtype).flatten(1, 2).transpose(1, 2)
        positions = first * meta.block_size + torch.arange(keys.shape[2], device=q.device)
        visible = positions[None, :] < seq_lens[:, None]
        if window is not None:
            visible &= positions[None, :] >= seq_lens[:, None] - window
        mask = visible[:, None, None, :]  # [B, 1, 1, L]
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys, values, attn_mask=mask, scale=scale, enable_gqa=True
        )  # [B, Hq, 1, D]
        return out.squeeze(2)

    def _prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, i: int,
        scale: float, window: int | None = None,
    ) -> torch.Tensor:
        num_new, seq_len = q.shape[0], meta.seq_lens[i]
        q_t = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        # Query j sits at position seq_len - num_new + j and sees keys up to and including itself
        # (and, with a window, none at or before its position - window).
        q_pos = torch.arange(seq_len - num_new, seq_len, device=q.device)
        if seq_len == num_new:  # nothing cached before this chunk: attend to the chunk itself
            keys, values = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
            if window is None or window >= num_new:
                out = F.scaled_dot_product_attention(q_t, keys, values, is_causal=True, scale=scale, enable_gqa=True)
                return out[0].transpose(0, 1)
            out = F.scaled_dot_product_attention(q_t, keys, values, attn_mask=_causal_mask(q_pos, q_pos, window),
                                                 scale=scale, enable_gqa=True)
            return out[0].transpose(0, 1)
        first = 0 if window is None else max(0, seq_len - num_new - window + 1) // meta.block_size
        num_blocks = -(-seq_len // meta.block_size)
        table = meta.block_tables[i, first:num_blocks]
        key_pos = torch.arange(first * meta.block_size, seq_len, device=q.device)
        keys = self._gather(kv_cache[0], table, q.dtype).flatten(0, 1)[:len(key_pos)].transpose(0, 1).unsqueeze(0)
        values = self._gather(kv_cache[1], table, q.dtype).flatten(0, 1)[:len(key_pos)].transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(q_t, keys, values, attn_mask=_causal_mask(q_pos, key_pos, window),
                                             scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1)


    def _eager(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
               window: int | None, softcap: float | None, sink_logits: torch.Tensor | None) -> torch.Tensor:
        """Every sequence's rows as transformers' eager attention computes them: scores scaled, capped,
        masked, a float32 softmax (over the keys and, with ``sink_logits``, a valueless sink per head)
        cast back to the query dtype, times the values."""
        out = torch.empty_like(q)
        bs = meta.block_size
        for i in range(meta.num_seqs):
            start, end, seq_len = meta.query_start[i], meta.query_start[i + 1], meta.seq_lens[i]
            num_new = end - start
            first = 0 if window is None else max(0, seq_len - num_new - window + 1) // bs
            table = meta.block_tables[i, first:-(-seq_len // bs)]
            key_pos = torch.arange(first * bs, seq_len, device=q.device)
            keys = self._gather(kv_cache[0], table, q.dtype).flatten(0, 1)[:len(key_pos)].transpose(0, 1)
            values = self._gather(kv_cache[1], table, q.dtype).flatten(0, 1)[:len(key_pos)].transpose(0, 1)
            group = q.shape[1] // keys.shape[0]
            keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)  # [Hq, L, D]
            scores = torch.matmul(q[start:end].transpose(0, 1), keys.transpose(1, 2)) * scale  # [Hq, n, L]
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            mask = _causal_mask(torch.arange(seq_len - num_new, seq_len, device=q.device), key_pos, window)
            scores = scores.masked_fill(~mask, float("-inf"))
            if sink_logits is not None:  # the sink joins the denominator and is dropped: it has no value
                sink = sink_logits.to(scores.dtype)[:, None, None].expand(-1, num_new, 1)
                probs = torch.cat((scores, sink), dim=-1).softmax(-1, dtype=torch.float32)[..., :-1].to(q.dtype)
            else:
                probs = scores.softmax(-1, dtype=torch.float32).to(q.dtype)
            out[start:end] = torch.matmul(probs, values).transpose(0, 1)
        return out


    def _with_sinks(self, q: torch.Tensor, sink_q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, window: int, sinks: int) -> torch.Tensor:
        """Each query at p sees positions [0, sinks) and (p - window, p]; once p >= sinks + window
        (the window has left the sinks behind) it scores the sink keys with its ``sink_q`` row."""
        out = torch.empty_like(q)
        bs = meta.block_size
        sink_blocks = -(-sinks // bs)
        for i in range(meta.num_seqs):
            start, end, seq_len = meta.query_start[i], meta.query_start[i + 1], meta.seq_lens[i]
            num_new, num_blocks = end - start, -(-seq_len // bs)
            first = max(sink_blocks, max(0, seq_len - num_new - window + 1) // bs)  # released blocks lie between
            blocks = torch.cat((torch.arange(min(sink_blocks, num_blocks)), torch.arange(first, num_blocks)))
            key_pos = (blocks[:, None] * bs + torch.arange(bs)[None, :]).reshape(-1).to(q.device)
            table = meta.block_tables[i, blocks.to(meta.block_tables.device)]
            keys = self._gather(kv_cache[0], table, q.dtype).flatten(0, 1).transpose(0, 1)  # [Hkv, L, D]
            values = self._gather(kv_cache[1], table, q.dtype).flatten(0, 1).transpose(0, 1)
            group = q.shape[1] // keys.shape[0]
            keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)  # [Hq, L, D]
            q_pos = torch.arange(seq_len - num_new, seq_len, device=q.device)
            scores = torch.matmul(q[start:end].transpose(0, 1), keys.transpose(1, 2)) * scale  # [Hq, n, L]
            sink_scores = torch.matmul(sink_q[start:end].transpose(0, 1), keys.transpose(1, 2)) * scale
            is_sink = key_pos[None, :] < sinks
            scores = torch.where(is_sink & (q_pos[:, None] >= sinks + window), sink_scores, scores)
            visible = (key_pos[None, :] <= q_pos[:, None]) & (is_sink | (key_pos[None, :] > q_pos[:, None] - window))
            probs = scores.masked_fill(~visible, float("-inf")).softmax(-1, dtype=torch.float32).to(q.dtype)
            out[start:end] = torch.matmul(probs, values).transpose(0, 1)
        return out


def _causal_mask(q_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[queries, keys] True where the query at ``q_pos`` may see the key at ``key_pos``."""
    mask = key_pos[None, :] <= q_pos[:, None]
    if window is not None:
        mask &= key_pos[None, :] > q_pos[:, None] - window
    return mask


def _heads_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] with each row's heads contiguous, as the C++ kernels read it; rows may be strided
    (views into the fused qkv output are, and copying them costs a visible share of a prefill step)."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()
