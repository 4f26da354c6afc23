"""SmolLM3 (NoPE layers: every fourth layer rotates nothing) matches transformers token for token."""

from __future__ import annotations

import random

from kvserve import LLM, SamplingParams
from tests.conftest import TINY_VOCAB, assert_no_leak, make_tiny_model
from tests.models.reference import check_greedy_matches, load_hf


def test_smollm3_matches_transformers(tmp_path):
    path = make_tiny_model(tmp_path, "SmolLM3ForCausalLM", num_hidden_layers=4, no_rope_layer_interval=2,
                           pad_token_id=0)  # its default pad id lies beyond a tiny vocabulary
    llm = LLM(model=str(path), num_kv_blocks=256, block_size=4, max_num_batched_tokens=24)
    assert llm.engine.core.model_config.rope_layers == (True, False, True, False)
    assert llm.engine.core.runner.fused_decoder is None  # it rotates in every layer
    hf = load_hf(path)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, TINY_VOCAB) for _ in range(rng.randint(5, 50))] for _ in range(5)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    compared = 0
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        compared += check_greedy_matches(hf, prompt, out.token_ids)
    assert compared >= len(prompts) * 20 // 2
    assert_no_leak(llm)
