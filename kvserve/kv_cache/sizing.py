"""KV-cache arithmetic shared by the engine and the capacity planner, so the two cannot drift."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvserve.config import EngineConfig, ModelConfig
    from kvserve.kv_cache.groups import KVLayout

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


def kv_layers_per_block(kind_layers: list[int]) -> int:
    """Layers one block holds in a hybrid model (kv_cache/groups.py): the gcd of each kind's layer
    count (e.g. [full layers, window layers]), so every group has as many and none is padding."""
    if not kind_layers or min(kind_layers) < 1:
        raise ValueError(f"layer counts {kind_layers} must be positive")
    return math.gcd(*kind_layers)


def kv_num_groups(kind_layers: list[int]) -> int:
    """KV groups (block tables per request) of a model with these per-kind layer counts."""
    return sum(kind_layers) // kv_layers_per_block(kind_layers)


def num_kv_blocks_for_budget(budget_bytes: int, block_size: int, bytes_per_token: int, num_groups: int = 1) -> int:
    """How many whole blocks of ``block_size`` tokens fit in ``budget_bytes``; with ``num_groups``
    KV groups a block holds 1 / num_groups of the layers (``bytes_per_token`` counts them all)."""
    if bytes_per_token <= 0 or block_size <= 0 or num_groups <= 0:
        raise ValueError("bytes_per_token, block_size and num_groups must be positive")
    return int(budget_bytes // kv_block_bytes(block_size, bytes_per_token, num_groups))


def kv_block_bytes(block_size: int, bytes_per_token: int, num_groups: int = 1) -> int:
    """Bytes of one block: ``block_size`` tokens of one group's layers (exact: groups are equal)."""
    return block_size * bytes_per_token // num_groups


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


def kv_capacity_tokens(budget_bytes: int, block_size: int, bytes_per_token: int, num_groups: int = 1) -> int:
    """Tokens the cache holds with every layer's KV kept (a token takes a block slot in each group):
    whole blocks only, as the engine allocates them."""
    blocks = num_kv_blocks_for_budget(budget_bytes, block_size, bytes_per_token, num_groups)
    return blocks // num_groups * block_size


def max_sequence_blocks(num_blocks: int, num_full_groups: int, num_window_groups: int,
                        window_blocks: int) -> int | None:
    """The most blocks per group one sequence can grow to in a pool of ``num_blocks``, when each
    window group holds at most ``window_blocks`` (max_window_blocks); None: length is no limit
    (every group windowed, and the windows fit)."""
    groups = num_full_groups + num_window_groups
    if num_window_groups * window_blocks > num_blocks:
        return num_blocks // groups  # the windows do not fit: count every group in full
    if not num_full_groups:
        return None
    # a short sequence takes a block in every group; past the window only the full groups grow
    return max(num_blocks // groups, (num_blocks - num_window_groups * window_blocks) // num_full_groups)


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
    """The engine's paged pool: how many blocks of how many tokens, and what one token costs (all
    layers); with ``num_groups`` KV groups a block holds one group's layers (kv_cache/groups.py)."""

    num_blocks: int
    block_size: int
    bytes_per_token: int
    num_groups: int = 1

    @property
    def capacity_tokens(self) -> int:
        """Tokens the pool holds with every layer's KV kept (nothing released behind a window)."""
        return self.num_blocks // self.num_groups * self.block_size

    @property
    def block_bytes(self) -> int:
        return kv_block_bytes(self.block_size, self.bytes_per_token, self.num_groups)

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.block_bytes


def size_kv_cache(config: EngineConfig, model: ModelConfig, layout: KVLayout | None = None) -> KVCacheInfo:
    """Blocks to preallocate: ``num_kv_blocks`` if given, else as many as the memory budget holds
    (blocks of ``layout``'s layers per block; by default one group of every layer)."""
    per_token = model_kv_bytes_per_token(model, config.cache.kv_cache_dtype, config.torch_dtype.itemsize)
    groups = layout.num_groups if layout is not None else 1
    blocks = config.cache.num_kv_blocks or num_kv_blocks_for_budget(
        config.cache.kv_cache_memory_bytes, config.cache.block_size, per_token, groups)
    if blocks < 1:
        raise ValueError(f"kv_cache_memory_bytes={config.cache.kv_cache_memory_bytes} holds no block of "
                         f"{config.cache.block_size} tokens ({per_token} bytes per token)")
    return KVCacheInfo(blocks, config.cache.block_size, per_token, groups)
