"""The attention backend seam: the only place that knows how KV blocks are laid out and read.

The model calls ``backend.forward(q, k, v, kv_cache, metadata)`` for every layer. The worker
builds one ``AttentionMetadata`` per step describing the flat, unpadded batch. The CUDA backend
(triton_paged.py) implements the same methods and registers itself; nothing in the scheduler,
worker or model changes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    """One step's batch, flattened: sequence ``i`` owns query rows ``query_start[i]:query_start[i+1]``.

    ``seq_lens[i]`` counts the tokens in the cache after this step (cached prefix + new chunk);
    ``slot_mapping[t]`` is where token ``t``'s K/V is written in the flat cache.
    """

    num_seqs: int
    query_start: list[int]  # host copy, len num_seqs + 1
    seq_lens: list[int]  # host copy
    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64, padded with 0
    seq_lens_t: torch.Tensor  # [num_seqs] int64, on device
    decode_seqs: list[int]  # sequences with exactly one query token
    prefill_seqs: list[int]  # sequences with several query tokens
    decode_token_index: torch.Tensor  # [len(decode_seqs)] rows of q for the decodes
    decode_block_tables: torch.Tensor  # [len(decode_seqs), blocks of the longest decode]
    decode_seq_lens: torch.Tensor  # [len(decode_seqs)] int64
    block_size: int
    query_start_t: torch.Tensor | None = None  # [num_seqs + 1] int64 on device; built on first use if None
    # A hybrid model's KV groups 1..: the same batch with those groups' slots and block tables
    group_metas: tuple[AttentionMetadata, ...] = ()

    def of_group(self, group: int) -> AttentionMetadata:
        """The metadata a layer of KV group ``group`` reads (group 0: this one)."""
        return self.group_metas[group - 1] if group else self

    @property
    def max_query_len(self) -> int:
        return max((b - a for a, b in zip(self.query_start, self.query_start[1:])), default=0)

    def query_start_device(self) -> torch.Tensor:
        if self.query_start_t is None:
            self.query_start_t = torch.tensor(self.query_start, dtype=torch.long, device=self.slot_mapping.device)
        return self.query_start_t


class AttentionBackend(Protocol):
    """What a backend provides; see ``TorchAttentionBackend`` for the reference semantics."""

    name: str
    supports_cuda_graphs: bool  # a pure decode step may be captured and replayed (no host values in launches)

    def allocate_kv_cache(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor: ...

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
        window: int | None = None, softcap: float | None = None, sinks: int = 0, sink_q: torch.Tensor | None = None,
        sink_logits: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Writes k, v into the cache and returns causal attention of q over each sequence's cached
        tokens; with ``window``, query position p sees only positions (p - window, p] (a sliding
        window, as transformers applies it), so KV before a sequence's window is never read. With
        ``softcap`` (Gemma 2) the scaled scores s become softcap * tanh(s / softcap) before the softmax.
        With ``sinks`` (attention sinks, the torch backend only) p also sees positions [0, sinks),
        scored with ``sink_q`` (the queries rotated to the cache's last place) once p >= sinks + window.
        ``sink_logits`` [Hq] (gpt-oss's learned sinks, unrelated to ``sinks``): head h's softmax
        denominator gains exp(sink_logits[h]), a key with no value, so its weights sum to under 1."""

    def fused_cache_kind(self, device: torch.device) -> int | None:
        """The paged-cache kind a fused C++ decode step may read and write directly, or None."""


_BACKENDS: dict[str, Callable[..., AttentionBackend]] = {}


def register_backend(name: str) -> Callable:
    def wrap(factory: Callable[..., AttentionBackend]) -> Callable[..., AttentionBackend]:
        _BACKENDS[name] = factory
        return factory

    return wrap


def get_backend(device: torch.device, kv_cache_dtype: str = "auto", name: str = "auto") -> AttentionBackend:
    """The attention backend for a device.

    ``name`` "auto" picks the device's best: the Triton backend ("cuda") on CUDA, else "torch".
    "triton" asks for the Triton kernels anywhere (on the CPU only under TRITON_INTERPRET=1, which
    the tests use); "torch" is the reference path. ``kv_cache_dtype`` "int8" / "fp8" selects a
    quantized cache (kv_quant.py); a factory is called as ``factory(kv_cache_dtype=...)``.
    """
    from kvserve.model.attention import torch_sdpa  # noqa: F401  (registers "torch")

    use_triton = name == "triton" or (name == "auto" and device.type == "cuda")
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("attention_backend='triton' needs a CUDA device (or TRITON_INTERPRET=1 to interpret "
                         "the kernels on the CPU, which only tests should do)")
    if use_triton:
        try:
            from kvserve.model.attention import triton_paged  # noqa: F401  (registers "cuda")
        except ImportError as e:
            if name == "triton":
                raise ValueError(f"attention_backend='triton' needs the triton package: {e}") from e
            use_triton = False  # "auto" on CUDA without triton: the PyTorch path
    return _BACKENDS["cuda" if use_triton else "torch"](kv_cache_dtype=kv_cache_dtype)
