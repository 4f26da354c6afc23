"""The bundled SmolLM2-135M (Q4_1 GGUF) against transformers' own GGUF loader, float32, greedy."""

from __future__ import annotations

import pytest
import torch

from kvserve import SamplingParams
from kvserve.model.default_model import default_model_path
from tests.conftest import assert_no_leak
from tests.models.reference import check_greedy_matches

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "Explain in one paragraph why the sky is blue, and mention Rayleigh scattering and the wavelength of light.",
    "1, 2, 3, 4,",
    "Translate to French: I would like a cup of coffee, please.",
]


@pytest.fixture(scope="module")
def hf_default():
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


@pytest.mark.slow
def test_default_model_matches_transformers(default_llm, hf_default):
    tok = default_llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
               if i % 2 else p for i, p in enumerate(PROMPTS)]
    outs = default_llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    compared = sum(check_greedy_matches(hf_default, o.prompt_token_ids, o.token_ids) for o in outs)
    assert compared >= 0.75 * 32 * len(prompts)
    assert_no_leak(default_llm)


def test_default_model_text_is_sensible(default_llm):
    out = default_llm.generate("The capital of France is", SamplingParams(max_tokens=8, temperature=0))[0]
    assert "Paris" in out.text
    assert out.ttft is not None and out.e2e_latency >= out.ttft > 0
    assert_no_leak(default_llm)
