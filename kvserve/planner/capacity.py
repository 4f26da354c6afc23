"""Memory arithmetic of serving: weights, KV bytes per token and per user, users against context.

KV sizing goes through ``kvserve.kv_cache.sizing``, the very functions the engine sizes its cache
with, so a plan and a running engine cannot disagree about bytes per token or blocks per budget.
Capacity is counted in whole blocks of ``block_size`` tokens, as the paged cache allocates them.

    memory  = num_gpus x device memory
    KV room = memory - overhead_fraction x memory - weights       (or an explicit KV budget)
    users   = KV room // KV per user at the context
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

from kvserve.kv_cache.sizing import (
    kv_bytes_per_token,
    kv_capacity_tokens,
    kv_num_groups,
    max_window_blocks,
    mla_kv_bytes_per_token,
)
from kvserve.planner.hardware import Hardware
from kvserve.planner.shape import Inventory, ModelShape, inventory
from kvserve.planner.weights import WeightBytes, canonical_dtype, kv_dtype_bytes, quant_scheme, weight_bytes


@dataclass(frozen=True)
class Setup:
    """One deployment to plan: a model on some devices with a dtype, quantization and cache dtype."""

    model: ModelShape
    hardware: Hardware
    num_gpus: int = 1
    dtype: str = "bfloat16"
    quantization: str = "none"
    kv_cache_dtype: str = "auto"
    overhead_fraction: float = 0.10  # activations, CUDA context, allocator slack; vLLM's 0.9 utilization
    block_size: int = 16  # the engine's default KV block
    kv_cache_memory_bytes: int | None = None  # a fixed KV budget, as the engine is given, instead of "the rest"
    cap_sliding_window: bool = True  # sliding-window layers keep only the window; False: size them fully
    price_per_hour: float | None = None  # per device; None takes the table's rough price

    def __post_init__(self) -> None:
        if not 1 <= self.num_gpus <= 1024:
            raise ValueError(f"num_gpus={self.num_gpus} must be in [1, 1024]")
        if not 0.0 <= self.overhead_fraction < 1.0:
            raise ValueError(f"overhead_fraction={self.overhead_fraction} must be in [0, 1)")
        if not 1 <= self.block_size <= 1024:
            raise ValueError(f"block_size={self.block_size} must be in [1, 1024]")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes={self.kv_cache_memory_bytes} must be > 0")
        if self.price_per_hour is not None and self.price_per_hour < 0:
            raise ValueError(f"price_per_hour={self.price_per_hour} must be >= 0")
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        quant_scheme(self.quantization)
        kv_dtype_bytes(self.kv_cache_dtype, self.dtype)

    @property
    def label(self) -> str:
        gpus = f"{self.num_gpus}x " if self.num_gpus > 1 else ""
        quant = f" {self.quantization}" if self.quantization != "none" else ""
        kv = f" kv={self.kv_cache_dtype}" if self.kv_cache_dtype != "auto" else ""
        return f"{self.model.name} {self.dtype}{quant}{kv} on {gpus}{self.hardware.name}"

    @cached_property
    def inventory(self) -> Inventory:
        return inventory(self.model)

    @cached_property
    def weights(self) -> WeightBytes:
        return weight_bytes(self.inventory, self.dtype, self.quantization)

    @property
    def kv_element_bytes(self) -> float:
        return kv_dtype_bytes(self.kv_cache_dtype, self.dtype)

    @property
    def hourly_price(self) -> float | None:
        price = self.price_per_hour if self.price_per_hour is not None else self.hardware.price_per_hour
        return None if price is None else price * self.num_gpus


def layers_kv_bytes_per_token(model: ModelShape, num_layers: int, element_bytes: float) -> int:
    """KV bytes per token of ``num_layers`` layers, via the engine's sizing functions."""
    if model.mla is not None:
        return mla_kv_bytes_per_token(num_layers, model.mla.kv_lora_rank, model.mla.qk_rope_head_dim, element_bytes)
    return kv_bytes_per_token(num_layers, model.num_kv_heads, model.head_dim, element_bytes)


def kv_bytes_per_token_of(setup: Setup) -> int:
    """Bytes one token adds to the cache across all layers: what the engine allocates per slot."""
    return layers_kv_bytes_per_token(setup.model, setup.model.num_layers, setup.kv_element_bytes)


def _round_up(tokens: int, block_size: int) -> int:
    return math.ceil(tokens / block_size) * block_size


def kv_bytes_per_user(setup: Setup, context: int) -> int:
    """KV bytes one sequence of ``context`` tokens holds, in whole blocks.

    Sliding-window layers hold at most the window (when ``cap_sliding_window``); full layers hold
    every token.
    """
    if context < 0:
        raise ValueError(f"context={context} must be >= 0")
    m, bs, elem = setup.model, setup.block_size, setup.kv_element_bytes
    sliding = m.num_sliding_layers if setup.cap_sliding_window and m.sliding_window else 0
    full_tokens = _round_up(context, bs)
    # the engine's own bound on a windowed request's blocks (decode steps; see max_window_blocks)
    window_tokens = min(full_tokens, max_window_blocks(m.sliding_window, bs) * bs if m.sliding_window else 0)
    return (layers_kv_bytes_per_token(m, m.num_layers - sliding, elem) * full_tokens
            + layers_kv_bytes_per_token(m, sliding, elem) * window_tokens)


def total_memory(setup: Setup) -> int:
    return setup.hardware.memory_bytes * setup.num_gpus


def overhead_bytes(setup: Setup) -> int:
    return int(total_memory(setup) * setup.overhead_fraction)


def kv_budget_bytes(setup: Setup) -> int:
    """Bytes left for the KV cache: the explicit budget, else memory minus overhead minus weights.

    Negative when the weights alone do not fit.
    """
    if setup.kv_cache_memory_bytes is not None:
        return setup.kv_cache_memory_bytes
    return total_memory(setup) - overhead_bytes(setup) - setup.weights.total


def kv_groups_of(setup: Setup) -> int:
    """KV groups the engine splits the layers into (kv_cache/groups.py): several when full and
    sliding-window layers mix and the window layers are capped, else one."""
    m = setup.model
    sliding = m.num_sliding_layers if setup.cap_sliding_window and m.sliding_window else 0
    if not 0 < sliding < m.num_layers:
        return 1
    return kv_num_groups([m.num_layers - sliding, sliding])


def kv_capacity_tokens_of(setup: Setup) -> int:
    """Tokens the cache holds (all layers at full size), exactly as the engine computes it."""
    return kv_capacity_tokens(max(kv_budget_bytes(setup), 0), setup.block_size, kv_bytes_per_token_of(setup),
                              kv_groups_of(setup))


def max_users(setup: Setup, context: int) -> int:
    """How many sequences of ``context`` tokens fit in the KV room at once."""
    per_user = kv_bytes_per_user(setup, max(context, 1))
    return max(kv_budget_bytes(setup), 0) // per_user


def max_context(setup: Setup, users: int) -> int:
    """Longest context (a multiple of the block size) that ``users`` sequences can each hold.

    Searched up to the model's position limit; the caller compares against that limit.
    """
    if users < 1:
        raise ValueError(f"users={users} must be >= 1")
    budget, bs = max(kv_budget_bytes(setup), 0), setup.block_size
    lo, hi = 0, _round_up(setup.model.max_position, bs) // bs  # in blocks
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if users * kv_bytes_per_user(setup, mid * bs) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return min(lo * bs, setup.model.max_position)


def users_context_curve(setup: Setup, points: int = 48) -> list[tuple[int, int]]:
    """(context, max users) from one block to the model's position limit, log-spaced whole blocks, for plots."""
    bs = setup.block_size
    lo, hi = math.log(bs), math.log(setup.model.max_position)
    contexts = sorted({max(round(math.exp(lo + (hi - lo) * i / (points - 1)) / bs), 1) * bs for i in range(points)})
    return [(c, max_users(setup, c)) for c in contexts]


def kv_formula(setup: Setup) -> str:
    """The KV-per-token product spelled out, so a reader can check it by hand."""
    m, elem = setup.model, setup.kv_element_bytes
    if m.mla is not None:
        return (f"{m.num_layers} layers x ({m.mla.kv_lora_rank} latent + {m.mla.qk_rope_head_dim} rope)"
                f" x {elem:g} B")
    return f"2 (K,V) x {m.num_layers} layers x {m.num_kv_heads} KV heads x {m.head_dim} dims x {elem:g} B"


def sliding_note(setup: Setup) -> str:
    """Which layers the per-user KV caps at the sliding window, or '' when none are."""
    m = setup.model
    if not (m.sliding_window and m.num_sliding_layers):
        return ""
    if not setup.cap_sliding_window:
        return f"{m.num_sliding_layers} sliding-window layers sized for the full context (--full-attention)"
    return f"{m.num_sliding_layers} of {m.num_layers} layers capped at the {m.sliding_window:,}-token window"
