"""Seeded workloads that share prefixes, as chat, agents and RAG do (token-id prompts).

Each returns *rounds*: lists of prompts where a round may only be sent after the previous one
finished (a turn cannot start before the last reply). Replies are synthetic tokens fixed by the
seed, so every engine and every cache setting sees exactly the same prompts.
"""

from __future__ import annotations

import random

Vocab = tuple[int, int]  # token ids are drawn from [low, high)


def _tokens(rng: random.Random, n: int, vocab: Vocab) -> list[int]:
    return [rng.randrange(*vocab) for _ in range(n)]


def shared_system_prompt(rng: random.Random, num_requests: int, prefix_len: int, vocab: Vocab,
                         question_len: tuple[int, int] = (8, 24)) -> list[list[int]]:
    """(a) One long system prompt, then a short distinct question per request. One round."""
    system = _tokens(rng, prefix_len, vocab)
    return [system + _tokens(rng, rng.randint(*question_len), vocab) for _ in range(num_requests)]


def multi_turn_chat(rng: random.Random, conversations: int, turns: int, vocab: Vocab,
                    turn_len: tuple[int, int] = (20, 60), system_len: int = 32) -> list[list[list[int]]]:
    """(b) Each turn resends the whole history: system + (user, assistant)* + user."""
    histories = [_tokens(rng, system_len, vocab) for _ in range(conversations)]
    rounds = []
    for _ in range(turns):
        prompts = []
        for c in range(conversations):
            histories[c] = histories[c] + _tokens(rng, rng.randint(*turn_len), vocab)
            prompts.append(list(histories[c]))
            histories[c] += _tokens(rng, rng.randint(*turn_len), vocab)  # the reply, resent next turn
        rounds.append(prompts)
    return rounds


def agentic_branches(rng: random.Random, context_len: int, branches: int, rounds: int, vocab: Vocab,
                     step_len: tuple[int, int] = (10, 30)) -> list[list[list[int]]]:
    """(c) One long context, then ``branches`` continuations, each extended for several rounds."""
    context = _tokens(rng, context_len, vocab)
    paths = [list(context) for _ in range(branches)]
    out = []
    for _ in range(rounds):
        for p in paths:
            p += _tokens(rng, rng.randint(*step_len), vocab)
        out.append([list(p) for p in paths])
    return out
