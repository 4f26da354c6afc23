"""Per-request block tables on top of the block pool, with prefix caching and copy-on-write forks.
Pure Python, no torch.

The scheduler asks for room ("request R will hold N tokens after this step") and gets yes or no;
it never sees the pool's internals. Slot ``s`` of a request's token at position ``p`` is
``block_table[p // block_size] * block_size + p % block_size``.

Sharing rule: only full blocks are ever shared (prefix-cache hits, forks), and a request only
writes at positions >= its ``num_computed_tokens``, which lie past its shared blocks. So a shared
block is never written; a fork copies the one partly filled block instead of sharing it.

Sliding window (``window``, set when every layer of the model slides over it): the next token
computed at position ``c`` reads no key before ``c - window + 1``, so once a request has computed
``c`` tokens the blocks wholly before that position go back to the pool (into the prefix cache if
they are registered there). Their entries in the table become ``RELEASED``: positions keep their
indices, and no kernel reads a block before a sequence's window start.

Attention sinks (``sinks``, StreamingLLM, on a model without a window of its own): the first
``sinks`` tokens stay readable for good, beside a window of the latest ones; the blocks holding the
sinks are kept and the released run starts after them.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from kvserve.kv_cache.block_map import CACHED, OWNED, SHARED, BlockMap
from kvserve.kv_cache.block_pool import BlockPool
from kvserve.kv_cache.hashing import BlockKey, chain_keys
from kvserve.request import Request

RELEASED = -1  # a table entry whose block went back to the pool (outside the sliding window)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def first_needed_block(num_computed: int, window: int | None, block_size: int) -> int:
    """Index of the first block the next computed token (at position ``num_computed``) may read."""
    if window is None:
        return 0
    return max(0, num_computed - window + 1) // block_size


@dataclass
class PrefixCacheStats:
    """Prefix-cache counters in tokens, for metrics."""

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Owns the block pool and every request's block table."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 window: int | None = None, sinks: int = 0, pool: BlockPool | None = None,
                 key_extra: Hashable = None) -> None:
        """``window``: the sliding window of a model whose every layer slides, or the recent window
        beside ``sinks`` attention-sink tokens (see the module doc). ``pool`` and ``key_extra``: one
        KV group of a hybrid model (kv_cache/hybrid.py), drawing on a pool shared with the other
        groups, its cached blocks keyed apart from theirs."""
        if window is not None and window < 1:
            raise ValueError(f"window={window} must be >= 1")
        if sinks < 0 or (sinks and window is None):
            raise ValueError(f"sinks={sinks}: attention sinks need a window and a count >= 0")
        self.sink_blocks = blocks_needed(sinks, block_size)  # the leading blocks never released
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.window = window
        self.key_extra = key_extra
        self.pool = pool if pool is not None else BlockPool(num_blocks)
        self.prefix_stats = PrefixCacheStats()
        self._tables: dict[str, list[int]] = {}
        self._keys: dict[str, list[BlockKey]] = {}  # full-block keys of a request's tokens so far
        self._num_registered: dict[str, int] = {}  # leading blocks of the table already in the cache
        # blocks of the table released (outside the window): the run after the sink blocks
        self._num_released: dict[str, int] = {}
        # distinct blocks this manager's tables hold; with a shared pool (hybrid) a block is only
        # ever held by one group, as each group's cache keys are its own
        self.num_owned_blocks = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks owned by requests, 0..1 (cached-but-unused blocks count as free)."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def held_blocks_by_kind(self) -> dict[str, int]:
        """Blocks requests hold now, by the kind of their layers ("full" or "window"): here one kind."""
        return {"full" if self.window is None else "window": self.num_owned_blocks}

    def block_tables(self, request_id: str) -> list[list[int]]:
        """One table per KV group (here one); the hybrid manager has one per group."""
        return [self._tables.get(request_id, [])]

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds now (its table less the entries released outside the window)."""
        return len(self._tables.get(request_id, [])) - self._num_released.get(request_id, 0)

    # ---- prefix cache -----------------------------------------------------------------------
    def match_prefix(self, request: Request) -> list[int]:
        """Cached blocks holding the longest cached prefix of the request's tokens.

        At least one token is always left to compute, since its logits give the next token.
        """
        if not self.enable_prefix_caching:
            return []
        hits = []
        for key in self._request_keys(request, self.max_prefix_blocks(request)):
            block = self.pool.lookup(key)
            if block is None:
                break
            hits.append(block)
        return hits

    def max_prefix_blocks(self, request: Request) -> int:
        """The most full blocks a prefix hit may cover: one token is always left to compute."""
        return (request.num_tokens - 1) // self.block_size

    def cached_blocks(self, request: Request, num_blocks: int) -> list[int | None]:
        """The cached block holding each of the request's first ``num_blocks`` blocks, or None."""
        return [self.pool.lookup(key) for key in self._request_keys(request, num_blocks)]

    def request_ids(self) -> list[str]:
        """Requests holding a table now."""
        return list(self._tables)

    def uncached_keys(self, request: Request, num_hits: int) -> list[int]:
        """Hashes of the request's prompt blocks after its ``num_hits`` cached ones: the KV it would
        compute. Used to hold back a request whose prefix another request is computing right now."""
        if not self.enable_prefix_caching:
            return []
        limit = (request.num_tokens - 1) // self.block_size
        return [k.hash for k in self._request_keys(request, limit)[num_hits:]]

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_stats.queries += num_tokens
        self.prefix_stats.hits += num_hit_tokens

    def commit_computed(self, request: Request) -> None:
        """Publish the request's newly completed full blocks in the prefix cache, then (sliding
        window) release the blocks its next token can no longer read."""
        if self.enable_prefix_caching:
            self._register_computed(request)
        if self.window is not None:
            self._release_outside_window(request.request_id, request.num_computed_tokens)

    def _register_computed(self, request: Request) -> None:
        rid = request.request_id
        table = self._tables.get(rid, [])
        done = min(request.num_computed_tokens // self.block_size, len(table))
        start = self._num_registered.get(rid, 0)
        if done <= start:
            return
        keys = self._request_keys(request, done)
        for i in range(start, done):
            if table[i] != RELEASED:
                self.pool.register(table[i], keys[i])
        self._num_registered[rid] = done

    def _release_outside_window(self, request_id: str, num_computed: int) -> None:
        table = self._tables.get(request_id)
        if not table:
            return
        start = self.sink_blocks + self._num_released.get(request_id, 0)
        end = min(first_needed_block(num_computed, self.window, self.block_size), len(table))
        if end <= start:
            return
        self._free([b for b in table[start:end] if b != RELEASED])
        table[start:end] = [RELEASED] * (end - start)
        self._num_released[request_id] = end - self.sink_blocks

    def _touch(self, block: int) -> None:
        self.num_owned_blocks += self.pool.ref_count(block) == 0
        self.pool.touch(block)

    def _allocate(self, n: int) -> list[int]:
        blocks = self.pool.allocate(n)
        self.num_owned_blocks += n
        return blocks

    def _free(self, blocks: list[int]) -> None:
        self.pool.free(blocks)
        self.num_owned_blocks -= sum(1 for b in blocks if self.pool.ref_count(b) == 0)

    def _request_keys(self, request: Request, num_blocks: int) -> list[BlockKey]:
        keys = self._keys.get(request.request_id, [])
        if len(keys) < num_blocks:
            tokens = request.token_slice(0, num_blocks * self.block_size)
            keys = chain_keys(tokens, self.block_size, keys, self.key_extra)
            self._keys[request.request_id] = keys
        return keys[:num_blocks]

    # ---- allocation -------------------------------------------------------------------------
    def allocate_slots(self, request_id: str, num_tokens: int, prefix: list[int] | None = None) -> bool:
        """Grow the request's table to hold ``num_tokens`` tokens, starting from the shared
        ``prefix`` blocks if given (only for a request without blocks). All or nothing."""
        missing, reclaimed = self.blocks_to_allocate(request_id, num_tokens, prefix)
        if missing > self.pool.num_free_blocks - reclaimed:
            return False
        self.grow(request_id, num_tokens, prefix)
        return True

    def blocks_to_allocate(self, request_id: str, num_tokens: int, prefix: list[int] | None = None) -> tuple[int, int]:
        """(new blocks ``allocate_slots`` would take, cached prefix blocks it would take out of the free
        queue): it succeeds when their sum fits the free blocks. Changes nothing."""
        table = self._tables.get(request_id, [])
        if not prefix and num_tokens <= len(table) * self.block_size:
            return 0, 0  # most decode steps: the last block still has room
        prefix = prefix or []
        if prefix and table:
            raise RuntimeError(f"request {request_id} already has blocks; a prefix can only start a table")
        missing = blocks_needed(num_tokens, self.block_size) - len(table) - len(prefix)
        keep, skip_end = self._prefix_split(prefix)
        taken = prefix[:keep] + prefix[skip_end:]
        return max(missing, 0), sum(1 for b in taken if self.pool.ref_count(b) == 0)  # cached ones leave the free queue

    def _prefix_split(self, prefix: list[int]) -> tuple[int, int]:
        """(leading sink blocks kept, end of the run not taken): (sliding window) the prefix's blocks
        before the first computed token's window are not read, so not taken (entries there may be
        RELEASED); (attention sinks) the sink blocks are read for good."""
        skip_end = first_needed_block(len(prefix) * self.block_size, self.window, self.block_size) if prefix else 0
        keep = min(self.sink_blocks, len(prefix))
        return keep, max(skip_end, keep)

    def grow(self, request_id: str, num_tokens: int, prefix: list[int] | None = None) -> None:
        """``allocate_slots`` once ``blocks_to_allocate`` fits: raises OutOfBlocksError otherwise."""
        table = self._tables.get(request_id, [])
        if not prefix and num_tokens <= len(table) * self.block_size:
            return
        prefix = prefix or []
        missing = blocks_needed(num_tokens, self.block_size) - len(table) - len(prefix)
        keep, skip_end = self._prefix_split(prefix)
        table = self._tables.setdefault(request_id, table)
        for b in prefix[:keep]:
            self._touch(b)
            table.append(b)
        table.extend([RELEASED] * (skip_end - keep))
        for b in prefix[skip_end:]:
            self._touch(b)
            table.append(b)
        if prefix:
            self._num_registered[request_id] = len(prefix)
        if skip_end > keep:
            self._num_released[request_id] = skip_end - keep
        if missing > 0:
            table.extend(self._allocate(missing))

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> list[tuple[int, int]] | None:
        """Give ``child_id`` the parent's first ``num_tokens`` tokens of KV: full blocks shared,
        the partly filled last block copied. Returns the (src, dst) block copies to perform before
        the child's next forward pass, or None if no block is free for the copy."""
        parent = self._tables.get(parent_id, [])
        full, partial = divmod(num_tokens, self.block_size)
        if child_id in self._tables or len(parent) < full + (1 if partial else 0):
            raise RuntimeError(f"cannot fork {parent_id} ({len(parent)} blocks) at {num_tokens} tokens")
        if partial and self.pool.num_free_blocks < 1:
            return None
        if not self.can_fork(parent_id, num_tokens):
            raise RuntimeError(f"cannot fork {parent_id} at {num_tokens} tokens: it released blocks the child reads")
        table = []
        for b in parent[:full]:
            if b != RELEASED:
                self._touch(b)
            table.append(b)
        copies = []
        if partial:
            (dst,) = self._allocate(1)
            copies.append((parent[full], dst))
            table.append(dst)
        self._tables[child_id] = table
        self._num_registered[child_id] = min(full, self._num_registered.get(parent_id, 0))
        released = sum(1 for b in table if b == RELEASED)  # always one run, after the sink blocks
        if released:
            self._num_released[child_id] = released
        return copies

    def can_fork(self, parent_id: str, num_tokens: int) -> bool:
        """Whether the parent still holds every block a child starting at ``num_tokens`` reads."""
        first = first_needed_block(num_tokens, self.window, self.block_size)
        return RELEASED not in self._tables.get(parent_id, [])[first:blocks_needed(num_tokens, self.block_size)]

    def free(self, request_id: str) -> None:
        """Release the request's blocks (finished, aborted or preempted). Cached ones stay reusable."""
        table = self._tables.pop(request_id, None)
        self._num_registered.pop(request_id, None)
        self._num_released.pop(request_id, None)
        if table:
            self._free([b for b in reversed(table) if b != RELEASED])  # tail first: leaves are evicted before roots

    def forget(self, request_id: str) -> None:
        """Drop everything about a request that has ended (its blocks and its cached block keys)."""
        self.free(request_id)
        self._keys.pop(request_id, None)

    def block_map(self) -> BlockMap:
        """Each block's state now, for the dashboard: O(blocks), a few hundred microseconds per thousand."""
        return pool_block_map(self.pool, {rid: [t] for rid, t in self._tables.items()})

    def check_invariants(self) -> None:
        """Pool consistency, and every owned block's ref count equals the tables that hold it."""
        self.pool.check_invariants()
        check_ref_counts(self.pool, self.holders())
        assert self.num_owned_blocks == self.pool.num_blocks - self.pool.num_free_blocks, "owned block count drifted"

    def holders(self) -> dict[int, int]:
        """Block -> how many of this manager's tables hold it (asserting each table is well formed)."""
        holders: dict[int, int] = {}
        for rid, table in self._tables.items():
            released, sinks = self._num_released.get(rid, 0), min(self.sink_blocks, len(table))
            run = table[sinks:sinks + released]
            assert all(b == RELEASED for b in run), "a released entry still names a block"
            held = table[:sinks] + table[sinks + released:]
            assert RELEASED not in held and len(held) == len(set(held)), "a table holds a block twice"
            for b in held:
                holders[b] = holders.get(b, 0) + 1
        assert len(holders) == self.num_owned_blocks, "owned block count drifted"
        return holders


def pool_block_map(pool: BlockPool, tables: dict[str, list[list[int]]]) -> BlockMap:
    """Each block's state, from every request's tables (one per KV group)."""
    cells = bytearray(pool.num_blocks)  # FREE
    for b in pool.cached_free_blocks():
        cells[b] = CACHED
    for i, request_tables in enumerate(tables.values()):
        code = min(OWNED + i, 255)
        for table in request_tables:
            for b in table:
                if b != RELEASED:
                    cells[b] = SHARED if pool.ref_count(b) > 1 else code
    return BlockMap(bytes(cells), tuple(tables))


def check_ref_counts(pool: BlockPool, holders: dict[int, int]) -> None:
    for b in range(pool.num_blocks):
        assert pool.ref_count(b) == holders.get(b, 0), f"block {b}: ref count != tables holding it"
