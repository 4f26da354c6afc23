"""Multi-head latent attention (DeepSeek-V2) over a paged latent cache, in PyTorch.

Cache layout, per layer: ``[1, num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]``: each
token's compressed latent c (after its RMSNorm), then its rotated key k_r, which every head shares.
No per-head K or V is stored. The leading plane of one keeps the engine's block copy
(``cache[:, dst] = cache[:, src]``) as it is for K/V caches.

Head h's key is [W_UK[h] c ; k_r] and its value W_UV[h] c, where ``kv_b`` = [W_UK; W_UV] per head.
A decode absorbs the up-projections: q_nope W_UK[h] is scored against c itself, and the softmax's
weighted sum of latents goes through W_UV[h] afterwards, so it reads only the latents. A prefill
chunk (several queries of one sequence) expands its sequence's latents to per-head keys and values
once and attends with SDPA, which costs fewer multiplications per score than the absorbed form.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.model.attention.backend import AttentionMetadata
from kvserve.runtime.host_memory import zeroed


def allocate_latent_cache(num_blocks: int, block_size: int, width: int, dtype: torch.dtype,
                          device: torch.device) -> torch.Tensor:
    """One layer's cache; zeroed, since padded block-table entries are read under a mask (as torch_sdpa.py)."""
    return zeroed((1, num_blocks, block_size, width), dtype, device)


def write_latents(cache: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store each token's [latent ; rotary key] ([T, rank], [T, rope]) at its slot."""
    cache[0].view(-1, cache.shape[-1]).index_copy_(0, slot_mapping, torch.cat((latent, k_rope), dim=-1))


def mla_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                  scale: float, kv_b: torch.Tensor, v_head_dim: int) -> torch.Tensor:
    """Causal attention of every query over its sequence's cached latents (this step's already
    written). q_nope: [T, H, nope]; q_rope: [T, H, rope], rotated; kv_b: [H * (nope + v), rank].
    Returns [T, H, v]."""
    heads, nope = q_nope.shape[1], q_nope.shape[2]
    w_uk, w_uv = kv_b.view(heads, nope + v_head_dim, -1).split((nope, v_head_dim), dim=1)
    if not meta.prefill_seqs:
        return _decode(q_nope, q_rope, cache, meta, scale, w_uk, w_uv)
    out = q_nope.new_empty(q_nope.shape[0], heads, v_head_dim)
    if meta.decode_seqs:
        rows = meta.decode_token_index
        out[rows] = _decode(q_nope[rows], q_rope[rows], cache, meta, scale, w_uk, w_uv)
    for i in meta.prefill_seqs:
        start, end = meta.query_start[i], meta.query_start[i + 1]
        out[start:end] = _prefill(q_nope[start:end], q_rope[start:end], cache, meta, i, scale, kv_b, v_head_dim)
    return out


def _decode(q_nope: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float,
            w_uk: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """One query per sequence, the up-projections absorbed: scores q_nope W_UK . c + q_rope . k_r."""
    rank = w_uk.shape[-1]
    q = torch.cat((torch.einsum("bhn,hnr->bhr", q_nope, w_uk), q_rope), dim=-1)  # [B, H, rank + rope]
    cached = cache[0][meta.decode_block_tables].flatten(1, 2)  # [B, L, rank + rope]
    scores = torch.matmul(q, cached.transpose(1, 2)) * scale  # [B, H, L]
    positions = torch.arange(cached.shape[1], device=q.device)
    visible = positions[None, :] < meta.decode_seq_lens[:, None]
    probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1, dtype=torch.float32).to(q.dtype)
    latents = torch.matmul(probs, cached[..., :rank])  # [B, H, rank]
    return torch.einsum("bhr,hvr->bhv", latents, w_uv)


def _prefill(q_nope: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, i: int,
             scale: float, kv_b: torch.Tensor, v_head_dim: int) -> torch.Tensor:
    """Sequence ``i``'s chunk of queries over its cached latents, expanded to per-head keys and values."""
    num_new, seq_len = q_nope.shape[0], meta.seq_lens[i]
    heads, nope, rope = q_nope.shape[1], q_nope.shape[2], q_rope.shape[2]
    table = meta.block_tables[i, :-(-seq_len // meta.block_size)]
    cached = cache[0][table].flatten(0, 1)[:seq_len]  # [L, rank + rope]
    latent, k_rope = cached.split((cached.shape[1] - rope, rope), dim=-1)
    k_nope, values = F.linear(latent, kv_b).view(seq_len, heads, nope + v_head_dim).split((nope, v_head_dim), -1)
    keys = torch.cat((k_nope, k_rope[:, None, :].expand(seq_len, heads, rope)), dim=-1)
    q = torch.cat((q_nope, q_rope), dim=-1)
    # query j sits at position seq_len - num_new + j and sees the keys up to and including itself
    q_pos = torch.arange(seq_len - num_new, seq_len, device=q.device)
    mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                                         attn_mask=mask, scale=scale)
    return out.transpose(0, 1)
