"""The engine's gauges and counters after a step, as one immutable value for metrics and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.kv_cache.block_map import BlockMap


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's gauges after a step, published by the engine thread for anyone to read."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    num_preemptions: int = 0  # cumulative
    kv_cache_tokens: int = 0  # capacity
    kv_cache_blocks: int = 0  # blocks in the pool (a hybrid model's block holds one KV group's layers)
    # blocks requests hold now, by the kind of layers they serve: "full" attention or sliding "window"
    kv_blocks_in_use: dict[str, int] = field(default_factory=dict)
    weight_bytes: int = 0  # model weights as loaded (quantized or not): EngineCore.memory
    kv_bytes_per_token: int = 0  # all layers, K and V, scales included
    # cumulative prefix-cache counters (tokens), and blocks evicted from the cache
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_evictions: int = 0
    # cumulative speculative-decoding counters
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verify_steps: int = 0  # request-steps that verified proposals
    spec_emitted_tokens: int = 0  # tokens those request-steps produced
    # cumulative work: engine steps run, and tokens they computed (prompt chunks, recomputed ones after a
    # preemption, decodes, speculative proposals); the warm-up at start-up is not counted
    num_steps: int = 0
    num_batched_tokens: int = 0
    # ... split three ways: prompt chunks (and recomputed ones), one-token decodes, speculative proposals
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_spec_tokens: int = 0
    # the KV pool block by block, only when the publisher asked for it (a dashboard is watching)
    block_map: BlockMap | None = None
