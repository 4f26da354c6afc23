"""The paged prefill attention kernel (AMX or AVX512-BF16) inside the engine, against the SDPA path it replaces."""

from __future__ import annotations

import random

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.model.cpu_kernels import load_kernels
from tests.conftest import make_tiny_model


def test_paged_prefill_scores_prompts_like_sdpa(tmp_path, monkeypatch):
    """bf16, head_dim 64: prompts scored (teacher-forced prompt logprobs) through the paged prefill kernel,
    in chunks of a 48-token budget (every chunk after the first attends to the cached part), as through
    SDPA: bf16 noise apart."""
    kernels = load_kernels()
    if kernels is None or not kernels.paged_prefill_supported(64):
        pytest.skip("no paged prefill kernel on this machine (needs AVX512-BF16)")
    path = make_tiny_model(tmp_path / "hd64", "LlamaForCausalLM", hidden_size=256, intermediate_size=256,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64, initializer_range=0.05)
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (150, 37, 90)]
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)

    def score(kernel: bool) -> list[list[float]]:
        llm = LLM(model=str(path), dtype="bfloat16", num_kv_blocks=128, block_size=16, max_num_batched_tokens=48)
        backend = llm.engine.core.runner.backend
        calls = []
        if kernel:
            monkeypatch.setattr(kernels, "paged_prefill_attention",
                                lambda *a, _f=kernels.paged_prefill_attention: calls.append(1) or _f(*a))
        else:
            backend._prefill_ok = {64: False}
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert bool(calls) == kernel
        return [[lp.logprob for lp in o.prompt_logprobs[1:]] for o in outs]

    for got, expected in zip(score(True), score(False)):
        diff = torch.tensor(got) - torch.tensor(expected)
        assert diff.abs().max() < 0.05 and diff.abs().mean() < 0.01, (diff.abs().max(), diff.abs().mean())  # seen: 0.016, 0.004
