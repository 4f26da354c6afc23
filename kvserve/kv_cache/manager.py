"""Per-request block tables on top of the block pool. Pure Python, no torch.

The scheduler asks for room ("request R will hold N tokens after this step") and gets yes or no;
it never sees the pool's internals. Slot ``s`` of a request's token at position ``p`` is
``block_table[p // block_size] * block_size + p % block_size``.
"""

from __future__ import annotations

from kvserve.kv_cache.block_pool import BlockPool


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCacheManager:
    """Owns the block pool and every request's block table."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1 (the KV-cache usage metric)."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def can_fit(self, request_id: str, num_tokens: int) -> bool:
        have = len(self._tables.get(request_id, ()))
        return blocks_needed(num_tokens, self.block_size) - have <= self.pool.num_free_blocks

    def allocate_slots(self, request_id: str, num_tokens: int) -> bool:
        """Grow the request's table to hold ``num_tokens`` tokens. All or nothing; False if full."""
        table = self._tables.setdefault(request_id, [])
        missing = blocks_needed(num_tokens, self.block_size) - len(table)
        if missing <= 0:
            return True
        if missing > self.pool.num_free_blocks:
            if not table:
                del self._tables[request_id]
            return False
        table.extend(self.pool.allocate(missing))
        return True

    def free(self, request_id: str) -> None:
        """Release every block of the request (finished, aborted or preempted). Idempotent."""
        table = self._tables.pop(request_id, None)
        if table:
            # Free in reverse so that, with prefix caching later, tail blocks are evicted first.
            self.pool.free(list(reversed(table)))

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        owned = [b for t in self._tables.values() for b in t]
        assert len(owned) == len(set(owned)), "a block is owned by two requests"
        assert all(self.pool.ref_count(b) == 1 for b in owned), "owned block with wrong ref count"
        assert len(owned) + self.pool.num_free_blocks == self.pool.num_blocks, "leaked blocks"
