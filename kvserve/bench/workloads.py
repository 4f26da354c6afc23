"""Seeded synthetic workloads: token-id prompts of given lengths, so every engine sees the same input."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int


def random_requests(num: int, prompt_len: tuple[int, int], output_len: tuple[int, int], vocab_size: int,
                    seed: int = 0, low_token: int = 100) -> list[BenchRequest]:
    """``num`` requests with lengths uniform in the given inclusive ranges and random token ids.

    Token ids start at ``low_token`` to stay clear of the special tokens most vocabularies put first.
    """
    if prompt_len[0] < 1 or prompt_len[0] > prompt_len[1]:
        raise ValueError(f"prompt length range {prompt_len} must satisfy 1 <= low <= high")
    if output_len[0] < 1 or output_len[0] > output_len[1]:
        raise ValueError(f"output length range {output_len} must satisfy 1 <= low <= high")
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        n = rng.randint(*prompt_len)
        out.append(BenchRequest([rng.randrange(low_token, vocab_size) for _ in range(n)], rng.randint(*output_len)))
    return out
