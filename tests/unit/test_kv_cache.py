"""KV-cache manager and block pool alone: allocation, prefix hits, forks, eviction, invariants."""

from __future__ import annotations

import random

from kvserve.kv_cache.block_pool import BlockPool
from kvserve.kv_cache.manager import KVCacheManager
from kvserve.request import Request
from kvserve.types import SamplingParams


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=1000))


def _state_counts(kv: KVCacheManager) -> tuple[int, int, int]:
    pool = kv.pool
    owned = sum(1 for b in range(pool.num_blocks) if pool.ref_count(b) > 0)
    cached = pool.num_cached_blocks
    free = pool.num_free_blocks - cached
    return free, cached, owned


def test_pool_allocate_free_and_double_free():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert len(set(blocks)) == 3 and pool.num_free_blocks == 1
    pool.free(blocks)
    pool.check_invariants()
    try:
        pool.free(blocks[:1])
    except RuntimeError as e:
        assert "double free" in str(e)
    else:
        raise AssertionError("double free went unnoticed")


def test_prefix_hit_reuses_full_blocks_only():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = _req("a", list(range(10)))  # 2 full blocks + 2 tokens
    assert kv.allocate_slots("a", 10)
    a.num_computed_tokens = 10
    kv.commit_computed(a)
    b = _req("b", list(range(8)) + [99, 98, 97])
    hits = kv.match_prefix(b)
    assert hits == kv.block_table("a")[:2]
    assert kv.allocate_slots("b", 11, hits)
    assert kv.block_table("b")[:2] == hits and kv.pool.ref_count(hits[0]) == 2
    kv.check_invariants()
    # a prompt entirely made of cached blocks still computes its last token: last block not reused
    c = _req("c", list(range(8)))
    assert len(kv.match_prefix(c)) == 1
    kv.forget("a"), kv.forget("b")
    assert kv.num_free_blocks == 16 and kv.pool.num_cached_blocks == 2


def test_cached_blocks_are_evicted_lru_leaves_first():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = _req("a", [1, 2, 3, 4, 5, 6])
    kv.allocate_slots("a", 6)
    a.num_computed_tokens = 6
    kv.commit_computed(a)
    root, mid, leaf = kv.block_table("a")
    kv.forget("a")
    assert kv.pool.num_cached_blocks == 3
    kv.allocate_slots("x", 4)  # needs 2 blocks: the never-used one, then the leaf
    assert kv.block_table("x") == [3, leaf]
    assert kv.pool.is_cached(root) and kv.pool.stats.evictions == 1
    assert kv.match_prefix(_req("b", [1, 2, 3, 4, 9])) == [root, mid]


def test_fork_shares_full_blocks_and_copies_partial():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.allocate_slots("p", 10)
    copies = kv.fork("p", "c", 9)  # 2 full blocks shared, block 3 (1 token) copied
    parent, child = kv.block_table("p"), kv.block_table("c")
    assert child[:2] == parent[:2] and child[2] != parent[2]
    assert copies == [(parent[2], child[2])]
    kv.check_invariants()
    kv.forget("p")
    kv.forget("c")
    assert kv.num_free_blocks == 8


def test_randomized_operations_keep_invariants():
    """Thousands of random admit / extend / fork / finish / abort / preempt operations."""
    rng = random.Random(1234)
    bs, total = 4, 48
    kv = KVCacheManager(num_blocks=total, block_size=bs)
    prefixes = [[rng.randrange(50) for _ in range(rng.randint(0, 12))] for _ in range(4)]
    live: dict[str, Request] = {}
    next_id = 0
    for _step in range(4000):
        op = rng.random()
        if op < 0.3 or not live:  # admit a request, reusing a cached prefix when there is one
            rid = f"r{next_id}"
            next_id += 1
            req = _req(rid, rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randint(1, 10))])
            hits = kv.match_prefix(req)
            if kv.allocate_slots(rid, req.num_tokens, hits):
                req.num_computed_tokens = req.num_tokens
                kv.commit_computed(req)
                live[rid] = req
            else:
                kv.forget(rid)
        elif op < 0.55:  # extend by one generated token
            req = live[rng.choice(sorted(live))]
            if kv.allocate_slots(req.request_id, req.num_tokens + 1):
                req.output_token_ids.append(rng.randrange(50))
                req.num_computed_tokens += 1
                kv.commit_computed(req)
        elif op < 0.65:  # fork (n > 1)
            parent = live[rng.choice(sorted(live))]
            rid = f"r{next_id}"
            next_id += 1
            copies = kv.fork(parent.request_id, rid, parent.num_tokens)
            if copies is None:
                continue
            child = _req(rid, parent.all_token_ids)
            child.num_computed_tokens = child.num_tokens
            live[rid] = child
        elif op < 0.8:  # preempt: blocks go back, full ones stay cached
            req = live.pop(rng.choice(sorted(live)))
            kv.free(req.request_id)
            kv.forget(req.request_id)
        else:  # finish or abort
            kv.forget(live.pop(rng.choice(sorted(live))).request_id)
        kv.check_invariants()
        free, cached, owned = _state_counts(kv)
        assert free + cached + owned == total
    for rid in list(live):
        kv.forget(rid)
    kv.check_invariants()
    free, cached, owned = _state_counts(kv)
    assert owned == 0 and free + cached == total
    assert kv.pool.stats.evictions > 0 and kv.prefix_stats.queries == 0  # stats are recorded by the scheduler
