"""The KV cache of a hybrid model: one ``KVCacheManager`` per KV group (kv_cache/groups.py), all
drawing on one block pool. Pure Python, no torch.

The scheduler sees the same interface as a single manager: a request's room, prefix hits, forks
and frees are all or nothing across the groups. Group 0 attends fully; its table is the request's
``block_table``, and ``block_tables`` lists every group's.

Prefix caching: each group caches its own blocks, keyed apart (the group index is in the block
key). A hit of ``n`` blocks needs every full group's first ``n`` blocks cached, but a window group
only the blocks the first computed token's window reads (``first_needed_block``): the blocks it
released behind its window may have been evicted meanwhile without costing the hit.
"""

from __future__ import annotations

from kvserve.kv_cache.block_map import BlockMap
from kvserve.kv_cache.block_pool import BlockPool
from kvserve.kv_cache.groups import KVLayout
from kvserve.kv_cache.manager import (
    RELEASED,
    KVCacheManager,
    PrefixCacheStats,
    check_ref_counts,
    first_needed_block,
    pool_block_map,
)
from kvserve.request import Request

PrefixHit = tuple[int, ...]  # one block per group (RELEASED where a window group does not read it)


class HybridKVCacheManager:
    """Owns the shared block pool and one block table per request and KV group."""

    window = None  # no single window for the whole model: each group has its own
    sink_blocks = 0

    def __init__(self, num_blocks: int, block_size: int, layout: KVLayout, enable_prefix_caching: bool = True) -> None:
        self.layout = layout
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.groups = [KVCacheManager(num_blocks, block_size, enable_prefix_caching, window=g.window, pool=self.pool,
                                      key_extra=("kv-group", i)) for i, g in enumerate(layout.groups)]
        self.prefix_stats = PrefixCacheStats()

    @property
    def enable_prefix_caching(self) -> bool:
        return self.groups[0].enable_prefix_caching

    @enable_prefix_caching.setter
    def enable_prefix_caching(self, value: bool) -> None:
        for g in self.groups:
            g.enable_prefix_caching = value

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks owned by requests, 0..1, all groups together."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def block_table(self, request_id: str) -> list[int]:
        return self.groups[0].block_table(request_id)

    def block_tables(self, request_id: str) -> list[list[int]]:
        return [g.block_table(request_id) for g in self.groups]

    def num_held_blocks(self, request_id: str) -> int:
        return sum(g.num_held_blocks(request_id) for g in self.groups)

    def held_blocks_by_kind(self) -> dict[str, int]:
        """Blocks requests hold now, per kind of group ("full", "window"); the two sum to the pool's
        blocks in use (a block is only ever held by one group)."""
        held: dict[str, int] = {}
        for group, manager in zip(self.layout.groups, self.groups):
            held[group.kind] = held.get(group.kind, 0) + manager.num_owned_blocks
        return held

    # ---- prefix cache -----------------------------------------------------------------------
    def match_prefix(self, request: Request) -> list[PrefixHit]:
        """The longest prefix every group can start from: per block, each group's cached block."""
        if not self.enable_prefix_caching:
            return []
        n = self.groups[0].max_prefix_blocks(request)
        full = [g.match_prefix(request) for g in self.groups if g.window is None]
        n = min([n, *(len(hits) for hits in full)])
        cached = [g.cached_blocks(request, n) for g in self.groups]
        while n > 0 and not all(self._window_hit(c, n, g.window) for c, g in zip(cached, self.groups)):
            n -= 1
        firsts = [first_needed_block(n * self.block_size, g.window, self.block_size) for g in self.groups]
        return [tuple(RELEASED if i < first else c[i] for c, first in zip(cached, firsts)) for i in range(n)]

    def _window_hit(self, cached: list[int | None], n: int, window: int | None) -> bool:
        """Whether the blocks a group reads of an ``n``-block prefix are all cached."""
        return all(b is not None for b in cached[first_needed_block(n * self.block_size, window, self.block_size):n])

    def uncached_keys(self, request: Request, num_hits: int) -> list[int]:
        return self.groups[0].uncached_keys(request, num_hits)

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_stats.queries += num_tokens
        self.prefix_stats.hits += num_hit_tokens

    def commit_computed(self, request: Request) -> None:
        for g in self.groups:
            g.commit_computed(request)

    # ---- allocation -------------------------------------------------------------------------
    def allocate_slots(self, request_id: str, num_tokens: int, prefix: list[PrefixHit] | None = None) -> bool:
        """Grow every group's table to hold ``num_tokens`` tokens (from ``prefix``, a ``match_prefix``
        result, for a request without blocks). All or nothing across the groups."""
        parts = [[hit[i] for hit in prefix] if prefix else None for i in range(len(self.groups))]
        need = 0
        for g, part in zip(self.groups, parts):
            missing, reclaimed = g.blocks_to_allocate(request_id, num_tokens, part)
            need += missing + reclaimed
        if need > self.pool.num_free_blocks:
            return False
        # every group takes its cached prefix blocks out of the free queue before any group allocates,
        # which could otherwise evict a block another group's prefix names
        if prefix:
            for g, part in zip(self.groups, parts):
                g.grow(request_id, len(part) * self.block_size, part)
        for g in self.groups:
            g.grow(request_id, num_tokens)
        return True

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> list[tuple[int, int]] | None:
        """Fork every group (see KVCacheManager.fork); None if the partial blocks' copies do not fit."""
        if num_tokens % self.block_size and self.pool.num_free_blocks < len(self.groups):
            return None
        if not self.can_fork(parent_id, num_tokens):
            raise RuntimeError(f"cannot fork {parent_id} at {num_tokens} tokens: it released blocks the child reads")
        return [copy for g in self.groups for copy in g.fork(parent_id, child_id, num_tokens)]

    def can_fork(self, parent_id: str, num_tokens: int) -> bool:
        return all(g.can_fork(parent_id, num_tokens) for g in self.groups)

    def free(self, request_id: str) -> None:
        for g in self.groups:
            g.free(request_id)

    def forget(self, request_id: str) -> None:
        for g in self.groups:
            g.forget(request_id)

    def block_map(self) -> BlockMap:
        ids = dict.fromkeys(rid for g in self.groups for rid in g.request_ids())
        return pool_block_map(self.pool, {rid: self.block_tables(rid) for rid in ids})

    def check_invariants(self) -> None:
        """Pool consistency, each group's tables well formed, and every ref count equal to the tables
        (of all groups) holding the block."""
        self.pool.check_invariants()
        holders: dict[int, int] = {}
        for g in self.groups:
            for b, n in g.holders().items():
                holders[b] = holders.get(b, 0) + n
        check_ref_counts(self.pool, holders)
        assert sum(self.held_blocks_by_kind().values()) == self.pool.num_blocks - self.pool.num_free_blocks


def make_kv_cache(num_blocks: int, block_size: int, layout: KVLayout,
                  enable_prefix_caching: bool = True) -> KVCacheManager | HybridKVCacheManager:
    """The manager for ``layout``: a single one for one group (windowed if that group is), else hybrid."""
    if not layout.is_hybrid:
        return KVCacheManager(num_blocks, block_size, enable_prefix_caching, window=layout.groups[0].window)
    return HybridKVCacheManager(num_blocks, block_size, layout, enable_prefix_caching)
