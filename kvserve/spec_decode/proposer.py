"""The proposer interface and registry: something that guesses a request's next k tokens cheaply."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from kvserve.request import Request


@dataclass
class Proposal:
    """Guessed tokens; ``probs`` [k, V] is the draft distribution each was drawn from (None = point mass)."""

    token_ids: list[int]
    probs: torch.Tensor | None = None


class Proposer(Protocol):
    def propose(self, requests: list[Request], k: int) -> dict[str, Proposal]:
        """Proposals (possibly empty) for requests that are decoding; called once per step."""
        ...

    def forget(self, request_id: str) -> None:
        """The request ended: drop whatever the proposer kept for it."""
        ...


_PROPOSERS: dict[str, Callable[..., Proposer]] = {}


def register_proposer(name: str) -> Callable:
    def wrap(factory: Callable[..., Proposer]) -> Callable[..., Proposer]:
        _PROPOSERS[name] = factory
        return factory

    return wrap


def make_proposer(name: str, **kwargs) -> Proposer:
    from kvserve.spec_decode import draft_model, ngram  # noqa: F401  (register themselves)

    if name not in _PROPOSERS:
        raise ValueError(f"speculative_method={name!r} is not supported; choose one of {sorted(_PROPOSERS)}")
    return _PROPOSERS[name](**kwargs)
