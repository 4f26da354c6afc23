"""Speculative acceptance: which proposals the target model's k + 1 scored positions keep.

Greedy: accept proposed tokens while they equal the target's argmax; then emit the argmax at the
first mismatch (or the bonus token after the last proposal). Output is identical to plain greedy.

Sampling (the standard speculative-sampling rule): with target probabilities p and draft
probabilities q at a position, accept the proposed x with probability min(1, p(x) / q(x)); on
rejection draw from the residual max(p - q, 0), renormalised, and stop. An n-gram guess is a
point-mass draft (q(x) = 1), so it is accepted with probability p(x) and the residual is p with x
removed. Either way the emitted tokens are distributed exactly as the target's own samples.
"""

from __future__ import annotations

import itertools
from typing import Protocol

import torch

from kvserve.sample.sampler import argmax_rows, draw, row_probs, seeded_generator
from kvserve.types import SamplingParams

_VERIFY_SEED_OFFSET = 7919  # verification's stream apart from the sampler's at the same position


class Proposal(Protocol):
    """What acceptance reads of a scheduled speculative request."""

    request_id: str
    spec_token_ids: list[int]
    spec_probs: torch.Tensor | None
    sampling_params: SamplingParams
    num_generated: int


def accept_proposals(logits: torch.Tensor, requests: list[Proposal],
                     fallback: torch.Generator) -> dict[str, list[int]]:
    """``logits``: the target's rows for each request's k + 1 positions, requests one after another.

    Greedy requests share one argmax call over their positions, sampling ones one row_probs call
    (on the CPU both are single C++ calls for the whole batch). Returns each request's emitted tokens.
    """
    starts = list(itertools.accumulate((len(r.spec_token_ids) + 1 for r in requests), initial=0))
    ranges = [range(starts[j], starts[j + 1]) for j in range(len(requests))]
    sampled = [j for j, r in enumerate(requests) if not r.sampling_params.greedy]
    targets = argmax_rows(logits).tolist() if len(sampled) < len(requests) else []
    probs = {}
    if sampled:
        at = torch.tensor([p for j in sampled for p in ranges[j]], device=logits.device)
        dists = row_probs(logits[at], [requests[j].sampling_params for j in sampled for _ in ranges[j]]).cpu()
        offsets = itertools.accumulate((len(ranges[j]) for j in sampled), initial=0)
        probs = {j: dists[o:o + len(ranges[j])] for j, o in zip(sampled, offsets)}
    out = {}
    for j, r in enumerate(requests):
        if j in probs:
            out[r.request_id] = verify_sampled(probs[j], r.spec_token_ids, r.sampling_params, r.num_generated,
                                               fallback, r.spec_probs)
        else:
            out[r.request_id] = verify_greedy(targets[starts[j]:starts[j + 1]], r.spec_token_ids)
    return out


def _generator(params: SamplingParams, step: int, fallback: torch.Generator) -> torch.Generator:
    """Per-request stream keyed by (seed, output position), as the sampler does; shared otherwise."""
    if params.seed is None:
        return fallback
    return seeded_generator(params.seed, step + _VERIFY_SEED_OFFSET)


def verify_greedy(target: list[int], proposed: list[int]) -> list[int]:
    """``target``: the target model's argmax at the k + 1 positions that predict proposed[0..k-1] and
    one more. Returns the emitted tokens: the accepted proposals plus the target's own (1..k+1)."""
    out = []
    for guess, best in zip(proposed, target):
        if guess != best:
            break
        out.append(guess)
    return out + [target[len(out)]]


def verify_sampled(probs: torch.Tensor, proposed: list[int], params: SamplingParams, num_generated: int,
                   fallback: torch.Generator, draft_probs: torch.Tensor | None = None) -> list[int]:
    """``probs`` [k + 1, V]: the target's distributions at those positions (sampler.row_probs).

    Returns the emitted tokens, as verify_greedy does.
    """
    probs = probs.cpu()
    out = []
    for j, guess in enumerate(proposed):
        gen = _generator(params, num_generated + j, fallback)
        q = 1.0 if draft_probs is None else float(draft_probs[j, guess])
        p = float(probs[j, guess])
        if torch.rand((), generator=gen).item() * q < p:  # u < p / q, without dividing by a tiny q
            out.append(guess)
            continue
        residual = probs[j].clone()
        if draft_probs is None:
            residual[guess] = 0.0
        else:
            residual = (residual - draft_probs[j].float().cpu()).clamp_min(0.0)
        if residual.sum() <= 0:  # p == q exactly: any token from p is correct
            residual = probs[j]
        return out + [draw(residual, gen)]
    gen = _generator(params, num_generated + len(proposed), fallback)
    return out + [draw(probs[len(proposed)], gen)]
