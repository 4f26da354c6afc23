"""Sliding-window attention (Mistral, a window shorter than the prompts) matches transformers token
for token, and a request's KV stays bounded by the window as the sequence grows."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.kv_cache.sizing import max_window_blocks
from tests.conftest import assert_no_leak, make_tiny_model
from tests.models.reference import check_greedy_matches, generate_and_check, load_hf, motif_prompts, random_prompts

WINDOW = 18  # not a multiple of the block size: window starts fall inside blocks


@pytest.fixture(scope="module")
def tiny_mistral(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-mistral"), "MistralForCausalLM", sliding_window=WINDOW)


@pytest.fixture(scope="module")
def hf_mistral(tiny_mistral):
    return load_hf(tiny_mistral)




def test_window_is_read_from_the_config(tiny_mistral):
    llm = LLM(model=str(tiny_mistral), num_kv_blocks=64, block_size=4)
    cfg = llm.engine.core.model_config
    assert cfg.layer_windows == (WINDOW, WINDOW) and cfg.all_layers_windowed == WINDOW
    assert llm.engine.core.kv_cache.window == WINDOW


def test_full_attention_diverges_from_windowed_reference(tiny_mistral, hf_mistral):
    """The test can fail: the same weights without the window give other tokens past the window."""
    import json
    import shutil
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        full = Path(tmp)
        for f in tiny_mistral.iterdir():
            shutil.copy(f, full / f.name)
        cfg = json.loads((full / "config.json").read_text())
        cfg["sliding_window"] = None
        (full / "config.json").write_text(json.dumps(cfg))
        llm = LLM(model=str(full), num_kv_blocks=128, block_size=4)
        prompts = random_prompts(4, 50, 80, seed=11)
        outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
        with pytest.raises(AssertionError, match="kvserve chose"):
            for prompt, out in zip(prompts, outs):
                check_greedy_matches(hf_mistral, prompt, out.token_ids)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_prompts_longer_than_the_window(tiny_mistral, hf_mistral, backend):
    """Mixed lengths, most longer than the window; chunked prefill across the window's edge (a
    16-token budget), and decodes sharing steps with chunks."""
    if backend == "triton":
        pytest.importorskip("triton")
    llm = LLM(model=str(tiny_mistral), attention_backend=backend, num_kv_blocks=256, block_size=4,
              max_num_batched_tokens=16)
    generate_and_check(llm, hf_mistral, random_prompts(6, 5, 70, seed=1))


def test_unchunked_prefill_and_sdpa_path(tiny_mistral, hf_mistral, monkeypatch):
    """Whole prompts in one step, and the pure-PyTorch path (no C++ kernels) of the same backend."""
    llm = LLM(model=str(tiny_mistral), num_kv_blocks=256, block_size=8)
    generate_and_check(llm, hf_mistral, random_prompts(4, 20, 90, seed=2))
    backend = llm.engine.core.runner.backend
    monkeypatch.setattr(backend, "kernels", None)
    llm.engine.core.runner.fused_decoder = None
    generate_and_check(llm, hf_mistral, random_prompts(4, 20, 90, seed=3))


def test_prefix_cache_hit_past_the_window(tiny_mistral, hf_mistral):
    """A second prompt shares 48 tokens with the first: its blocks come from the prefix cache, and
    those before its first chunk's window are released again at once."""
    llm = LLM(model=str(tiny_mistral), num_kv_blocks=256, block_size=4)
    first = random_prompts(1, 60, 60, seed=4)[0]
    generate_and_check(llm, hf_mistral, [first])
    second = first[:48] + [7, 8, 9, 10, 11]
    generate_and_check(llm, hf_mistral, [second])
    stats = llm.engine.core.kv_cache.prefix_stats
    assert stats.hits >= 48


def test_preemption(tiny_mistral, hf_mistral):
    # windowed requests hold few blocks once decoding: 13 blocks run out while prompts are computed
    llm = LLM(model=str(tiny_mistral), num_kv_blocks=13, block_size=4, max_num_batched_tokens=32)
    generate_and_check(llm, hf_mistral, random_prompts(6, 40, 70, seed=5), max_tokens=30)
    assert llm.engine.core.scheduler.num_preemptions > 0


def test_ngram_speculation(tiny_mistral, hf_mistral):
    prompts = motif_prompts(4, seed=6)
    llm = LLM(model=str(tiny_mistral), num_kv_blocks=256, block_size=4, speculative_method="ngram",
              num_speculative_tokens=3)
    spec = generate_and_check(llm, hf_mistral, prompts, max_tokens=32)
    plain = LLM(model=str(tiny_mistral), num_kv_blocks=256, block_size=4)
    assert spec == [o.token_ids for o in plain.generate(
        prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True), use_tqdm=False)]
    assert llm.engine.core.spec.stats.proposed > 0


def test_parallel_samples_fork_within_the_window(tiny_mistral):
    """n > 1 forks followers from the first sample's blocks; a follower whose leader already
    released blocks it needs computes its prompt itself. Same tokens as separate requests."""
    llm = LLM(model=str(tiny_mistral), num_kv_blocks=256, block_size=4)
    prompt = random_prompts(1, 40, 40, seed=9)[0]
    params = SamplingParams(max_tokens=20, temperature=0.8, seed=3, n=3, ignore_eos=True)
    outs = llm.generate([prompt], params, use_tqdm=False)[0]
    assert len(outs.outputs) == 3 and all(len(o.token_ids) == 20 for o in outs.outputs)
    assert_no_leak(llm)


def test_kv_blocks_bounded_by_the_window(tiny_mistral, hf_mistral, monkeypatch):
    """Generating 4x the window: the request never holds more blocks than the planner's figure
    (max_window_blocks, the function both use), itself at most window / block_size + 2, and the
    sequence outgrows the whole pool (12 blocks of 4 tokens)."""
    block_size = 4
    llm = LLM(model=str(tiny_mistral), num_kv_blocks=12, block_size=block_size, max_num_batched_tokens=16)
    assert llm.engine.core.max_model_len > 12 * block_size
    engine, kv = llm.engine, llm.engine.core.kv_cache
    held = []  # blocks the request holds once each step's room is made (its peak in that step)
    allocate = kv.allocate_slots
    monkeypatch.setattr(kv, "allocate_slots", lambda rid, *a, **k: allocate(rid, *a, **k) and (
        held.append(kv.num_held_blocks(rid)) or True))
    prompt = random_prompts(1, 10, 10, seed=10)[0]
    max_tokens = 4 * WINDOW
    engine.add_request("r", prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    last = None
    while engine.has_unfinished():
        for out in engine.step():
            last = out
    bound = max_window_blocks(WINDOW, block_size)
    assert bound <= WINDOW // block_size + 2
    assert len(held) == max_tokens and max(held) == bound, held  # reached, never exceeded
    assert held[-1] < len(kv.block_table("r")) or not kv.block_table("r")
    assert check_greedy_matches(hf_mistral, prompt, last.outputs[0].token_ids) > max_tokens // 2
    assert_no_leak(llm)
    # the planner sizes a windowed model's user with the same figure
    from kvserve.model.loader import load_hf_config
    from kvserve.planner.capacity import Setup, kv_bytes_per_user
    from kvserve.planner.hardware import lookup_gpu
    from kvserve.planner.shape import ModelShape

    shape = ModelShape.from_hf(load_hf_config(llm.engine.core.model_path))
    setup = Setup(shape, lookup_gpu("h100"), dtype="float32", block_size=block_size)
    assert kv_bytes_per_user(setup, 10 * WINDOW) == bound * kv_bytes_per_user(setup, block_size)
