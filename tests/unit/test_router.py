"""The replica router's choices, the front end's health rounds, the merged /metrics text, and the replicas' argv."""

from __future__ import annotations

import pytest

from kvserve.entrypoints.cluster.proxy import merge_metrics, pool_blocks
from kvserve.entrypoints.cluster.router import LeastLoad, PrefixAware, RoundRobin, make_router
from kvserve.entrypoints.cluster.serve import replica_argv
from kvserve.kv_cache.hashing import chain_keys

SYSTEM = list(range(100, 164))  # 4 blocks of 16 shared by a conversation's turns


def test_prefix_aware_sends_a_conversation_back_to_its_replica():
    r = PrefixAware(3, block_size=16)
    first = r.choose(SYSTEM + [1] * 20)
    r.started(first)
    other = r.choose(list(range(500, 564)))  # no shared prefix: the least loaded, not ``first``
    assert other != first
    for _ in range(5):  # later turns resend the history: same replica while the load allows
        assert r.choose(SYSTEM + [1] * 20 + [2] * 16) == first


def test_prefix_aware_yields_to_balance():
    r = PrefixAware(2, block_size=16, balance_abs=4, balance_rel=1.5)
    home = r.choose(SYSTEM)
    for _ in range(4):
        r.started(home)
    assert r.choose(SYSTEM) == home  # 4 more in flight than the other: within balance_abs
    r.started(home)
    assert r.choose(SYSTEM) != home  # 5 more, and more than 1.5x: the idle replica takes it


def _chat(n: int, turns: int = 1) -> list[int]:
    """Conversation ``n``: the shared system prompt, its own 30-block document, then ``turns`` - 1 more blocks."""
    return SYSTEM + list(range(10_000 * (n + 1), 10_000 * (n + 1) + 480)) + [n] * 16 * (turns - 1)


def test_new_conversations_sharing_a_system_prompt_spread_by_pool_room():
    # All arrive before any finishes, and only the system prompt (4 of 34 blocks) is shared: each
    # goes where there is the most room, so the histories split 2/2 rather than piling up where
    # the system prompt is (which the load threshold would allow up to 5 more in flight).
    r = PrefixAware(2, block_size=16, balance_abs=4)
    homes = []
    for n in range(4):
        homes.append(r.choose(_chat(n)))
        r.started(homes[-1])
    assert sorted(homes) == [0, 0, 1, 1]
    for n in range(4):  # later turns (most of their blocks matched) go back to their history
        assert r.choose(_chat(n, turns=2)) == homes[n]


def test_the_picture_of_a_pool_evicts_tail_first_and_keeps_its_capacity():
    r = PrefixAware(1, block_size=16)
    r.set_capacity(0, 40)
    a, b = _chat(0), _chat(1)
    keys = [k.hash for k in chain_keys(a, 16, [])]
    r.choose(a)
    assert r.matched_blocks(0, keys) == 34
    r.choose(b)  # 30 new blocks: 24 of a's go, from its tail, so its head still matches
    assert len(r.trees[0]) == 40 and r.matched_blocks(0, keys) == 10


def test_a_conversation_whose_history_was_evicted_goes_where_it_displaces_the_least():
    r = PrefixAware(2, block_size=16)
    for i in range(2):
        r.set_capacity(i, 34)  # one chat each
    assert r.choose(_chat(0)) == 0
    assert r.choose(_chat(1)) == 1  # only the system prompt matches on 0: the empty pool takes it
    assert r.choose(_chat(2)) == 0  # both full: replica 0's oldest block (chat 0's) is the older
    turn = [k.hash for k in chain_keys(_chat(0, turns=2), 16, [])]
    assert r.matched_blocks(0, turn) == 4  # chat 0's history is evicted on 0, only the system prompt left
    assert r.choose(_chat(0, turns=2)) == 1  # chat 1's blocks are now the oldest anywhere


def test_pool_blocks_reads_the_replicas_gauge():
    text = ('# TYPE kvserve:kv_cache_blocks_in_use gauge\nkvserve:kv_cache_blocks_in_use{model_name="m",kind="full"} 7.0\n'
            '# TYPE kvserve:kv_cache_blocks gauge\nkvserve:kv_cache_blocks{model_name="m"} 480.0\n')
    assert pool_blocks(text) == 480
    assert pool_blocks("kvserve:num_requests_running 1.0\n") is None


def test_prefix_aware_forgets_a_replica_that_went_down():
    r = PrefixAware(2, block_size=16)
    home = r.choose(SYSTEM)
    r.mark_down(home)
    assert r.choose(SYSTEM) != home
    r.mark_up(home)
    assert r.matched_blocks(home, [k for k in range(4)]) == 0 and not r.trees[home]


def test_round_robin_and_least_load_skip_replicas_that_are_down():
    rr = RoundRobin(3)
    rr.mark_down(1)
    assert [rr.choose([]) for _ in range(4)] == [0, 2, 0, 2]
    ll = LeastLoad(3)
    ll.started(0)
    ll.started(2)
    assert ll.choose([]) == 1
    assert ll.choose([], exclude=frozenset({1})) in (0, 2)
    for i in range(3):
        ll.mark_down(i)
    with pytest.raises(LookupError):
        ll.choose([])
    with pytest.raises(ValueError, match="router"):
        make_router("random", 2)


def test_merged_metrics_keep_each_family_together_with_a_replica_label():
    text = ('# HELP kvserve:num_requests_running Running.\n# TYPE kvserve:num_requests_running gauge\n'
            'kvserve:num_requests_running 3.0\n# HELP kvserve:ttft_seconds TTFT.\n# TYPE kvserve:ttft_seconds histogram\n'
            'kvserve:ttft_seconds_bucket{le="0.1"} 1.0\nkvserve:ttft_seconds_count 1.0\n')
    merged = merge_metrics([text, text.replace("3.0", "5.0")]).splitlines()
    assert merged.count("# TYPE kvserve:num_requests_running gauge") == 1
    i = merged.index("# TYPE kvserve:num_requests_running gauge")
    assert merged[i + 1:i + 3] == ['kvserve:num_requests_running{replica="0"} 3.0',
                                   'kvserve:num_requests_running{replica="1"} 5.0']
    assert 'kvserve:ttft_seconds_bucket{replica="1",le="0.1"} 1.0' in merged
    assert merge_metrics(["", text]).count("replica=\"1\"") == 3


def test_replicas_get_every_flag_but_the_front_ends():
    argv = ["model.gguf", "--port", "9000", "--host=0.0.0.0", "--data-parallel-size", "2", "--router=round-robin",
            "--distributed-backend", "ray", "--ray-address", "auto", "--api-key", "k", "--max-num-seqs", "8"]
    assert replica_argv(argv) == ["model.gguf", "--api-key", "k", "--max-num-seqs", "8"]


def test_the_front_end_checks_the_key_and_the_body_size_before_any_replica():
    from starlette.testclient import TestClient

    from kvserve.entrypoints.cluster.proxy import Cluster, build_cluster_app
    from kvserve.entrypoints.cluster.router import make_router

    router = make_router("prefix-aware", 1)
    router.mark_down(0)  # what passes the edge is answered 503: no replica is up
    app = build_cluster_app(Cluster([], router, None, "k"), ("m",), max_request_bytes=1000,
                            metrics_require_key=True)
    with TestClient(app) as http:
        small = {"model": "m", "prompt": [1, 2], "max_tokens": 2}
        assert http.post("/v1/completions", json=small).status_code == 401
        assert http.get("/v1/models").status_code == 401
        assert http.get("/metrics").status_code == 401
        key = {"Authorization": "Bearer k"}
        big = http.post("/v1/completions", headers=key, json={**small, "prompt": "x" * 2000})
        assert big.status_code == 413 and big.json()["error"]["message"]
        assert http.post("/v1/chat/completions", headers=key, json=small).status_code == 503
        assert http.get("/v1/models", headers=key).json()["data"][0]["id"] == "m"
        assert http.get("/health").status_code == 503


class _Replica:
    """A real HTTP server standing in for a replica: /health and /metrics answer what ``state`` says."""

    def __init__(self) -> None:
        import http.server
        import threading

        state = self.state = {"health": 503, "blocks": None}

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/health":
                    code, body = state["health"], b"{}"
                elif self.path == "/metrics" and state["blocks"] is not None:
                    code, body = 200, f"kvserve:kv_cache_blocks {state['blocks']}.0\n".encode()
                else:
                    code, body = 503, b""
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def alive(self) -> bool:
        return True

    def up(self, blocks: int | None) -> None:
        self.state.update(health=200 if blocks is not None else 503, blocks=blocks)


def test_a_replica_that_comes_back_up_has_its_pool_read_again():
    import asyncio

    from kvserve.entrypoints.cluster.proxy import Cluster

    replica = _Replica()
    router = make_router("prefix-aware", 1)
    cluster = Cluster([replica], router, None, None)

    async def scenario() -> list:
        seen = []
        await cluster.learn_pools()  # down at start: no pool known, the router keeps its default
        seen.append((router.healthy[0], cluster.kv_blocks[0]))
        await cluster.refresh_health()
        seen.append((router.healthy[0], cluster.kv_blocks[0]))
        for blocks in (40, None, 24):  # up, then down, then restarted with a smaller pool
            replica.up(blocks)
            await cluster.refresh_health()
            seen.append((router.healthy[0], cluster.kv_blocks[0], router.capacity[0]))
        await cluster.client.aclose()
        return seen

    try:
        seen = asyncio.run(scenario())
    finally:
        replica.server.shutdown()
    assert seen == [(True, None), (False, None), (True, 40, 40), (False, 40, 40), (True, 24, 24)]
