"""`kvserve bench cluster`: the planner's step costs, and the real routers over simulated replicas."""

from __future__ import annotations

import dataclasses

import pytest

from kvserve.bench import cluster
from kvserve.planner.capacity import kv_bytes_per_token_of
from kvserve.planner.roofline import decode_step, mixed_step, prefill

SMALL = cluster.Workload(sessions_per_replica=6, rate_per_replica=4.0, system_prompts=2, system_len=600,
                         turns=(2, 4), user_len=(20, 200), reply_len=(5, 40), think_s=0.5)


@pytest.fixture(scope="module")
def setup():
    return cluster.make_setup("Mistral-7B-v0.1", "H100-SXM", 16)  # windowed: exercises both attention sums


def _with_blocks(setup, blocks: int):
    return dataclasses.replace(setup, kv_cache_memory_bytes=blocks * setup.block_size * kv_bytes_per_token_of(setup))


@pytest.mark.parametrize("users, context", [(1, 100), (32, 5000)])
def test_a_step_of_decodes_costs_what_the_planner_says_a_decode_step_costs(setup, users, context):
    assert mixed_step(setup, [context] * users, []) == decode_step(setup, users, context)


@pytest.mark.parametrize("tokens", [1, 300, 9000])
def test_a_step_of_one_whole_prompt_costs_a_prefill(setup, tokens):
    assert mixed_step(setup, [], [(0, tokens)]) == prefill(setup, tokens)


def test_chunks_after_a_hit_cost_less_than_the_whole_prompt_and_more_than_nothing(setup):
    whole = mixed_step(setup, [], [(0, 4000)]).seconds
    assert 0 < mixed_step(setup, [], [(3000, 1000)]).seconds < whole


def test_every_request_completes_and_one_replica_is_the_same_under_every_router(setup):
    rows = [cluster.run_one(setup, r, 1, SMALL) for r in ("round-robin", "least-load", "prefix-aware")]
    assert len({tuple(sorted(r.items() - {("router", r["router"])})) for r in rows}) == 1
    sessions = cluster.make_sessions(SMALL, 1)
    assert rows[0]["requests"] == sum(len(s.turns) for s in sessions)
    assert 0 < rows[0]["ttft_p50_s"] <= rows[0]["ttft_p99_s"]


def test_prefix_aware_routing_keeps_conversations_where_their_history_is_cached(setup):
    rr = cluster.run_one(setup, "round-robin", 4, SMALL)
    pa = cluster.run_one(setup, "prefix-aware", 4, SMALL)
    assert rr["requests"] == pa["requests"]
    assert pa["prefix_hit_rate"] > rr["prefix_hit_rate"] + 0.1


def test_a_replica_never_holds_more_blocks_than_its_pool(setup, monkeypatch):
    tight = _with_blocks(setup, 96)
    seen = []
    finish = cluster.Replica.finish_step

    def watched(self, now):
        seen.append(self.reserved)
        assert self.reserved <= self.num_blocks and len(self.cache) <= self.num_blocks - self.reserved
        return finish(self, now)

    monkeypatch.setattr(cluster.Replica, "finish_step", watched)
    row = cluster.run_one(tight, "prefix-aware", 2, dataclasses.replace(SMALL, system_len=300))
    assert row["requests"] > 0 and max(seen) > 48  # the pool filled past half, and it held


def test_a_request_larger_than_a_replica_s_pool_is_a_clear_error(setup):
    tiny = _with_blocks(setup, 8)
    with pytest.raises(ValueError, match="needs .* KV blocks; a replica has 8"):
        cluster.run_one(tiny, "round-robin", 1, SMALL)


def test_the_command_prints_a_row_per_router_and_replica_count_and_plots(tmp_path, capsys):
    from kvserve.cli import main

    png = tmp_path / "cluster.png"
    args = ["bench", "cluster", "--replicas", "1,2", "--router", "round-robin,prefix-aware",
            "--sessions-per-replica", "3", "--system-len", "200", "--plot", str(png)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.count("round-robin") == 2 and out.count("prefix-aware") == 2
    assert png.stat().st_size > 1000
    assert main(["bench", "cluster", "--router", "random"]) == 2
