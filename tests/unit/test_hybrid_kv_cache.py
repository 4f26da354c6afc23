"""KV groups of hybrid models (kv_cache/groups.py, kv_cache/hybrid.py) alone: the layout, the sizing
both the engine and the planner use, and the manager: window groups bounded by their window while
full groups grow, prefix hits, forks and all-or-nothing allocation, nothing leaked."""

from __future__ import annotations

import pytest

from kvserve.kv_cache.groups import kv_layout
from kvserve.kv_cache.hybrid import HybridKVCacheManager, make_kv_cache
from kvserve.kv_cache.manager import RELEASED, KVCacheManager
from kvserve.kv_cache.sizing import (
    kv_block_bytes,
    kv_capacity_tokens,
    kv_num_groups,
    max_sequence_blocks,
    max_window_blocks,
    num_kv_blocks_for_budget,
)
from kvserve.request import Request
from kvserve.types import SamplingParams

W = 8  # window
GEMMA2 = (W, None, W, None)


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=1000))


def _manager(windows=GEMMA2, num_blocks=64, block_size=4) -> HybridKVCacheManager:
    kv = make_kv_cache(num_blocks, block_size, kv_layout(windows, len(windows)))
    assert isinstance(kv, HybridKVCacheManager)
    return kv


def _compute(kv, request: Request, upto: int) -> None:
    """Run the request to ``upto`` computed tokens one token at a time (as decode steps do)."""
    while request.num_computed_tokens < upto:
        assert kv.allocate_slots(request.request_id, request.num_computed_tokens + 1)
        request.num_computed_tokens += 1
        kv.commit_computed(request)


def test_layouts():
    gemma2 = kv_layout(GEMMA2, 4)
    assert [(g.window, g.layers) for g in gemma2.groups] == [(None, (1, 3)), (W, (0, 2))]
    assert gemma2.group_of_layer() == [1, 0, 1, 0] and gemma2.slot_of_layer() == [0, 0, 1, 1]
    gemma3 = kv_layout((W,) * 5 + (None,), 6)  # five local per global: one layer per block
    assert gemma3.layers_per_block == 1 and [g.window for g in gemma3.groups] == [None] + [W] * 5
    gemma3_1b = kv_layout(tuple(None if (i + 1) % 6 == 0 else W for i in range(26)), 26)  # 4 global, 22 local
    assert gemma3_1b.layers_per_block == 2 and gemma3_1b.num_groups == 13 == kv_num_groups([4, 22])
    assert sorted(i for g in gemma3_1b.groups for i in g.layers) == list(range(26))
    # one group when the layers attend alike, or when the runner cannot read per-group tables
    assert kv_layout((None,) * 4, 4).groups[0].window is None and not kv_layout((None,) * 4, 4).is_hybrid
    assert kv_layout((W,) * 4, 4).groups[0].window == W
    assert not kv_layout(GEMMA2, 4, hybrid=False).is_hybrid and kv_layout(GEMMA2, 4, False).groups[0].window is None
    assert isinstance(make_kv_cache(8, 4, kv_layout((W,) * 2, 2)), KVCacheManager)


def test_sizing_counts_a_block_as_one_groups_layers():
    per_token, bs = 1000, 4  # all layers
    budget = 64 * bs * per_token  # 64 blocks of every layer
    assert num_kv_blocks_for_budget(budget, bs, per_token) == 64
    assert num_kv_blocks_for_budget(budget, bs, per_token, num_groups=2) == 128  # half the layers per block
    assert kv_block_bytes(bs, per_token, 2) * 128 == budget
    assert kv_capacity_tokens(budget, bs, per_token, 2) == kv_capacity_tokens(budget, bs, per_token) == 64 * bs
    # one sequence: the full groups grow once the window groups hold their most
    assert max_sequence_blocks(128, 1, 1, 3) == 125
    assert max_sequence_blocks(128, 1, 0, 0) == 128 and max_sequence_blocks(128, 0, 1, 3) is None
    assert max_sequence_blocks(4, 1, 1, 5) == 2  # the window does not fit: every group counted in full


def test_window_group_is_bounded_while_the_full_group_grows():
    bs = 4
    kv = _manager(num_blocks=64, block_size=bs)
    r = _req("r", list(range(4 * W)))
    peak = 0
    while r.num_computed_tokens < 4 * W:
        assert kv.allocate_slots("r", r.num_computed_tokens + 1)
        peak = max(peak, kv.groups[1].num_held_blocks("r"))
        r.num_computed_tokens += 1
        kv.commit_computed(r)
        kv.check_invariants()
    assert peak == max_window_blocks(W, bs) <= W // bs + 2
    assert kv.groups[0].num_held_blocks("r") == 4 * W // bs  # every block kept
    assert kv.held_blocks_by_kind() == {"full": 4 * W // bs, "window": kv.groups[1].num_held_blocks("r")}
    assert len(kv.block_table("r")) == len(kv.block_tables("r")[1])  # positions keep their indices
    kv.forget("r")
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_blocks


def test_allocation_is_all_or_nothing_across_groups():
    kv = _manager(num_blocks=5, block_size=4)
    assert kv.allocate_slots("a", 8)  # 2 blocks in each group
    assert not kv.allocate_slots("b", 8)  # 4 needed, 1 free: neither group takes one
    assert kv.block_tables("b") == [[], []] and kv.num_free_blocks == 1
    kv.check_invariants()


def test_prefix_hit_past_the_window():
    """A later request reuses a long cached prefix: every full-group block, and of each window group
    only the blocks its first computed token's window reads (the rest are RELEASED, not taken)."""
    bs = 4
    kv = _manager(num_blocks=64, block_size=bs)
    first = _req("a", list(range(40)))
    _compute(kv, first, 40)
    kv.forget("a")
    second = _req("b", list(range(36)) + [99, 98])
    hits = kv.match_prefix(second)
    assert len(hits) == 9  # 36 tokens
    assert all(h[0] != RELEASED for h in hits)
    window_start = (36 - W + 1) // bs
    assert all(h[1] == RELEASED for h in hits[:window_start]) and all(h[1] != RELEASED for h in hits[window_start:])
    free_before = kv.num_free_blocks
    assert kv.allocate_slots("b", 38, hits)
    assert kv.block_table("b")[:9] == [h[0] for h in hits]
    assert kv.groups[1].num_held_blocks("b") == 10 - window_start
    assert free_before - kv.num_free_blocks == 9 + 1 + (9 - window_start) + 1
    kv.check_invariants()
    kv.forget("b")
    assert kv.num_free_blocks == kv.num_blocks


def test_evicted_window_blocks_cost_no_hit():
    """The blocks a window group released early are the first evicted; a later hit does not need them.
    14 blocks: the full group's 10 and 4 the window group cycles through, evicting its own old blocks."""
    bs = 4
    kv = _manager(num_blocks=14, block_size=bs)
    _compute(kv, _req("a", list(range(40))), 40)
    kv.forget("a")
    assert kv.pool.stats.evictions > 0
    assert kv.groups[1].cached_blocks(_req("b", list(range(36)) + [1]), 9)[0] is None  # gone
    hits = kv.match_prefix(_req("b", list(range(36)) + [1]))
    assert len(hits) == 9
    assert kv.allocate_slots("b", 37, hits)
    kv.check_invariants()


def test_fork_shares_every_group_and_copies_each_partial_block():
    kv = _manager(num_blocks=32, block_size=4)
    leader = _req("l", list(range(6)))
    _compute(kv, leader, 6)
    assert kv.can_fork("l", 6)
    copies = kv.fork("l", "c", 6)
    assert len(copies) == 2  # one partly filled block per group
    assert [t[0] for t in kv.block_tables("c")] == [t[0] for t in kv.block_tables("l")]
    kv.check_invariants()
    for rid in ("l", "c"):
        kv.forget(rid)
    assert kv.num_free_blocks == kv.num_blocks


def test_prefix_caching_off_and_on_again():
    kv = _manager()
    kv.enable_prefix_caching = False
    assert all(not g.enable_prefix_caching for g in kv.groups)
    assert kv.match_prefix(_req("x", list(range(20)))) == []
    kv.enable_prefix_caching = True
    assert kv.enable_prefix_caching


@pytest.mark.parametrize("windows", [(W,) * 5 + (None,), (None, W, 2 * W, None)])
def test_random_workload_leaves_nothing_behind(windows):
    import random

    rng = random.Random(0)
    kv = _manager(windows, num_blocks=96, block_size=4)
    live: dict[str, Request] = {}
    for step in range(300):
        if len(live) < 4 and rng.random() < 0.3:
            rid = f"r{step}"
            req = _req(rid, [rng.randrange(3) for _ in range(rng.randrange(2, 30))])
            hits = kv.match_prefix(req)
            if kv.allocate_slots(rid, len(hits) * 4 + 1, hits):
                req.num_computed_tokens = len(hits) * 4
                live[rid] = req
        for rid, req in list(live.items()):
            n = min(rng.randrange(1, 6), req.num_tokens - req.num_computed_tokens) or 1
            if req.num_computed_tokens + n > req.num_tokens:
                req.output_token_ids.append(rng.randrange(3))
            if not kv.allocate_slots(rid, req.num_computed_tokens + n):
                kv.free(rid)
                del live[rid]
                continue
            req.num_computed_tokens += n
            kv.commit_computed(req)
            if req.num_tokens > 60:
                kv.forget(rid)
                del live[rid]
        kv.check_invariants()
    for rid in live:
        kv.forget(rid)
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_blocks


def test_metrics_report_blocks_by_kind():
    from kvserve.engine.stats import EngineSnapshot
    from kvserve.metrics.prometheus import PrometheusMetrics

    metrics = PrometheusMetrics("m")
    metrics.set_snapshot(EngineSnapshot(kv_cache_blocks=96, kv_blocks_in_use={"full": 7, "window": 3}), 0)
    text = metrics.render().decode()
    assert 'kvserve:kv_cache_blocks_in_use{kind="full",model_name="m"} 7.0' in text
    assert 'kvserve:kv_cache_blocks_in_use{kind="window",model_name="m"} 3.0' in text
    assert 'kvserve:kv_cache_blocks{model_name="m"} 96.0' in text
