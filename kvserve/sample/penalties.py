"""Presence, frequency and repetition penalties, logit_bias and allowed_token_ids, applied to a batch of
logits at once.

Semantics follow vLLM (and OpenAI for the first two):
  presence:   logit -= presence_penalty                     if the token was generated at all
  frequency:  logit -= frequency_penalty * count            count = times it was generated
  repetition: logit /= rp if logit > 0 else logit *= rp     if the token is in the prompt or output
  logit_bias: logit += bias[token]
  allowed_token_ids: logit = -inf                          for every token not in the list
Only the rows that ask for any of these are touched; the others cost nothing. ``hold_back`` rules
tokens out of a row altogether (min_tokens: a request's EOS and stop ids until enough are out;
bad_words: the token that would complete one, ``bad_word_completions``).
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
    if len(rows) == len(params):  # every row: a copy (the raw logits stay for logprobs), no gather and scatter
        adjusted = _history_penalties(logits.clone(), list(params), list(prompt_token_ids), list(output_token_ids))
        return _allowed_only(_logit_bias(adjusted, list(params)), list(params))
    chosen = [params[i] for i in rows]
    index = torch.tensor(rows, device=logits.device)
    sub = logits.index_select(0, index)
    sub = _history_penalties(sub, chosen, [prompt_token_ids[i] for i in rows], [output_token_ids[i] for i in rows])
    sub = _allowed_only(_logit_bias(sub, chosen), chosen)
    return logits.index_copy(0, index, sub)


def _history_penalties(logits: torch.Tensor, params: list[SamplingParams], prompts: list[list[int]],
                       outputs: list[list[int]]) -> torch.Tensor:
    """In place, on a tensor of the caller's own. Only the (row, token) pairs a history holds are
    touched, not [rows, vocabulary]: dense count tensors cost several times as much a step."""
    device, vocab = logits.device, logits.shape[-1]
    if any(p.repetition_penalty != 1 for p in params):
        rows, tokens, _ = _history_pairs([*prompts, *outputs], len(prompts), vocab, device)
        if rows.numel():
            rp = torch.tensor([p.repetition_penalty for p in params], device=device, dtype=logits.dtype)[rows]
            seen = logits[rows, tokens]
            logits[rows, tokens] = torch.where(seen > 0, seen / rp, seen * rp)
    if any(p.frequency_penalty or p.presence_penalty for p in params):
        rows, tokens, counts = _history_pairs(outputs, len(outputs), vocab, device)
        if rows.numel():
            freq = torch.tensor([p.frequency_penalty for p in params], device=device, dtype=logits.dtype)[rows]
            pres = torch.tensor([p.presence_penalty for p in params], device=device, dtype=logits.dtype)[rows]
            logits[rows, tokens] -= freq * counts + pres
    return logits


def _history_pairs(token_lists: Sequence[list[int]], num_rows: int, vocab: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The distinct (row, token) pairs of the lists (list i belongs to row i % num_rows) and how often
    each occurs."""
    lengths = torch.tensor([len(t) for t in token_lists])
    rows = torch.arange(len(token_lists)).remainder(num_rows).repeat_interleave(lengths)
    tokens = torch.tensor([t for tokens in token_lists for t in tokens], dtype=torch.long)
    keys, counts = (rows * vocab + tokens).to(device).unique(return_counts=True)
    return keys // vocab, keys % vocab, counts


def _logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    pairs = [(row, tok, bias) for row, p in enumerate(params) for tok, bias in (p.logit_bias or {}).items()]
    if not pairs:
        return logits
    rows, toks, biases = zip(*pairs)
    device = logits.device
    index = (torch.tensor(rows, device=device), torch.tensor(toks, device=device))
    return logits.index_put(index, torch.tensor(biases, dtype=logits.dtype, device=device), accumulate=True)


def _allowed_only(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """In place: -inf for every token outside each row's allowed_token_ids (rows without a list untouched)."""
    rows = [(row, p.allowed_token_ids) for row, p in enumerate(params) if p.allowed_token_ids]
    if not rows:
        return logits
    vocab, device = logits.shape[-1], logits.device
    ruled_out = torch.ones(len(rows), vocab, dtype=torch.bool, device=device)
    for i, (_, allowed) in enumerate(rows):
        ruled_out[i, torch.tensor([t for t in allowed if t < vocab], dtype=torch.long, device=device)] = False
    index = torch.tensor([row for row, _ in rows], device=device)
    logits[index] = logits[index].masked_fill(ruled_out, float("-inf"))
    return logits


def bad_word_completions(bad_words_token_ids: Sequence[list[int]], output_token_ids: list[int]) -> list[int]:
    """The tokens that would complete a bad word now: each word's last token, where the output ends
    with the tokens before it (a one-token word always)."""
    out = []
    for word in bad_words_token_ids:
        head = len(word) - 1
        if head == 0 or (len(output_token_ids) >= head and output_token_ids[-head:] == word[:-1]):
            out.append(word[-1])
    return out


def hold_back(logits: torch.Tensor, held_back: Sequence[list[int]], copy: bool) -> torch.Tensor:
    """``logits`` [B, V] with row i's ``held_back[i]`` token ids at -inf (on a copy if ``copy``: the
    caller's raw logits stay for logprobs); ``logits`` itself when no row holds any back."""
    pairs = [(row, token) for row, tokens in enumerate(held_back) for token in tokens if token < logits.shape[-1]]
    if not pairs:
        return logits
    out = logits.clone() if copy else logits
    rows, tokens = zip(*pairs)
    out[torch.tensor(rows, device=out.device), torch.tensor(tokens, device=out.device)] = float("-inf")
    return out
