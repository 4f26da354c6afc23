"""When and how much to speculate, and the acceptance statistics.

Speculation pays while decode is memory-bound (small batches) and while guesses are accepted.
So proposals are made only while at most ``max_batch_size`` requests are decoding, and each
request's k is chosen per step from a moving estimate of the chance ``a`` that its next guess is
accepted: k tokens verified emit 1 + a + ... + a^k tokens on average and cost 1 + c * k decode
steps (c = ``verify_token_cost``), so k maximises their ratio, up to ``num_speculative_tokens``. A
request for which no k pays (its guesses keep failing) only probes: one token every few steps.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.config import SpeculativeConfig
from kvserve.request import Request
from kvserve.spec_decode.proposer import Proposer

_EMA = 0.3  # weight of the latest step in the acceptance estimate
_PROBE_EVERY = 4  # a request for which speculation does not pay proposes one token this often


@dataclass
class SpecStats:
    proposed: int = 0
    accepted: int = 0
    verified_requests: int = 0  # request-steps that verified proposals
    emitted: int = 0  # tokens those request-steps produced (accepted + the target's own)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_tokens_per_step(self) -> float:
        return self.emitted / self.verified_requests if self.verified_requests else 0.0


class SpeculativeController:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int) -> None:
        self.config, self.proposer, self.max_model_len = config, proposer, max_model_len
        self.stats = SpecStats()

    def propose(self, running: list[Request]) -> None:
        """Set ``spec_token_ids`` for the next step on every eligible decoding request."""
        decoding = [r for r in running if r.num_computed_tokens == r.num_tokens - 1]
        for r in running:
            r.spec_token_ids, r.spec_probs = [], None
        if not decoding or len(decoding) > self.config.max_batch_size:
            return
        ks = {r.request_id: self._k_for(r) for r in decoding if self._eligible(r)}
        eligible = [r for r in decoding if ks.get(r.request_id, 0) > 0]
        proposals = self.proposer.propose(eligible, max(ks[r.request_id] for r in eligible)) if eligible else {}
        for r in eligible:
            p = proposals.get(r.request_id)
            if p is None:
                continue
            k = min(ks[r.request_id], len(p.token_ids))
            if r.grammar is not None:  # structured outputs: only proposals the grammar allows are worth scoring
                k = r.grammar.num_valid(p.token_ids[:k])
            r.spec_token_ids = p.token_ids[:k]
            r.spec_probs = None if p.probs is None else p.probs[:k]

    def _eligible(self, r: Request) -> bool:
        params = r.sampling_params
        # Penalties and logprobs depend on every earlier token, and min_tokens on their count; keep those
        # requests on the plain path (the last only until its tokens are out).
        return not (params.needs_penalties or params.logprobs is not None or self._room(r) <= 0
                    or len(r.output_token_ids) < params.min_tokens)

    def _room(self, r: Request) -> int:
        """Proposals that still fit before max_tokens and the context window."""
        left = r.sampling_params.max_tokens - len(r.output_token_ids) - 1
        return min(left, self.max_model_len - r.num_tokens)

    def _k_for(self, r: Request) -> int:
        """Tokens to propose for ``r`` this step (0: none)."""
        k = best_k(r.spec_acceptance, self.config.verify_token_cost, min(self.config.num_speculative_tokens, self._room(r)))
        if k == 0 and len(r.output_token_ids) % _PROBE_EVERY == 0:
            return 1  # guesses that kept failing cost a wider pass for nothing: only probe now and then
        return k

    def record(self, r: Request, num_proposed: int, num_emitted: int) -> None:
        accepted = num_emitted - 1
        self.stats.proposed += num_proposed
        self.stats.accepted += accepted
        self.stats.verified_requests += 1
        self.stats.emitted += num_emitted
        # Guesses are accepted up to the first miss: `accepted` successes, then one failure unless all held.
        observed = accepted / (accepted + (accepted < num_proposed))
        r.spec_acceptance = (1 - _EMA) * r.spec_acceptance + _EMA * observed

    def forget(self, request_id: str) -> None:
        self.proposer.forget(request_id)


def best_k(acceptance: float, token_cost: float, max_k: int) -> int:
    """The k in 1..max_k with the most expected tokens per unit of verify cost, or 0 where none beats
    plain decoding (1 token per step)."""
    best, best_value = 0, 1.0
    for k in range(1, max_k + 1):
        value = sum(acceptance ** i for i in range(k + 1)) / (1 + token_cost * k)
        if value > best_value:
            best, best_value = k, value
    return best
