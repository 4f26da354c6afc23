"""AsyncEngineClient in-process on a tiny model: outputs equal the offline API's, aborts free blocks,
the queue bound holds, and a dead engine loop turns health red instead of hanging requests."""

from __future__ import annotations

import asyncio
import gc

import pytest
from starlette.testclient import TestClient

from kvserve import LLM, SamplingParams
from kvserve.entrypoints.llm import engine_config
from kvserve.entrypoints.openai.app import ServerOptions, build_app
from kvserve.frontend.client import AddRequest, AsyncEngineClient, EngineDeadError, EngineNotReadyError, QueueFullError
from kvserve.frontend.llm_engine import LLMEngine
from kvserve.metrics.stats import StatsCollector
from kvserve.metrics.totals import Totals

OPTIONS = {"dtype": "float32", "block_size": 8, "num_kv_blocks": 64, "max_num_seqs": 4,
           "max_num_batched_tokens": 256, "seed": 0, "max_model_len": None, "kv_cache_memory_bytes": 1 << 30,
           "device": "cpu"}
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _config(model_dir, **overrides):
    return engine_config(model=str(model_dir), **{**OPTIONS, **overrides})


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_outputs_equal_offline_and_blocks_come_back(tiny_llama):
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [5, 6, 7], [14]]
    offline = LLM(model=str(tiny_llama), **{k: v for k, v in OPTIONS.items() if k not in ("device",)})
    want = [o.token_ids for o in offline.generate(prompts, GREEDY)]

    async def main():
        client = AsyncEngineClient(_config(tiny_llama))
        with pytest.raises(EngineNotReadyError):
            client.submit("early", [5], GREEDY)
        client.start()
        await client.wait_ready()
        outs = await asyncio.gather(*(client.submit(f"r{i}", p, GREEDY).result() for i, p in enumerate(prompts)))
        stream = client.submit("long", [5, 6], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
        async for out in stream:
            if len(out.token_ids) >= 2:
                break
        busy = client.snapshot.kv_cache_usage
        stream.close()
        for _ in range(100):
            if client.snapshot.kv_cache_usage == 0:
                break
            await asyncio.sleep(0.02)
        idle = client.snapshot.kv_cache_usage
        client.shutdown()
        return [o.token_ids for o in outs], busy, idle

    got, busy, idle = _run(main())
    assert got == want
    assert busy > 0 and idle == 0


@pytest.mark.parametrize("freeze", [False, True])
def test_start_up_objects_are_frozen_only_when_asked(tiny_llama, freeze):
    """``kvserve serve`` owns its process: its start-up objects leave the cyclic GC's reach while it
    serves and come back at shutdown. A client in a shared process (these tests) leaves the GC alone."""
    assert gc.get_freeze_count() == 0

    async def main():
        client = AsyncEngineClient(_config(tiny_llama), freeze_gc=freeze)
        client.start()
        await client.wait_ready()
        out = await client.submit("r", [5, 6, 7], GREEDY).result()
        frozen = gc.get_freeze_count()
        client.shutdown()
        return out, frozen

    try:
        out, frozen = _run(main())
        assert len(out.token_ids) == GREEDY.max_tokens
        assert (frozen > 10_000) == freeze and gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()


def test_warm_up_leaves_nothing_behind(tiny_llama):
    core = LLMEngine(_config(tiny_llama)).core
    free = core.kv_cache.num_free_blocks
    rate = core.warm_up(num_tokens=40)
    assert rate > 0
    assert not core.has_unfinished() and core.num_steps == 0 and core.num_batched_tokens == 0
    kv = core.kv_cache
    assert kv.num_free_blocks == free and kv.pool.num_cached_blocks == 0  # nothing left in the prefix cache
    assert kv.enable_prefix_caching and kv.prefix_stats.queries == 0
    core.add_request("busy", [5, 6], GREEDY)
    with pytest.raises(RuntimeError, match="idle"):
        core.warm_up()


def test_queue_bound_refuses_at_once(tiny_llama):
    async def main():
        client = AsyncEngineClient(_config(tiny_llama, max_num_seqs=1), max_queue=2)
        client.start()
        await client.wait_ready()
        long = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
        running = client.submit("running", [5, 6], long)
        await running.__anext__()  # it runs (max_num_seqs 1) ...
        streams = [running] + [client.submit(f"waits{i}", [5, 6], long) for i in range(2)]  # ... these wait
        with pytest.raises(QueueFullError, match="max-queue 2"):
            client.submit("one-too-many", [5], long)
        for s in streams:
            s.close()
        client.shutdown()

    _run(main())


def test_dead_engine_loop_fails_requests_and_health(tiny_llama, monkeypatch):
    def boom(self, *args, **kwargs):
        raise RuntimeError("simulated device failure")

    app = build_app(_config(tiny_llama), ServerOptions(("tiny",)))
    with TestClient(app) as http:
        client = app.state.kvserve.client
        _wait(lambda: client.is_ready)
        assert http.get("/health").status_code == 200
        monkeypatch.setattr(LLMEngine, "step", boom)
        response = http.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 4})
        assert response.status_code == 503 and "simulated device failure" in response.json()["error"]["message"]
        assert http.get("/health").status_code == 503
        with pytest.raises(EngineDeadError):
            client.ready_info()
        assert http.post("/v1/completions", json={"prompt": [5, 6]}).status_code == 503


def _wait(predicate, timeout: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


class _RecordingEngine:
    """Just enough of an LLMEngine for ``_handle_commands``: it records the requests it is given."""

    def __init__(self) -> None:
        self.added: list[str] = []

    def add_request(self, request_id, prompt_token_ids, params, priority=0) -> None:
        self.added.append(request_id)


def _add(request_id: str) -> AddRequest:
    return AddRequest(request_id, [5], GREEDY, 0.0)


def _idle_client(monkeypatch, quiet_s: float, max_wait_s: float,
                 gap_s: float | None = None) -> tuple[AsyncEngineClient, _RecordingEngine]:
    """A client (never started) whose command handling runs against a recording engine."""
    import kvserve.frontend.client as client_module

    monkeypatch.setattr(client_module, "BURST_QUIET_S", quiet_s)
    monkeypatch.setattr(client_module, "BURST_GAP_S", quiet_s if gap_s is None else gap_s)
    monkeypatch.setattr(client_module, "BURST_MAX_WAIT_S", max_wait_s)
    client = AsyncEngineClient(_config("unused"))
    monkeypatch.setattr(client, "_publish", lambda engine, outputs=None: None)
    return client, _RecordingEngine()


def test_an_idle_engine_takes_in_the_rest_of_a_burst_before_stepping(monkeypatch):
    import threading
    import time

    # Generous windows, so that a slow CI machine cannot make the test flaky.
    client, engine = _idle_client(monkeypatch, quiet_s=0.5, max_wait_s=5.0)
    client._commands.put(_add("first"))
    late = threading.Timer(0.05, lambda: client._commands.put(_add("second")))
    late.start()
    assert client._handle_commands(engine, block=True)
    assert engine.added == ["first", "second"]  # the second came 50 ms later, inside the quiet window

    # Busy (not blocking): only what is queued already; nothing is waited for.
    client._commands.put(_add("third"))
    start = time.perf_counter()
    assert client._handle_commands(engine, block=False)
    assert engine.added[-1] == "third" and time.perf_counter() - start < 0.4


def test_a_burst_widens_the_quiet_window(monkeypatch):
    import threading

    # A lone request steps after 0.05 s of quiet; once a second has come, a 0.3 s gap is waited out.
    client, engine = _idle_client(monkeypatch, quiet_s=0.05, max_wait_s=10.0, gap_s=1.0)
    client._commands.put(_add("first"))
    client._commands.put(_add("second"))
    threading.Timer(0.3, lambda: client._commands.put(_add("third"))).start()
    assert client._handle_commands(engine, block=True)
    assert engine.added == ["first", "second", "third"]

    lone, engine = _idle_client(monkeypatch, quiet_s=0.05, max_wait_s=10.0, gap_s=1.0)
    lone._commands.put(_add("alone"))
    later = threading.Timer(0.5, lambda: lone._commands.put(_add("later")))
    later.start()
    assert lone._handle_commands(engine, block=True)
    later.join()
    assert engine.added == ["alone"]  # a single request did not wait for the wide window


def test_a_lone_long_prompt_waits_longer_for_company(monkeypatch):
    import threading

    import kvserve.frontend.client as client_module

    # The first request's window is a tenth of the prefill it would run alone (at the warm-up's rate),
    # within [quiet_s, gap_s]: 5,000 tokens at 1,000 tokens/s wait 0.5 s, 10 tokens the 0.02 s floor.
    monkeypatch.setattr(client_module, "BURST_STEP_FRACTION", 0.1)
    for prompt_len, want in [(10, ["alone"]), (5000, ["alone", "later"])]:
        client, engine = _idle_client(monkeypatch, quiet_s=0.02, max_wait_s=10.0, gap_s=2.0)
        client._prefill_rate = 1000.0
        client._commands.put(AddRequest("alone", [5] * prompt_len, GREEDY, 0.0))
        later = threading.Timer(0.15, lambda c=client: c._commands.put(_add("later")))
        later.start()
        assert client._handle_commands(engine, block=True)
        later.join()
        assert engine.added == want, prompt_len
    assert client._first_quiet(AddRequest("x", [5] * 100_000, GREEDY, 0.0)) == 2.0  # capped at the gap window


def test_the_burst_wait_is_capped(monkeypatch):
    import threading
    import time

    client, engine = _idle_client(monkeypatch, quiet_s=1.0, max_wait_s=0.2)
    stop = threading.Event()

    def trickle():  # a request every 20 ms, never a quiet second (for 3 s, so a broken cap cannot hang)
        i = 0
        while not stop.wait(0.02) and i < 150:
            client._commands.put(_add(f"t{i}"))
            i += 1

    client._commands.put(_add("first"))
    feeder = threading.Thread(target=trickle)
    feeder.start()
    start = time.perf_counter()
    try:
        assert client._handle_commands(engine, block=True)
    finally:
        stop.set()
        feeder.join()
    assert 0.15 < time.perf_counter() - start < 1.0  # stepped after the cap, not after a quiet second
    assert len(engine.added) > 1


def test_an_idle_engine_waits_for_requests_still_in_the_http_layer(monkeypatch):
    import threading

    client, engine = _idle_client(monkeypatch, quiet_s=0.02, max_wait_s=10.0)
    arrival = client.incoming.arrived()  # a second request is being parsed
    client._commands.put(_add("first"))

    def submit_second():
        client._commands.put(_add("second"))
        arrival.handed_over()

    late = threading.Timer(0.3, submit_second)  # far past the quiet window
    late.start()
    assert client._handle_commands(engine, block=True)
    assert engine.added == ["first", "second"] and client.incoming.count == 0


def test_the_middleware_counts_a_request_until_it_is_handed_over_or_answered():
    import asyncio

    from kvserve.entrypoints.openai.app import CountIncoming
    from kvserve.frontend.client import IncomingRequests

    incoming = IncomingRequests()
    seen = []

    async def handler(scope, receive, send):  # submits, then fails: counted once, released once
        seen.append(incoming.count)
        scope["state"]["arrival"].handed_over()
        seen.append(incoming.count)
        raise RuntimeError("boom")

    async def refused(scope, receive, send):  # answered (400) without submitting
        seen.append(incoming.count)

    async def run(app, path, method="POST"):
        scope = {"type": "http", "method": method, "path": path}
        try:
            await CountIncoming(app, incoming)(scope, None, None)
        except RuntimeError:
            pass

    asyncio.run(run(handler, "/v1/completions"))
    asyncio.run(run(refused, "/v1/chat/completions"))
    asyncio.run(run(refused, "/v1/models", method="GET"))  # not a generation request: not counted
    assert seen == [1, 0, 1, 0] and incoming.count == 0


class _Maps(Totals):
    """The dashboard's totals, also keeping each published block map's in-use count."""

    def __init__(self) -> None:
        super().__init__()
        self.in_use: list[int] = []

    def set_snapshot(self, snapshot, new_preemptions: int) -> None:
        super().set_snapshot(snapshot, new_preemptions)
        if snapshot.block_map is not None:
            self.in_use.append(snapshot.block_map.counts["in_use"])


def test_a_watched_engine_shows_held_blocks_under_requests_shorter_than_the_map_period(tiny_llama, monkeypatch):
    # Back-to-back batches that each end well inside one map period: the maps published while they
    # run must still show their blocks, not only the idle maps taken between batches.
    monkeypatch.setattr("kvserve.frontend.client.BLOCK_MAP_PERIOD_S", 0.5)
    maps = _Maps()

    async def main():
        client = AsyncEngineClient(_config(tiny_llama), stats=StatsCollector(maps))
        client.start()
        await client.wait_ready()
        client.watch()
        short = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        deadline = asyncio.get_running_loop().time() + 2.0
        batches = 0
        while asyncio.get_running_loop().time() < deadline:
            await asyncio.gather(*(client.submit(f"b{batches}-{i}", [5 + i, 6, 7], short).result() for i in range(3)))
            batches += 1
        client.unwatch()
        client.shutdown()
        return batches

    batches = _run(main())
    assert batches >= 4, "each batch should end well inside the map period"
    assert max(maps.in_use) > 0
    assert maps.in_use[-1] == 0  # the last map, idle, is current
