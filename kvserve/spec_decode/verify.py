"""Verifying proposals against the target model: one forward pass scored k + 1 positions.

Greedy: accept proposed tokens while they equal the target's argmax; then emit the argmax at the
first mismatch (or the bonus token after the last proposal). Output is identical to plain greedy.

Sampling (the standard speculative-sampling rule): with target probabilities p and draft
probabilities q at a position, accept the proposed x with probability min(1, p(x) / q(x)); on
rejection draw from the residual max(p - q, 0), renormalised, and stop. An n-gram guess is a
point-mass draft (q(x) = 1), so it is accepted with probability p(x) and the residual is p with x
removed. Either way the emitted tokens are distributed exactly as the target's own samples.
"""

from __future__ import annotations

import torch

from kvserve.sample.sampler import draw, seeded_generator
from kvserve.types import SamplingParams

_VERIFY_SEED_OFFSET = 7919  # verification's stream apart from the sampler's at the same position


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
