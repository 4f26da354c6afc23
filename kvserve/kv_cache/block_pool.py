"""The pool of physical KV blocks: a free list and reference counts. Pure Python, no torch."""

from __future__ import annotations

from collections import deque


class OutOfBlocksError(RuntimeError):
    """Raised by the pool when asked for more blocks than are free (the caller should preempt)."""


class BlockPool:
    """Hands out block ids in [0, num_blocks); a block is free exactly when its ref count is 0.

    Invariants (checked by ``check_invariants``): every block is either on the free list or has
    ref_count > 0, never both, and no block appears on the free list twice.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be >= 1")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_count = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks, each with ref count 1; all or nothing."""
        if n > len(self._free):
            raise OutOfBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._ref_count[b] = 1
        return blocks

    def incref(self, block: int) -> None:
        if self._ref_count[block] <= 0:
            raise RuntimeError(f"incref of free block {block}")
        self._ref_count[block] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; blocks that reach zero go back on the free list."""
        for b in blocks:
            rc = self._ref_count[b]
            if rc <= 0:
                raise RuntimeError(f"double free of block {b}")
            self._ref_count[b] = rc - 1
            if rc == 1:
                self._free.append(b)

    def ref_count(self, block: int) -> int:
        return self._ref_count[block]

    def check_invariants(self) -> None:
        """Assert the pool's bookkeeping is consistent (for tests and debugging)."""
        free = list(self._free)
        assert len(free) == len(set(free)), "a block is on the free list twice"
        assert all(self._ref_count[b] == 0 for b in free), "a free block is still referenced"
        owned = sum(1 for rc in self._ref_count if rc > 0)
        assert all(rc >= 0 for rc in self._ref_count), "negative ref count"
        assert owned + len(free) == self.num_blocks, "a block is neither free nor owned"
