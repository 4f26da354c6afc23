"""Token-by-token comparison against transformers on the same weights.

The reference scores our whole output in one teacher-forced forward pass. At every position our
token must be transformers' argmax; where its top two logits are within ``tie`` either token is
accepted and the comparison stops there (the continuations legitimately diverge).
"""

from __future__ import annotations

import torch

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
