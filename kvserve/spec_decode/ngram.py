"""Prompt-lookup (n-gram) proposals: if the last n tokens appeared before in the request's own prompt
or output, guess that what followed them then follows now. No extra model; strong on tasks that copy
from their input (summaries, extraction, code edits)."""

from __future__ import annotations

from kvserve.request import Request
from kvserve.spec_decode.proposer import Proposal, register_proposer


def ngram_lookup(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest matching suffix."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        # scan right to left: the most recent occurrence is the likeliest continuation
        for start in range(length - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


@register_proposer("ngram")
class NgramProposer:
    def __init__(self, min_n: int = 1, max_n: int = 4, **_: object) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram window [{min_n}, {max_n}] must satisfy 1 <= min <= max")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, requests: list[Request], k: int) -> dict[str, Proposal]:
        out = {}
        for r in requests:
            guess = ngram_lookup(r.all_token_ids, self.min_n, self.max_n, k)
            if guess:
                out[r.request_id] = Proposal(guess)
        return out

    def forget(self, request_id: str) -> None:
        pass
