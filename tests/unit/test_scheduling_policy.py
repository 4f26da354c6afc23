"""Admission order of the scheduler's policies, on the scheduler alone (no model)."""

import pytest

from kvserve.config import SchedulerConfig
from kvserve.kv_cache.manager import KVCacheManager
from kvserve.request import Request
from kvserve.scheduler.scheduler import Scheduler
from kvserve.types import SamplingParams


def _scheduler(policy: str, budget: int, max_num_seqs: int = 64, num_blocks: int = 512) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, policy=policy)
    return Scheduler(config, KVCacheManager(num_blocks=num_blocks, block_size=4))


def _add(sched: Scheduler, rid: str, prompt_len: int, first_token: int = 1, priority: int = 0) -> None:
    prompt = [first_token + i for i in range(prompt_len)]
    sched.add_request(Request(rid, prompt, SamplingParams(max_tokens=4), priority=priority))


def _admission_order(sched: Scheduler) -> list[str]:
    """Run steps (no model: every scheduled token counts as computed) until nothing waits."""
    order = []
    while sched.waiting:
        out = sched.schedule()
        order += [s.request_id for s in out.scheduled if s.request_id not in order]
        sched.update_after_step(out)
    return order


def test_fcfs_admits_in_arrival_order():
    sched = _scheduler("fcfs", budget=64)
    for rid, n in [("a", 40), ("b", 8), ("c", 20), ("d", 4)]:
        _add(sched, rid, n, first_token=100 * ord(rid))
    assert _admission_order(sched) == ["a", "b", "c", "d"]


def test_shortest_first_admits_the_least_work_first():
    sched = _scheduler("shortest-first", budget=16)
    for rid, n in [("a", 40), ("b", 8), ("c", 20), ("d", 4)]:
        _add(sched, rid, n, first_token=100 * ord(rid))
    assert _admission_order(sched) == ["d", "b", "c", "a"]


def test_shortest_first_bounds_how_long_a_long_prompt_waits():
    # The budget is 8 tokens a step, so "long" may be overtaken by 4 x 8 = 32 tokens of later,
    # shorter arrivals (one per step here), then it goes next.
    sched = _scheduler("shortest-first", budget=8)
    _add(sched, "long", 60, first_token=1000)
    _add(sched, "s0", 8, first_token=2000)
    order = []
    for i in range(1, 12):
        out = sched.schedule()
        order += [s.request_id for s in out.scheduled if s.request_id not in order]
        sched.update_after_step(out)
        _add(sched, f"s{i}", 8, first_token=2000 + 100 * i)
    # s0 came with "long" (not charged); s1-s4 came later, 32 tokens: then "long" went next.
    assert order[:6] == ["s0", "s1", "s2", "s3", "s4", "long"], order
    assert sched.requests["long"].num_overtaken_tokens == 32


def test_shortest_first_orders_a_burst_by_length_alone():
    # Requests that arrive before the same step are a burst: however many short ones came with it,
    # none of them counts as overtaking "long", which goes last.
    sched = _scheduler("shortest-first", budget=8)
    _add(sched, "long", 60, first_token=1000)
    for i in range(10):
        _add(sched, f"s{i}", 8, first_token=2000 + 100 * i)
    order = _admission_order(sched)
    assert order == [f"s{i}" for i in range(10)] + ["long"], order
    assert sched.requests["long"].num_overtaken_tokens == 0


def test_a_chunk_that_cannot_finish_its_prompt_does_not_delay_first_tokens():
    # Budget 16: "short" (6 tokens) gets its first token this step; "long" (20) could not finish its
    # prompt in the 10 left, so it starts next step instead of lengthening this one.
    sched = _scheduler("shortest-first", budget=16)
    _add(sched, "short", 6, first_token=100)
    _add(sched, "long", 20, first_token=500)
    out = sched.schedule()
    assert [(s.request_id, len(s.token_ids)) for s in out.scheduled] == [("short", 6)]
    sched.update_after_step(out)
    sched.requests["short"].output_token_ids.append(7)  # its first token, as the engine appends it
    out = sched.schedule()  # a decode alone does not hold a chunk back
    assert [(s.request_id, len(s.token_ids)) for s in out.scheduled] == [("short", 1), ("long", 15)]


def test_shortest_first_counts_a_cached_prefix_as_done():
    sched = _scheduler("shortest-first", budget=64)
    _add(sched, "warm", 32, first_token=7)
    while sched.requests["warm"].num_computed_tokens < 32:  # "warm" computes its prompt; its blocks are cached
        out = sched.schedule()
        sched.update_after_step(out)
    _add(sched, "new", 12, first_token=5000)
    _add(sched, "same_prefix", 36, first_token=7)  # 36 tokens, the first 32 cached: 4 left to compute
    out = sched.schedule()
    admitted = [s.request_id for s in out.scheduled if s.request_id != "warm"]
    assert admitted[0] == "same_prefix"


def test_priority_still_comes_before_length():
    sched = _scheduler("shortest-first", budget=8)
    _add(sched, "urgent_long", 30, first_token=100, priority=0)
    _add(sched, "short", 4, first_token=500, priority=1)
    assert _admission_order(sched) == ["urgent_long", "short"]


def test_unknown_policy_is_rejected():
    with pytest.raises(ValueError, match="scheduling_policy"):
        SchedulerConfig(policy="lifo")


def test_cli_flag_reaches_the_scheduler_config():
    from kvserve.cli import build_parser
    from kvserve.entrypoints.cli import engine_kwargs
    from kvserve.entrypoints.llm import engine_config

    args = build_parser().parse_args(["serve", "--scheduling-policy", "shortest-first"])
    assert engine_config(**engine_kwargs(args)).scheduler.policy == "shortest-first"
    assert engine_config(scheduling_policy="fcfs").scheduler.policy == "fcfs"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--scheduling-policy", "lifo"])
