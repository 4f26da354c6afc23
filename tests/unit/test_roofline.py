"""`kvserve bench roofline` arithmetic for the default model (SmolLM2-135M, bf16), checked by hand.

SmolLM2-135M: vocab 49152, hidden 576, MLP 1536, 30 layers, 9 query heads, 3 KV heads of 64, tied.
  per layer  q 576x576 + k 576x192 + v 576x192 + o 576x576 + gate, up, down 3 x 576x1536 = 3,538,944
  layers     30 x 3,538,944                                                            = 106,168,320
  embedding  49152 x 576 (also the output head)                                        =  28,311,552
  norms      30 x 2 x 576 + 576                                                        =      35,136
  all        134,515,008 parameters x 2 bytes                                          = 269,030,016 B
  KV         2 (K,V) x 30 layers x 3 heads x 64 dims x 2 bytes                         =      23,040 B/token
  FLOPs      2 x (106,168,320 + 28,311,552) per token                                  = 268,959,744
             + attention 2 x 9 heads x (64 + 64) x 30 layers                           =      69,120 per context token
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvserve.bench.roofline import (
    Batched,
    SingleStream,
    bytes_per_decode_step,
    decode_bound_tokens_per_s,
    flops_per_token,
    median_round,
    memory_bound_tokens_per_s,
    request_flops,
    run_roofline_seconds,
)
from kvserve.planner.capacity import Setup
from kvserve.planner.hardware import Hardware
from kvserve.planner.models import MODEL_TABLE
from kvserve.planner.shape import ModelShape

WEIGHT_BYTES = 269_030_016
KV_PER_TOKEN = 23_040
FLOPS_PER_TOKEN_NO_ATTN = 268_959_744
ATTN_FLOPS_PER_CONTEXT = 69_120
MACHINE = Hardware("test", memory_bytes=24 * 10**9, bandwidth=10e9, fp32_flops=1e12, bf16_flops=2e12)


@pytest.fixture(scope="module")
def setup() -> Setup:
    return Setup(ModelShape.from_hf(MODEL_TABLE["SmolLM2-135M"], "SmolLM2-135M"), MACHINE, dtype="bfloat16")


def test_single_stream_bytes_are_weights_plus_own_kv(setup):
    assert bytes_per_decode_step(setup, 1, 192) == WEIGHT_BYTES + 192 * KV_PER_TOKEN == 273_453_696


def test_kv_is_counted_in_whole_blocks(setup):
    # 200 tokens hold 13 blocks of 16 = 208 token slots
    assert bytes_per_decode_step(setup, 1, 200) == WEIGHT_BYTES + 208 * KV_PER_TOKEN


def test_a_batch_reads_the_weights_once(setup):
    assert bytes_per_decode_step(setup, 32, 192) == WEIGHT_BYTES + 32 * 192 * KV_PER_TOKEN == 410_587_776


def test_an_8bit_kv_cache_halves_the_kv_read(setup):
    # `--kv-cache-dtype int8`: one byte per value in the bound (the engine's float16 scale per 64
    # values, +3%, is left out, as the planner prices any 8-bit cache)
    int8 = replace(setup, kv_cache_dtype="int8")
    assert bytes_per_decode_step(int8, 32, 192) == WEIGHT_BYTES + 32 * 192 * KV_PER_TOKEN // 2
    assert run_roofline_seconds(int8, 256, 128, 8) < run_roofline_seconds(setup, 256, 128, 8)


def test_flops_per_token(setup):
    assert flops_per_token(setup, 192) == FLOPS_PER_TOKEN_NO_ATTN + 192 * ATTN_FLOPS_PER_CONTEXT == 282_230_784


def test_request_flops_is_prefill_then_decodes(setup):
    # prefill of 128: 128 tokens through the layers, the head once, causal attention over 128*129/2 pairs
    prefill = 2 * (128 * 106_168_320 + 28_311_552) + ATTN_FLOPS_PER_CONTEXT * 128 * 129 // 2
    assert prefill == 27_806_367_744
    decodes = 2 * FLOPS_PER_TOKEN_NO_ATTN + ATTN_FLOPS_PER_CONTEXT * (129 + 130)
    assert request_flops(setup, 128, 3) == prefill + decodes


def test_bounds(setup):
    assert memory_bound_tokens_per_s(setup, 192) == pytest.approx(10e9 / 273_453_696)
    # 64 users still memory bound here (552 MB at 10 GB/s = 55 ms > 18 GFLOP at 2 TFLOP/s = 9 ms),
    # but the weights are read once for all 64 tokens
    assert decode_bound_tokens_per_s(setup, 64, 192) == pytest.approx(64 * 10e9 / (WEIGHT_BYTES + 64 * 192 * KV_PER_TOKEN))
    # and at a huge batch the matmul peak caps it near peak / FLOPs per token
    assert decode_bound_tokens_per_s(setup, 100_000, 192) <= 2e12 / flops_per_token(setup, 192)


def test_fractions():
    single = SingleStream(128, 256, 18.0, 2.7e8, 36.0)
    assert single.fraction == pytest.approx(0.5)
    assert single.effective_bandwidth == pytest.approx(18.0 * 2.7e8)
    assert Batched(32, 300.0, 0.5e12, 1000.0, 2e12, 0.5).flops_fraction == pytest.approx(0.25)



def test_a_round_is_priced_at_the_bandwidth_measured_around_it():
    single = SingleStream(128, 256, 18.0, 2.7e8, 36.0, bandwidth=9.72e9).at_bandwidth(5.4e9)
    assert single.bandwidth == 5.4e9 and single.bound_tokens_per_s == pytest.approx(20.0)
    assert single.fraction == pytest.approx(0.9)


def test_the_median_round_is_reported():
    rounds = [SingleStream(128, 256, rate, 2.7e8, 0.0).at_bandwidth(5.4e9) for rate in (15.0, 18.0, 10.0, 12.0)]
    assert median_round(rounds).decode_tokens_per_s == 12.0  # the lower middle of four
    assert median_round(rounds[:3]).decode_tokens_per_s == 15.0
    assert median_round(rounds[:1]).decode_tokens_per_s == 15.0


def test_run_roofline_is_batched_prefill_then_decode_steps(setup):
    # 64 prompts of 128 prefilled together: 64 x 27.8 GFLOP at 2 TFLOP/s = 0.890 s (compute bound:
    # the weights once plus 8192 tokens of KV is 458 MB, 45.8 ms at 10 GB/s)
    prefill = 64 * 27_806_367_744 / 2e12
    # two decode steps of 64 users at context 129 and 130, each memory bound (weights + their KV)
    decodes = sum((WEIGHT_BYTES + 64 * blocks * 16 * KV_PER_TOKEN) / 10e9 for blocks in (9, 9))
    assert run_roofline_seconds(setup, 64, 128, 3) == pytest.approx(prefill + decodes)


def test_the_ceiling_is_the_runs_flops_over_its_roofline_time():
    b = Batched(256, 1000.0, 0.6e12, 4000.0, 2e12, ceiling_fraction=0.4)
    assert b.flops_fraction == pytest.approx(0.3)
    assert b.of_ceiling == pytest.approx(0.75)  # 30% of the peak where at most 40% was possible
