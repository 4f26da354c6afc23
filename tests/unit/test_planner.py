"""Capacity planner: the worked example pinned, the KV rules (GQA, MQA, MLA, sliding window, cache
dtype), the engine/planner agreement on the default model, the roofline, and the CLI end to end."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import pytest

from kvserve.kv_cache.sizing import kv_bytes_per_token, num_kv_blocks_for_budget
from kvserve.planner import cli
from kvserve.planner.capacity import (
    Setup,
    kv_budget_bytes,
    kv_bytes_per_token_of,
    kv_bytes_per_user,
    kv_capacity_tokens_of,
    max_context,
    max_users,
)
from kvserve.planner.hardware import Hardware, lookup_gpu, measure_local
from kvserve.planner.models import MODEL_TABLE, resolve_model
from kvserve.planner.plan import plan
from kvserve.planner.roofline import decode_step, expected_experts_touched, prefill
from kvserve.planner.shape import ModelShape, inventory
from kvserve.planner.weights import weight_bytes

H100 = lookup_gpu("H100-SXM")
SMOL_GGUF_TENSOR_BYTES = 96_576_768  # sum of tensor sizes in SmolLM2-135M-Instruct.Q4_1.gguf (Q4_1 + Q8_0 + F32)


def shape(name: str, **overrides) -> ModelShape:
    return ModelShape.from_hf({**MODEL_TABLE[name], **overrides}, name)


def setup(name: str, hardware: Hardware = H100, cfg: dict | None = None, **kw) -> Setup:
    return Setup(shape(name, **(cfg or {})), hardware, **kw)


# ---- the worked example: Mistral-7B in fp16 ----------------------------------------------------

def test_mistral_fp16_worked_example():
    s = setup("Mistral-7B-v0.1", dtype="float16")
    assert kv_bytes_per_token_of(s) == 131_072 == 2 * 32 * 8 * 128 * 2
    assert kv_bytes_per_user(s, 4096) / 1e9 == pytest.approx(0.54, abs=0.005)
    full = replace(s, cap_sliding_window=False)  # the worked example sizes every layer for the whole context
    assert kv_bytes_per_user(full, 16384) / 1e9 == pytest.approx(2.1, abs=0.05)
    assert 80 * kv_bytes_per_user(s, 4096) / 1e9 == pytest.approx(43, abs=0.1)
    assert s.inventory.total_params == 7_241_732_096
    assert s.weights.total / 1e9 == pytest.approx(14.5, abs=0.05)


def test_mistral_plan_80_users_at_4k_on_h100():
    p = plan(setup("Mistral-7B-v0.1", dtype="float16"), context=4096, users=80)
    assert p.kv_bytes_for_users == 80 * 131_072 * 4096
    budget = 80e9 - 8e9 - p.weight_bytes  # 10% runtime overhead
    assert p.kv_budget_bytes == pytest.approx(budget, abs=1)
    assert p.fits and p.max_users_at_context == int(budget // (131_072 * 4096)) == 107
    assert p.decode.bound == "memory" and p.prefill.bound == "compute"


# ---- KV rules ---------------------------------------------------------------------------------

def test_gqa_with_8_of_32_heads_needs_a_quarter_of_mha():
    gqa = setup("Llama-3.1-8B")
    mha = setup("Llama-3.1-8B", cfg={"num_key_value_heads": 32})
    mqa = setup("Llama-3.1-8B", cfg={"num_key_value_heads": 1})
    assert (mha.model.attention_kind, gqa.model.attention_kind, mqa.model.attention_kind) == ("MHA", "GQA", "MQA")
    assert kv_bytes_per_token_of(mha) == 4 * kv_bytes_per_token_of(gqa) == 32 * kv_bytes_per_token_of(mqa)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_8bit_kv_cache_halves_it(kv_dtype):
    s = setup("Mistral-7B-v0.1", dtype="float16")
    q = replace(s, kv_cache_dtype=kv_dtype)
    assert kv_bytes_per_token_of(q) * 2 == kv_bytes_per_token_of(s)
    assert kv_bytes_per_user(q, 4096) * 2 == kv_bytes_per_user(s, 4096)
    assert max_users(q, 4096) in (2 * max_users(s, 4096), 2 * max_users(s, 4096) + 1)


def test_mla_caches_one_latent_far_smaller_than_mha_and_gqa():
    ds = setup("DeepSeek-V3")
    assert ds.model.attention_kind == "MLA"
    assert kv_bytes_per_token_of(ds) == 61 * (512 + 64) * 2 == 70_272
    mha_twin = setup("DeepSeek-V3", cfg={"kv_lora_rank": None, "head_dim": 128})
    assert kv_bytes_per_token_of(mha_twin) == 2 * 61 * 128 * 128 * 2
    assert kv_bytes_per_token_of(ds) * 50 < kv_bytes_per_token_of(mha_twin)
    assert kv_bytes_per_token_of(ds) < kv_bytes_per_token_of(setup("Llama-3.1-70B")) == 327_680


def test_sliding_window_layers_are_capped_at_the_window():
    s = setup("Mistral-7B-v0.1", dtype="float16")
    # the window plus the block a window start inside a block spills into (kv_cache.sizing.max_window_blocks)
    assert kv_bytes_per_user(s, 16384) == kv_bytes_per_user(s, 4096 + 16)
    assert kv_bytes_per_user(replace(s, cap_sliding_window=False), 16384) == 4 * kv_bytes_per_user(s, 4096)
    mixed = Setup(ModelShape.from_hf({**MODEL_TABLE["SmolLM2-135M"], "num_hidden_layers": 4, "sliding_window": 1024,
                                      "layer_types": ["sliding_attention", "full_attention"] * 2}), H100)
    per_layer = kv_bytes_per_token(1, 3, 64, 2)
    assert mixed.model.num_sliding_layers == 2
    assert kv_bytes_per_user(mixed, 8192) == 2 * per_layer * 8192 + 2 * per_layer * (1024 + 16)


def test_qwen2_sliding_rules_follow_use_sliding_window_and_max_window_layers():
    assert shape("Qwen2.5-7B").num_sliding_layers == 0  # use_sliding_window: false
    on = shape("Qwen2.5-7B", use_sliding_window=True, sliding_window=4096, max_window_layers=20)
    assert (on.sliding_window, on.num_sliding_layers) == (4096, 8)


# ---- capacity: users against context ----------------------------------------------------------

def test_users_and_context_trade_off_inversely():
    s = setup("Llama-3.1-8B")
    tokens = kv_capacity_tokens_of(s)
    blocks = tokens // s.block_size
    for context in (1024, 2048, 4096, 8192, 16384):
        assert max_users(s, context) == tokens // context
    assert max_users(s, 2048) // 2 == max_users(s, 4096)
    for users in (1, 10, 100):
        assert max_context(s, users) == min(blocks // users * s.block_size, s.model.max_position)
    c = max_context(s, 100)
    assert 100 * kv_bytes_per_user(s, c) <= kv_budget_bytes(s) < 100 * kv_bytes_per_user(s, c + s.block_size)


def test_weights_that_do_not_fit_leave_no_users():
    s = setup("Llama-3.1-70B", hardware=lookup_gpu("A100-80GB"))
    assert kv_budget_bytes(s) < 0 and max_users(s, 4096) == 0
    assert not plan(s, 4096, 1).fits
    assert plan(replace(s, num_gpus=4), 4096, 32).fits


# ---- parameter counts and weight bytes --------------------------------------------------------

def test_parameter_counts_match_published_models():
    assert inventory(shape("SmolLM2-135M")).total_params == 134_515_008
    assert inventory(shape("Llama-3.1-8B")).total_params == 8_030_261_248
    assert inventory(shape("Llama-3.1-70B")).total_params == 70_553_706_496
    ds = inventory(shape("DeepSeek-V3"))
    assert ds.total_params / 1e9 == pytest.approx(671, rel=0.005)
    assert ds.active_params / 1e9 == pytest.approx(37, rel=0.03)


def test_moe_parameter_counts_match_published_models():
    mixtral = inventory(shape("Mixtral-8x7B-v0.1"))
    assert mixtral.total_params / 1e9 == pytest.approx(46.7, rel=0.005)
    assert mixtral.active_params / 1e9 == pytest.approx(12.9, rel=0.01)
    qwen = inventory(shape("Qwen3-30B-A3B"))
    assert qwen.total_params / 1e9 == pytest.approx(30.5, rel=0.005)
    assert qwen.active_params / 1e9 == pytest.approx(3.3, rel=0.03)


def test_qwen_moe_dense_layers_follow_the_engines_rule():
    # decoder_sparse_step 2: layers 1, 3, ... route; mlp_only_layers takes two more out
    s = shape("Qwen3-30B-A3B", decoder_sparse_step=2, mlp_only_layers=[1, 3])
    assert s.moe.num_moe_layers == 22
    dense = next(m for m in inventory(s).matrices if m.name == "mlp.gate_proj")
    assert (dense.count, dense.rows) == (26, 6144)
    q15 = shape("Qwen3-30B-A3B", architectures=["Qwen2MoeForCausalLM"], shared_expert_intermediate_size=5632)
    names = {m.name: m for m in inventory(q15).matrices}
    assert names["shared_expert.up_proj"].rows == 5632 and names["shared_expert_gate"].count == 48


@pytest.mark.parametrize("name", ["Mixtral-8x7B-v0.1", "Qwen3-30B-A3B"])
def test_moe_kv_sizing_equals_the_engine(name):
    # every layer of these families attends with standard GQA: experts do not change the KV
    from kvserve.config import CacheConfig, EngineConfig, ModelConfig
    from kvserve.kv_cache.sizing import size_kv_cache

    cfg = MODEL_TABLE[name]
    budget = 3 * 1024**3
    info = size_kv_cache(EngineConfig(dtype="bfloat16", cache=CacheConfig(kv_cache_memory_bytes=budget)),
                         ModelConfig.from_hf(cfg))
    p = plan(Setup(ModelShape.from_hf(cfg), H100, dtype="bfloat16", kv_cache_memory_bytes=budget), 4096, 1)
    heads, dim = cfg["num_key_value_heads"], cfg.get("head_dim", 128)
    assert p.kv_bytes_per_token == info.bytes_per_token == 2 * cfg["num_hidden_layers"] * heads * dim * 2
    assert p.kv_capacity_tokens == info.capacity_tokens


def test_quantized_weight_bytes():
    inv = inventory(shape("SmolLM2-135M"))
    assert weight_bytes(inv, "float32", "q4_1").total == SMOL_GGUF_TENSOR_BYTES
    bf16 = weight_bytes(inventory(shape("Llama-3.1-8B")), "bfloat16").total
    int8 = weight_bytes(inventory(shape("Llama-3.1-8B")), "bfloat16", "int8").total
    int4 = weight_bytes(inventory(shape("Llama-3.1-8B")), "bfloat16", "int4").total
    assert 0.5 < int8 / bf16 < 0.6 and 0.3 < int4 / bf16 < 0.4  # embeddings and head stay bf16


# ---- the engine and the planner agree on the default model --------------------------------------

@pytest.mark.parametrize(("dtype", "budget"), [("float32", 2 * 1024**3), ("bfloat16", 123_456_789)])
def test_default_model_kv_sizing_equals_the_engine(dtype, budget):
    from kvserve.config import CacheConfig, EngineConfig, ModelConfig
    from kvserve.kv_cache.sizing import size_kv_cache
    from kvserve.model.default_model import default_model_path
    from kvserve.model.loader import load_hf_config

    hf = load_hf_config(default_model_path())
    info = size_kv_cache(EngineConfig(dtype=dtype, cache=CacheConfig(kv_cache_memory_bytes=budget)),
                         ModelConfig.from_hf(hf))
    _, cfg = resolve_model("default")
    assert ModelShape.from_hf(hf, "SmolLM2-135M") == ModelShape.from_hf(cfg, "SmolLM2-135M")
    p = plan(Setup(ModelShape.from_hf(cfg), H100, dtype=dtype, kv_cache_memory_bytes=budget), 4096, 1)
    assert p.kv_bytes_per_token == info.bytes_per_token == 2 * 30 * 3 * 64 * (4 if dtype == "float32" else 2)
    assert p.kv_capacity_tokens == info.capacity_tokens
    assert p.kv_capacity_tokens == num_kv_blocks_for_budget(budget, 16, p.kv_bytes_per_token) * 16


# ---- roofline ---------------------------------------------------------------------------------

def test_single_stream_decode_is_bandwidth_over_bytes_per_token():
    s = setup("SmolLM2-135M", dtype="float32")  # tied embeddings: every weight is read each step
    p = plan(s, 1024, 1)
    assert p.single_stream_bytes_per_token == s.weights.total + kv_bytes_per_user(s, 1024)
    assert p.single_stream_tokens_per_s == pytest.approx(H100.bandwidth / p.single_stream_bytes_per_token)
    assert p.decode.bound == "memory" and p.decode.seconds == pytest.approx(1 / p.single_stream_tokens_per_s)


def test_batching_moves_decode_from_memory_to_compute_bound():
    s = setup("Llama-3.1-8B")
    small, big = decode_step(s, 1, 128), decode_step(s, 2048, 128)
    assert small.bound == "memory" and big.bound == "compute"
    assert big.seconds / small.seconds < 2048 / 10  # throughput rises with batch
    assert prefill(s, 8192).bound == "compute"
    assert prefill(s, 8192).flops == pytest.approx(2 * 8192 * 8.03e9, rel=0.1)


def test_moe_decode_reads_only_routed_experts():
    assert expected_experts_touched(256, 8, 1) == pytest.approx(8)
    assert expected_experts_touched(256, 8, 4096) == pytest.approx(256, rel=1e-3)
    s = setup("DeepSeek-V3", num_gpus=8, quantization="fp8")
    assert decode_step(s, 1, 1024).bytes < 0.1 * s.weights.total


def test_cost_per_million_tokens_uses_price_per_device():
    s = setup("Llama-3.1-8B", price_per_hour=2.0, num_gpus=2)
    p = plan(s, 2048, 64)
    assert p.price_per_hour == 4.0
    assert p.cost_per_million_output_tokens == pytest.approx(4.0 / 3600 / p.decode_tokens_per_s * 1e6)


# ---- hardware and validation ------------------------------------------------------------------

def test_unknown_gpu_lists_the_known_ones():
    with pytest.raises(ValueError, match="H100-SXM.*local"):
        lookup_gpu("Z9000")
    assert lookup_gpu("h100") is H100


@pytest.mark.parametrize(("kw", "field"), [({"num_gpus": 0}, "num_gpus"), ({"dtype": "int3"}, "dtype"),
                                           ({"quantization": "q1"}, "quantization"),
                                           ({"kv_cache_dtype": "int2"}, "kv_cache_dtype"),
                                           ({"overhead_fraction": 1.5}, "overhead_fraction")])
def test_bad_setup_values_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        setup("Llama-3.1-8B", **kw)


def test_measure_local_gives_positive_rates():
    hw = measure_local("float32", copy_bytes=32 * 2**20, seconds=0.05)
    assert hw.name.startswith("local") and hw.bandwidth > 1e8 and hw.bf16_flops > 1e8 and hw.memory_bytes > 1e8


# ---- CLI --------------------------------------------------------------------------------------

def run(argv: list[str], capsys) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="kvserve")
    cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    assert args.func is cli.run_plan
    rc = args.func(args)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_text_shows_the_worked_example(capsys):
    rc, out, _ = run(["plan", "Mistral-7B-v0.1", "--dtype", "fp16", "--context", "4K", "--users", "80"], capsys)
    assert rc == 0
    for text in ("131,072 B", "0.537 GB at 4,096 tokens", "14.48 GB", "42.95 GB of KV: fits", "memory bound"):
        assert text in out


def test_cli_json_parses(capsys):
    rc, out, _ = run(["plan", "mistral-7b", "--dtype", "float16", "--users", "80", "--json",
                      "--kv-cache-dtype", "auto,fp8"], capsys)
    plans = json.loads(out)["plans"]
    assert rc == 0 and [p["kv_bytes_per_token"] for p in plans] == [131_072, 65_536]
    assert plans[0]["kv_bytes_for_users"] == 80 * 131_072 * 4096 and plans[0]["decode"]["bound"] == "memory"


def test_cli_plot_is_written(tmp_path, capsys):
    out_png = tmp_path / "users_vs_context.png"
    rc, out, _ = run(["plan", "Llama-3.1-8B", "--gpu", "H100,L40S", "--users", "32", "--plot", str(out_png)], capsys)
    assert rc == 0 and "plot written" in out
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out_png.stat().st_size > 10_000


def test_cli_local_predicts_single_stream_decode(monkeypatch, capsys):
    fake = Hardware("local (cpu, test)", 16 * 10**9, 20e9, 1e11, 1e11)
    monkeypatch.setattr(cli, "measure_local", lambda dtype: fake)
    rc, out, _ = run(["plan", "--gpu", "local", "--dtype", "float32", "--context", "1024", "--json"], capsys)
    p = json.loads(out)["plans"][0]
    assert rc == 0 and p["model"] == "SmolLM2-135M" and p["gpu"] == fake.name
    assert p["single_stream_tokens_per_s"] == pytest.approx(20e9 / (538_060_032 + 46_080 * 1024))
    _, text, _ = run(["plan", "--gpu", "local", "--dtype", "float32"], capsys)
    assert "PREDICTED single-stream decode on this machine" in text


def test_cli_custom_gpu_and_model_folder(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(MODEL_TABLE["Qwen2.5-7B"]))
    rc, out, _ = run(["plan", str(tmp_path), "--gpu-memory", "32", "--bandwidth", "1000", "--flops", "200",
                      "--json"], capsys)
    p = json.loads(out)["plans"][0]
    assert rc == 0 and p["gpu"] == "custom" and p["memory_bytes"] == 32 * 10**9 and p["bandwidth"] == 1e12
    assert p["kv_bytes_per_token"] == 2 * 28 * 4 * 128 * 2


def test_cli_bad_option_returns_2_with_the_field(capsys):
    rc, _, err = run(["plan", "Llama-3.1-8B", "--gpu", "nope"], capsys)
    assert rc == 2 and "gpu='nope'" in err and "H100-SXM" in err
    rc, _, err = run(["plan", "NoSuchModel"], capsys)
    assert rc == 2 and "Mistral-7B-v0.1" in err


def test_token_and_byte_parsing():
    assert cli.parse_tokens("16K") == 16384 and cli.parse_tokens("4096") == 4096
    assert cli.parse_bytes("2GiB") == 2**31 and cli.parse_bytes("80", "gb") == 80 * 10**9
    with pytest.raises(argparse.ArgumentTypeError):
        cli.parse_tokens("lots")
