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


def check_with_prefix_hit(llm, hf_model) -> None:
    """Six prompts, the last one sharing the fifth's first 32 tokens: token-identical, and the shared
    blocks really came from the prefix cache."""
    prompts = random_prompts(5, 5, 50, seed=1)
    prompts.append(prompts[4][:32] + [5, 6, 7])
    generate_and_check(llm, hf_model, prompts, max_tokens=20)
    assert llm.engine.core.kv_cache.prefix_stats.hits > 0


def check_under_preemption(path, hf_model) -> None:
    """24 blocks of 4 tokens cannot hold 8 requests of ~40-70 tokens at once: requests get preempted
    and recomputed, and the outputs stay token-identical."""
    from kvserve import LLM

    small = LLM(model=str(path), num_kv_blocks=24, block_size=4, max_num_batched_tokens=64)
    generate_and_check(small, hf_model, random_prompts(8, 20, 40, seed=2), max_tokens=30)
    assert small.engine.core.scheduler.num_preemptions > 0


def check_ngram_speculation(path, hf_model, prompts: list[list[int]] | None = None) -> None:
    """Repeated n-grams give the proposer something to guess; verification keeps greedy output exact."""
    from kvserve import LLM

    spec = LLM(model=str(path), num_kv_blocks=256, block_size=4, speculative_method="ngram",
               num_speculative_tokens=3)
    generate_and_check(spec, hf_model, motif_prompts(3, seed=3) if prompts is None else prompts, max_tokens=20)
    assert spec.engine.core.spec.stats.proposed > 0
