"""Tensor parallelism (worker/tensor_parallel.py, model/sharding.py): two gloo ranks give the same
greedy tokens as one process, through chunked prefill, prefix-cache hits, preemption and speculation."""

from __future__ import annotations

import os
import random
import signal

import pytest

from kvserve import LLM, SamplingParams
from kvserve.config import ModelConfig, RopeConfig
from kvserve.engine.core import EngineFatalError
from kvserve.model.sharding import TensorShard
from tests.conftest import TINY_VOCAB, assert_no_leak, make_tiny_model

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


def _prompts(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, TINY_VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _workload(llm: LLM) -> tuple[list[list[int]], dict]:
    """Two rounds: long prompts in 32-token chunks through a pool too small for all of them (preemption),
    then prompts that share the first round's leading blocks (prefix-cache hits)."""
    first = _prompts(6, 30, 70, seed=1)
    second = [p[:24] + q for p, q in zip(first, _prompts(6, 3, 12, seed=2))]
    tokens = [o.token_ids for o in llm.generate(first, GREEDY)]
    tokens += [o.token_ids for o in llm.generate(second, GREEDY)]
    stats = llm.engine.core.stats()
    assert_no_leak(llm)
    return tokens, {"preemptions": stats.num_preemptions, "prefix_hits": stats.prefix_cache_hits}


def _llm(path, tp: int, **options) -> LLM:
    return LLM(model=str(path), dtype="float32", block_size=4, num_kv_blocks=48, max_num_batched_tokens=32,
               tensor_parallel_size=tp, **options)


def _close(llm: LLM) -> None:
    llm.engine.core.runner.close()


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2", "tiny_qwen3"])
def test_two_ranks_match_one(fixture, request):
    # llama: GQA, 2 KV heads split; qwen2: qkv bias, 1 KV head replicated; qwen3: q/k norm, tied head
    path = request.getfixturevalue(fixture)
    expected, single = _workload(_llm(path, 1))
    llm = _llm(path, 2)
    try:
        runner = llm.engine.core.runner
        assert runner.model.config.num_heads == llm.engine.core.model_config.num_heads // 2  # really sharded
        tokens, stats = _workload(llm)
    finally:
        _close(llm)
    assert stats["preemptions"] > 0 and stats["prefix_hits"] > 0, stats
    assert stats == single
    assert tokens == expected


def test_two_ranks_match_one_with_ngram_speculation(tiny_llama):
    # Repeating prompts give the n-gram proposer matches; verification runs the same sharded forward.
    prompts = [(p * 4)[:40] for p in _prompts(4, 6, 10, seed=3)]
    options = dict(speculative_method="ngram", num_speculative_tokens=3)
    expected = [o.token_ids for o in _llm(tiny_llama, 1, **options).generate(prompts, GREEDY)]
    llm = _llm(tiny_llama, 2, **options)
    try:
        tokens = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        stats = llm.engine.core.stats()
    finally:
        _close(llm)
    assert stats.spec_proposed_tokens > 0 and stats.spec_verify_steps > 0
    assert tokens == expected


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_two_ranks_match_one_quantized(tiny_llama, quantization):
    # Row-parallel layers split their inputs on group boundaries (32 of 64), so each rank quantizes
    # exactly the groups a single process would.
    prompts = _prompts(4, 10, 40, seed=4)
    expected = [o.token_ids for o in _llm(tiny_llama, 1, quantization=quantization).generate(prompts, GREEDY)]
    llm = _llm(tiny_llama, 2, quantization=quantization)
    try:
        tokens = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    finally:
        _close(llm)
    assert tokens == expected


def test_three_ranks_match_one_on_gguf_blocks(default_llm):
    # The bundled Q4_1 GGUF (9 heads, 3 KV heads): each rank keeps the file's own 4-bit blocks, its
    # o_proj / down_proj inputs cut on 32-value block boundaries (192 of 576, 512 of 1536).
    prompts = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = [o.token_ids for o in default_llm.generate(prompts, params)]
    llm = LLM(dtype="float32", kv_cache_memory_bytes=64 * 1024**2, max_model_len=256, tensor_parallel_size=3)
    try:
        assert llm.engine.core.runner.model.model.layers[0].self_attn.o_proj.method.name.startswith("int4")
        tokens = [o.token_ids for o in llm.generate(prompts, params)]
    finally:
        _close(llm)
    assert tokens == expected


def test_dead_rank_is_a_fatal_error_not_a_hang(tiny_llama):
    llm = _llm(tiny_llama, 2)
    try:
        proc, _ = llm.engine.core.runner._workers[0]
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        with pytest.raises(EngineFatalError, match="rank 1"):
            llm.generate(_prompts(2, 5, 10, seed=5), GREEDY)
    finally:
        _close(llm)


def test_rank_zero_failing_mid_step_is_fatal(tiny_llama, monkeypatch):
    # The other rank is already inside the step's collectives: retrying request by request would pair
    # rank 0's all-reduces with the wrong ones.
    llm = _llm(tiny_llama, 2)
    try:
        backend = llm.engine.core.runner.backend

        def broken(*args, **kwargs):
            raise RuntimeError("simulated kernel failure")

        monkeypatch.setattr(backend, "forward", broken)
        with pytest.raises(EngineFatalError, match="out of step"):
            llm.generate(_prompts(1, 5, 10, seed=7), GREEDY)
    finally:
        _close(llm)


def test_hung_rank_times_out(tiny_llama, monkeypatch):
    import kvserve.worker.tensor_parallel as tp

    monkeypatch.setattr(tp, "COLLECTIVE_TIMEOUT_S", 2.0)  # rank 0's wait in an all-reduce
    llm = _llm(tiny_llama, 2)
    proc, _ = llm.engine.core.runner._workers[0]
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        with pytest.raises(EngineFatalError, match="all-reduce failed"):
            llm.generate(_prompts(1, 5, 10, seed=6), GREEDY)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        _close(llm)


def test_dead_rank_turns_server_health_red(tiny_llama):
    import multiprocessing
    import time

    from starlette.testclient import TestClient

    from kvserve.entrypoints.llm import engine_config
    from kvserve.entrypoints.openai.app import ServerOptions, build_app

    config = engine_config(model=str(tiny_llama), dtype="float32", num_kv_blocks=64, tensor_parallel_size=2)
    app = build_app(config, ServerOptions(("tiny",)))
    with TestClient(app) as http:
        client = app.state.kvserve.client
        deadline = time.monotonic() + 120
        while not client.is_ready:
            assert time.monotonic() < deadline, "the engine did not load"
            time.sleep(0.05)
        assert http.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 4}).status_code == 200
        worker = next(p for p in multiprocessing.active_children() if p.name == "kvserve-tp-rank1")
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        response = http.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 4})
        assert response.status_code == 503 and "rank 1" in response.json()["error"]["message"]
        assert http.get("/health").status_code == 503


def _config(heads: int, kv_heads: int, inter: int = 128) -> ModelConfig:
    return ModelConfig("LlamaForCausalLM", 512, 64, inter, 2, heads, kv_heads, 16, 1024, 1e-6, RopeConfig())


def test_indivisible_heads_name_both_numbers(tmp_path):
    path = make_tiny_model(tmp_path, "LlamaForCausalLM")  # 4 heads
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 .* 4 attention heads"):
        LLM(model=str(path), dtype="float32", num_kv_blocks=16, tensor_parallel_size=3)
    # the bundled model's shape: 9 heads, 3 KV heads
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 .* 9 attention heads"):
        TensorShard(0, 2).check(_config(9, 3))
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 and the model's 2 KV heads"):
        TensorShard(0, 3).check(_config(6, 2))
    with pytest.raises(ValueError, match=r"intermediate size 101"):
        TensorShard(0, 2).check(_config(4, 2, inter=101))
    TensorShard(0, 3).check(_config(9, 3, inter=1536))  # the bundled model splits over 3


def test_kv_heads_split_or_replicated():
    assert [TensorShard(r, 2).kv_heads(_config(4, 2)) for r in range(2)] == [(0, 1), (1, 1)]
    assert [TensorShard(r, 4).kv_heads(_config(8, 2)) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert TensorShard(1, 2).local_config(_config(4, 1)).num_kv_heads == 1
    with pytest.raises(ValueError, match="must be >= 1"):
        LLM(tensor_parallel_size=0)
