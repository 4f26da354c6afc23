"""The fused C++ decode step (models/llama_decode.py) against the eager model: the same hidden states
and the same KV-cache writes, bit for bit, for every model variant, dtype, weight and KV format."""

from __future__ import annotations

import random

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.model.cpu_kernels import load_kernels
from kvserve.scheduler.output import ScheduledRequest
from tests.conftest import TINY_VOCAB, make_tiny_model

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


MOE_FAMILIES = {  # softmax-routed experts: Mixtral (float32 renormalised weights), Qwen3-MoE (dense layers too)
    "mixtral": ("MixtralForCausalLM", dict(num_local_experts=8, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(num_hidden_layers=3, num_experts=8, num_experts_per_tok=3,
                                              moe_intermediate_size=32, decoder_sparse_step=2,
                                              norm_topk_prob=False)),
}


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
@pytest.mark.parametrize("dtype,quantization", [("float32", None), ("bfloat16", None), ("bfloat16", "int4")])
def test_fused_decode_runs_moe_layers_bitwise(family, dtype, quantization, tmp_path):
    # the router, its top k and the experts' C++ call inside the step (MoeSpec) against SparseMoeBlock
    arch, overrides = MOE_FAMILIES[family]
    path = make_tiny_model(tmp_path, arch, **overrides)
    llm = LLM(model=str(path), dtype=dtype, quantization=quantization, num_kv_blocks=128, block_size=8)
    _compare(llm, [5, 17, 30])
    _compare(llm, [40] * 9)


def test_fused_decode_leaves_moe_blocks_on_the_torch_path_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_MOE_CPU_KERNEL", "0")  # experts one torch call each: no C++ step for them
    arch, overrides = MOE_FAMILIES["mixtral"]
    llm = LLM(model=str(make_tiny_model(tmp_path, arch, **overrides)), num_kv_blocks=64, block_size=8)
    assert llm.engine.core.runner.fused_decoder is None


@pytest.mark.parametrize("quantization,kv_dtype", [("int8", "auto"), ("int4", "int8"), (None, "fp8")])
def test_fused_decode_with_quantized_weights_and_cache(tiny_llama, quantization, kv_dtype):
    llm = LLM(model=str(tiny_llama), dtype="bfloat16", num_kv_blocks=128, block_size=8, quantization=quantization,
              kv_cache_dtype=kv_dtype)
    _compare(llm, [3, 26])


def test_fused_decode_serves_the_default_model(default_llm):
    # The bundled GGUF keeps its Q4_1 / Q8_0 blocks: int4 and int8 kernels in one step.
    _compare(default_llm, [12, 50])


def test_fused_decode_with_int8_activations():
    # float32 x quantized to int8 for the integer kernels (AVX2's, or AVX512-VNNI's), as `kvserve serve`
    # runs on a CPU without native bf16; also past the few-row sizes.
    llm = LLM(dtype="float32", activation_quantization="int8", kv_cache_memory_bytes=128 * 1024**2)
    _compare(llm, [12, 50])
    _compare(llm, [30] * 9)


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


def _verify_requests(lengths: list[int], k: int, block_size: int) -> list[ScheduledRequest]:
    """One more token plus ``k`` proposals for each of the histories ``_requests`` prefilled."""
    rng = random.Random(1)
    out = []
    for r in _requests(lengths, block_size, decode=True):
        tokens = r.token_ids + [rng.randrange(3, TINY_VOCAB) for _ in range(k)]
        out.append(ScheduledRequest(r.request_id, tokens, r.start_pos, r.block_table, True, SP,
                                    spec_token_ids=tokens[1:]))
    return out


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3"])
def test_fused_verify_matches_the_eager_step(fixture, request):
    # A verify step as decode rows (llama_decode.py) against the eager causal step, float32.
    llm = LLM(model=str(request.getfixturevalue(fixture)), dtype="float32", num_kv_blocks=128, block_size=8)
    runner = llm.engine.core.runner
    lengths = [6, 17, 40]
    with torch.inference_mode():
        ids, pos, meta = runner._prepare(_requests(lengths, runner.block_size, decode=False))
        runner.model(ids, pos, runner.kv_caches, meta, runner.backend)
        ids, pos, meta = runner._prepare(_verify_requests(lengths, 4, runner.block_size))
        assert meta.prefill_seqs  # several query tokens per sequence: the eager model's prefill path
        before = [c.clone() for c in runner.kv_caches]
        eager = runner.model(ids, pos, runner.kv_caches, meta, runner.backend)
        eager_caches = [c.clone() for c in runner.kv_caches]
        for cache, old in zip(runner.kv_caches, before):
            cache.copy_(old)
        fused = runner.fused_decoder.verify(ids, pos, meta)
    assert fused.shape == eager.shape and fused.shape[0] == 5 * len(lengths)
    torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-5)
    for got, want in zip(runner.kv_caches, eager_caches):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _spied_verify(llm: LLM) -> list[int]:
    """Counts the steps the runner verifies through the fused decoder (one entry per call)."""
    decoder, calls = llm.engine.core.runner.fused_decoder, []
    inner = decoder.verify

    def verify(*args):
        calls.append(args[0].numel())
        return inner(*args)

    decoder.verify = verify
    return calls


def _check_spec_identical(opts: dict, prompts=None) -> None:
    """Greedy speculative output equals plain, one request at a time (``prompts``: grounded ones by
    default), with verification through the fused decoder."""
    from kvserve.bench.spec import prompts_for

    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    plain = LLM(**opts)
    spec = LLM(**opts, speculative_method="ngram", num_speculative_tokens=4)
    calls = _spied_verify(spec)
    for prompt in prompts or prompts_for("grounded", plain.get_tokenizer(), 3):
        assert spec.generate([prompt], params)[0].token_ids == plain.generate([prompt], params)[0].token_ids
    assert calls and spec.engine.core.spec.stats.accepted > 0  # verification ran through the fused decoder


def test_speculation_through_fused_verify_is_greedy_identical(tiny_llama):
    from tests.models.reference import motif_prompts

    _check_spec_identical({"model": str(tiny_llama), "dtype": "float32", "num_kv_blocks": 256, "block_size": 4},
                          motif_prompts(6, seed=2))


def test_speculation_on_the_default_model_is_greedy_identical():
    # The bundled GGUF as shipped (dtype auto: bf16 where the CPU has it), one request at a time as in
    # `kvserve bench spec --concurrency 1`: the verify rows take a decode step's kernels.
    _check_spec_identical({"kv_cache_memory_bytes": 128 * 1024**2})
