"""The fused C++ decode step (models/llama_decode.py) against the eager model: the same hidden states
and the same KV-cache writes, bit for bit, for every model variant, dtype, weight and KV format."""

from __future__ import annotations

import random

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.model.cpu_kernels import load_kernels
from kvserve.scheduler.output import ScheduledRequest
from tests.conftest import TINY_VOCAB

pytestmark = pytest.mark.skipif(load_kernels() is None, reason="C++ kernels unavailable")
SP = SamplingParams(max_tokens=1, temperature=0)


def _requests(lengths: list[int], block_size: int, decode: bool, seed: int = 0) -> list[ScheduledRequest]:
    """Requests with disjoint block tables: their prompts (prefill) or one more token each (decode)."""
    rng = random.Random(seed)
    out, next_block = [], 1
    for i, n in enumerate(lengths):
        blocks = n // block_size + 1
        table = list(range(next_block, next_block + blocks))
        next_block += blocks
        prompt = [rng.randrange(3, TINY_VOCAB) for _ in range(n)]
        token = rng.randrange(3, TINY_VOCAB)
        out.append(ScheduledRequest(f"r{i}", [token] if decode else prompt, n if decode else 0, table, True, SP))
    return out


def _compare(llm: LLM, lengths: list[int]) -> None:
    runner = llm.engine.core.runner
    assert runner.fused_decoder is not None
    with torch.inference_mode():
        ids, pos, meta = runner._prepare(_requests(lengths, runner.block_size, decode=False))
        runner.model(ids, pos, runner.kv_caches, meta, runner.backend)  # prefill the histories
        ids, pos, meta = runner._prepare(_requests(lengths, runner.block_size, decode=True))
        before = [c.clone() for c in runner.kv_caches]
        eager = runner.model(ids, pos, runner.kv_caches, meta, runner.backend)
        eager_caches = [c.clone() for c in runner.kv_caches]
        for cache, old in zip(runner.kv_caches, before):
            cache.copy_(old)
        fused = runner.fused_decoder(ids, pos, meta)
    assert fused.dtype == eager.dtype and torch.equal(fused, eager)
    for got, want, old in zip(runner.kv_caches, eager_caches, before):
        assert torch.equal(got, want) and not torch.equal(got, old)  # the new tokens were written


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2", "tiny_qwen3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_decode_is_bitwise_the_eager_step(fixture, dtype, request):
    # GQA, qkv bias + one KV head, q/k norm + tied head; float32 (torch matmuls) and bf16 (our GEMV / AMX)
    llm = LLM(model=str(request.getfixturevalue(fixture)), dtype=dtype, num_kv_blocks=128, block_size=8)
    _compare(llm, [5, 17, 30])
    _compare(llm, [40] * 9)  # rows beyond the few-row kernels


@pytest.mark.parametrize("quantization,kv_dtype", [("int8", "auto"), ("int4", "int8"), (None, "fp8")])
def test_fused_decode_with_quantized_weights_and_cache(tiny_llama, quantization, kv_dtype):
    llm = LLM(model=str(tiny_llama), dtype="bfloat16", num_kv_blocks=128, block_size=8, quantization=quantization,
              kv_cache_dtype=kv_dtype)
    _compare(llm, [3, 26])


def test_fused_decode_serves_the_default_model(default_llm):
    # The bundled GGUF keeps its Q4_1 / Q8_0 blocks: int4 and int8 kernels in one step.
    _compare(default_llm, [12, 50])


def test_fused_decode_can_be_turned_off(tiny_llama, monkeypatch):
    monkeypatch.setenv("KVSERVE_FUSED_DECODE", "0")
    llm = LLM(model=str(tiny_llama), num_kv_blocks=64, block_size=8)
    assert llm.engine.core.runner.fused_decoder is None
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    monkeypatch.delenv("KVSERVE_FUSED_DECODE")
    fused = LLM(model=str(tiny_llama), num_kv_blocks=64, block_size=8)
    assert fused.engine.core.runner.fused_decoder is not None
    prompts = [[5, 6, 7], [9] * 20]
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in fused.generate(prompts, params)]


def test_fused_decode_rejects_a_slot_outside_the_cache(tiny_llama):
    llm = LLM(model=str(tiny_llama), num_kv_blocks=16, block_size=8)
    runner = llm.engine.core.runner
    ids, pos, meta = runner._prepare(_requests([4], runner.block_size, decode=True))
    meta.slot_mapping[0] = 16 * 8
    with pytest.raises(RuntimeError, match="outside the KV cache"), torch.inference_mode():
        runner.fused_decoder(ids, pos, meta)
