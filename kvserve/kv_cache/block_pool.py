"""The pool of physical KV blocks: reference counts, a free queue in eviction order, and the
prefix cache (block hash -> block). Pure Python, no torch.

A block is in exactly one of three states:
- owned:  ref_count > 0 (used by one request, or shared by several through the prefix cache);
- cached: ref_count == 0 but it still holds the KV of a known block hash, so a later request
  can reuse it; it sits in the free queue and is evicted when the pool needs it;
- free:   ref_count == 0 and no hash.
The free queue holds cached and free blocks, least recently freed first. Requests free their
blocks tail first, so the leaves of a cached prefix are evicted before its root.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvserve.kv_cache.hashing import BlockKey


class OutOfBlocksError(RuntimeError):
    """Raised by the pool when asked for more blocks than are free (the caller should preempt)."""


@dataclass
class PoolStats:
    """Counters for metrics: prefix-cache evictions since start."""

    evictions: int = 0


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be >= 1")
        self.num_blocks = num_blocks
        self._ref_count = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block
        self._key_of: dict[int, BlockKey] = {}  # block -> (hash, parent hash, tokens) it holds
        self.stats = PoolStats()

    # ---- counts ---------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free or cached-but-unused)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Unused blocks that still hold reusable KV."""
        return sum(1 for b in self._free if b in self._key_of)

    def cached_free_blocks(self) -> list[int]:
        """Unused blocks that still hold reusable KV, in eviction order."""
        return [b for b in self._free if b in self._key_of]

    def ref_count(self, block: int) -> int:
        return self._ref_count[block]

    # ---- allocation -----------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks from the front of the free queue (evicting cached KV), ref count 1 each."""
        if n > len(self._free):
            raise OutOfBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        blocks = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self._ref_count[block] = 1
            blocks.append(block)
        return blocks

    def touch(self, block: int) -> None:
        """Take one more reference to an owned or cached block (a prefix-cache hit or a fork)."""
        if self._ref_count[block] == 0:
            if block not in self._free:
                raise RuntimeError(f"touch of block {block} that is neither owned nor cached")
            del self._free[block]
        self._ref_count[block] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; at zero it joins the back of the free queue."""
        for b in blocks:
            rc = self._ref_count[b]
            if rc <= 0:
                raise RuntimeError(f"double free of block {b}")
            self._ref_count[b] = rc - 1
            if rc == 1:
                self._free[b] = None

    # ---- prefix cache ---------------------------------------------------------------------------
    def lookup(self, key: BlockKey) -> int | None:
        """The block holding exactly this content (hash, parent and tokens all match), if cached."""
        block = self._cached.get(key.hash)
        if block is None or self._key_of.get(block) != key:
            return None
        return block

    def register(self, block: int, key: BlockKey) -> None:
        """Record that an owned, full block now holds ``key``'s KV. First writer wins."""
        if block in self._key_of or key.hash in self._cached:
            return
        self._cached[key.hash] = block
        self._key_of[block] = key

    def is_cached(self, block: int) -> bool:
        return block in self._key_of

    def _evict(self, block: int) -> None:
        key = self._key_of.pop(block, None)
        if key is not None:
            del self._cached[key.hash]
            self.stats.evictions += 1

    def check_invariants(self) -> None:
        """Assert the bookkeeping is consistent (for tests and debugging)."""
        assert all(rc >= 0 for rc in self._ref_count), "negative ref count"
        assert all(self._ref_count[b] == 0 for b in self._free), "a block is both free and owned"
        owned = sum(1 for rc in self._ref_count if rc > 0)
        assert owned + len(self._free) == self.num_blocks, "a block is neither free, cached nor owned"
        assert len(self._cached) == len(self._key_of), "hash map and block map disagree"
        assert all(self._cached[k.hash] == b for b, k in self._key_of.items()), "cache entry points elsewhere"
