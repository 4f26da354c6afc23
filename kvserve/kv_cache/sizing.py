"""KV-cache arithmetic shared by the engine and the capacity planner, so the two cannot drift."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvserve.config import EngineConfig, ModelConfig

# A quantized cache ("int8", "fp8") stores one byte per value plus a float16 scale per token and head.
KV_QUANT_SCALE_BYTES = {"int8": 2, "fp8": 2}


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: float,
                       scale_bytes: int = 0) -> int:
    """Bytes of K and V one token occupies across all layers (MHA, GQA and MQA alike).

    GQA/MQA enter through ``num_kv_heads``; a quantized cache through ``dtype_bytes`` (e.g. 1 for int8)
    and ``scale_bytes`` per token and head (``KV_QUANT_SCALE_BYTES``).
    """
    return int(2 * num_layers * num_kv_heads * (head_dim * dtype_bytes + scale_bytes))


def kv_element_bytes(kv_cache_dtype: str, model_dtype_bytes: int) -> tuple[int, int]:
    """(bytes per value, scale bytes per token and head) of a ``kv_cache_dtype`` ("auto" = model dtype)."""
    if kv_cache_dtype == "auto":
        return model_dtype_bytes, 0
    if kv_cache_dtype not in KV_QUANT_SCALE_BYTES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} must be 'auto' or one of {sorted(KV_QUANT_SCALE_BYTES)}")
    return 1, KV_QUANT_SCALE_BYTES[kv_cache_dtype]


def num_kv_blocks_for_budget(budget_bytes: int, block_size: int, bytes_per_token: int) -> int:
    """How many whole blocks of ``block_size`` tokens fit in ``budget_bytes``."""
    if bytes_per_token <= 0 or block_size <= 0:
        raise ValueError("bytes_per_token and block_size must be positive")
    return int(budget_bytes // (block_size * bytes_per_token))


def mla_kv_bytes_per_token(num_layers: int, kv_lora_rank: int, qk_rope_head_dim: int, dtype_bytes: float) -> int:
    """Bytes one token occupies in a multi-head latent attention cache (DeepSeek-V2/V3).

    MLA caches one compressed latent that both K and V are rebuilt from, plus the decoupled rotary
    key: no factor 2 and no head count, which is why it is far smaller than even GQA.
    """
    return int(num_layers * (kv_lora_rank + qk_rope_head_dim) * dtype_bytes)


def max_window_blocks(window: int, block_size: int, query_tokens: int = 1) -> int:
    """Most blocks a request holds under a sliding window when every layer slides: a step's
    ``query_tokens`` read the ``window + query_tokens - 1`` positions before and including them, and
    the blocks wholly before those are released (kv_cache/manager.py). A span of L positions touches
    at most ceil((L - 1) / block_size) + 1 blocks, whatever its offset in the first one."""
    if window < 1 or block_size < 1 or query_tokens < 1:
        raise ValueError("window, block_size and query_tokens must be positive")
    return -(-(window + query_tokens - 2) // block_size) + 1


def kv_capacity_tokens(budget_bytes: int, block_size: int, bytes_per_token: int) -> int:
    """Tokens the cache holds: whole blocks only, as the engine allocates them."""
    return num_kv_blocks_for_budget(budget_bytes, block_size, bytes_per_token) * block_size


def model_kv_bytes_per_token(model: ModelConfig, kv_cache_dtype: str, model_dtype_bytes: int) -> int:
    """What one token costs in the engine's cache of ``model``: latents for MLA, else K and V."""
    value_bytes, scale_bytes = kv_element_bytes(kv_cache_dtype, model_dtype_bytes)
    if model.mla is not None:
        if scale_bytes:
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not supported for {model.architecture}'s latent "
                             "cache (multi-head latent attention); use 'auto'")
        return mla_kv_bytes_per_token(model.num_layers, model.mla.kv_lora_rank, model.mla.qk_rope_head_dim,
                                      value_bytes)
    return kv_bytes_per_token(model.num_layers, model.num_kv_heads, model.head_dim, value_bytes, scale_bytes)


@dataclass(frozen=True)
class KVCacheInfo:
    """The engine's paged pool: how many blocks of how many tokens, and what one token costs."""

    num_blocks: int
    block_size: int
    bytes_per_token: int

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size


def size_kv_cache(config: EngineConfig, model: ModelConfig) -> KVCacheInfo:
    """Blocks to preallocate: ``num_kv_blocks`` if given, else as many as the memory budget holds."""
    per_token = model_kv_bytes_per_token(model, config.cache.kv_cache_dtype, config.torch_dtype.itemsize)
    blocks = config.cache.num_kv_blocks or num_kv_blocks_for_budget(
        config.cache.kv_cache_memory_bytes, config.cache.block_size, per_token)
    if blocks < 1:
        raise ValueError(f"kv_cache_memory_bytes={config.cache.kv_cache_memory_bytes} holds no block of "
                         f"{config.cache.block_size} tokens ({per_token} bytes per token)")
    return KVCacheInfo(blocks, config.cache.block_size, per_token)
