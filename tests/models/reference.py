"""Token-by-token comparison against transformers on the same weights.

The reference scores our whole output in one teacher-forced forward pass. At every position our
token must be transformers' argmax; where its top two logits are within ``tie`` either token is
accepted and the comparison stops there (the continuations legitimately diverge).
"""

from __future__ import annotations

import random

import torch

from tests.conftest import TINY_VOCAB, assert_no_leak

TIE = 1e-4


@torch.inference_mode()
def check_greedy_matches(hf_model, prompt_ids: list[int], output_ids: list[int], tie: float = TIE) -> int:
    """Assert ``output_ids`` is transformers' greedy continuation; returns how many tokens were compared."""
    ids = torch.tensor([prompt_ids + output_ids])
    logits = hf_model(ids).logits[0, len(prompt_ids) - 1:-1].float()
    for i, (row, ours) in enumerate(zip(logits, output_ids)):
        top2 = row.topk(2)
        best = int(top2.indices[0])
        if ours == best:
            continue
        gap = float(top2.values[0] - row[ours])
        assert gap < tie, (f"token {i}: kvserve chose {ours}, transformers {best} "
                           f"(logit gap {gap:.2e} > {tie}); prompt {prompt_ids[:8]}...")
        return i
    return len(output_ids)


def load_hf(path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()


def random_prompts(n: int, lo: int, hi: int, seed: int = 0, vocab: int = TINY_VOCAB) -> list[list[int]]:
    """``n`` seeded prompts of ``lo``-``hi`` token ids (ids 0-2 left out: the special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def motif_prompts(n: int, seed: int, vocab: int = TINY_VOCAB) -> list[list[int]]:
    """``n`` prompts that repeat a short random motif: n-gram speculation finds guesses in them."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        motif = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 6))]
        prompts.append(motif * rng.randint(6, 10) + [rng.randrange(3, vocab)])
    return prompts


def generate_and_check(llm, hf_model, prompts: list[list[int]], max_tokens: int = 24) -> list[list[int]]:
    """Greedy outputs (EOS ignored), each transformers' continuation; most tokens really compared
    (not cut short by a tie), and no KV block left held. Returns the token ids."""
    from kvserve import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    compared = 0
    for prompt, out in zip(prompts, outs):
        assert len(out.token_ids) == max_tokens and out.finish_reason == "length"
        compared += check_greedy_matches(hf_model, prompt, out.token_ids)
    assert compared >= len(prompts) * max_tokens // 2  # really compared, not skipped as ties
    assert_no_leak(llm)
    return [o.token_ids for o in outs]
