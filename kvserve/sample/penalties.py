"""Presence, frequency and repetition penalties and logit_bias, applied to a batch of logits at once.

Semantics follow vLLM (and OpenAI for the first two):
  presence:   logit -= presence_penalty                     if the token was generated at all
  frequency:  logit -= frequency_penalty * count            count = times it was generated
  repetition: logit /= rp if logit > 0 else logit *= rp     if the token is in the prompt or output
  logit_bias: logit += bias[token]
Only the rows that ask for any of these are touched; the others cost nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvserve.types import SamplingParams


def apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams], prompt_token_ids: Sequence[list[int]],
                    output_token_ids: Sequence[list[int]]) -> torch.Tensor:
    """Return ``logits`` [B, V] with each row's penalties and bias applied (a new tensor if any row needs it)."""
    rows = [i for i, p in enumerate(params) if p.needs_penalties]
    if not rows:
        return logits
    chosen = [params[i] for i in rows]
    index = torch.tensor(rows, device=logits.device)
    sub = logits.index_select(0, index)
    sub = _history_penalties(sub, chosen, [prompt_token_ids[i] for i in rows], [output_token_ids[i] for i in rows])
    sub = _logit_bias(sub, chosen)
    return logits.index_copy(0, index, sub)


def _history_penalties(logits: torch.Tensor, params: list[SamplingParams], prompts: list[list[int]],
                       outputs: list[list[int]]) -> torch.Tensor:
    device = logits.device
    counts = token_counts(outputs, logits.shape[-1], device)
    if any(p.repetition_penalty != 1 for p in params):
        seen = (token_counts(prompts, logits.shape[-1], device) + counts) > 0
        rp = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
        logits = torch.where(seen, torch.where(logits > 0, logits / rp, logits * rp), logits)
    if any(p.frequency_penalty or p.presence_penalty for p in params):
        freq = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
        pres = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
        logits = logits - freq * counts - pres * (counts > 0)
    return logits


def _logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    pairs = [(row, tok, bias) for row, p in enumerate(params) for tok, bias in (p.logit_bias or {}).items()]
    if not pairs:
        return logits
    rows, toks, biases = zip(*pairs)
    device = logits.device
    index = (torch.tensor(rows, device=device), torch.tensor(toks, device=device))
    return logits.index_put(index, torch.tensor(biases, dtype=logits.dtype, device=device), accumulate=True)


def token_counts(token_lists: Sequence[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[R, V] float tensor: how often each token id occurs in each row's list (ragged lists padded)."""
    width = max((len(t) for t in token_lists), default=0)
    counts = torch.zeros(len(token_lists), vocab_size + 1, device=device)
    if width == 0:
        return counts[:, :vocab_size]
    padded = torch.full((len(token_lists), width), vocab_size, dtype=torch.long)  # pad into a spare column
    for row, tokens in enumerate(token_lists):
        padded[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    counts.scatter_add_(1, padded.to(device), torch.ones(padded.shape, device=device))
    return counts[:, :vocab_size]
