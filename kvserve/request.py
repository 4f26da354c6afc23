"""The engine's internal record of one sequence being generated (the public API types are in types.py)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from kvserve.types import FinishReason, RequestMetrics, SamplingParams, TokenLogprob

# Stands for a token sampled on the device whose id the host has not read yet (async scheduling):
# the runner fills it in from the previous step's sampled ids.
PLACEHOLDER = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass
class Request:
    """One sequence being generated.

    The engine tracks progress with counters, not phases: ``num_computed_tokens`` of
    ``all_token_ids`` already have KV in the cache; the scheduler closes the gap.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    priority: int = 0  # lower runs first; FCFS within a priority
    fork_of: str | None = None  # n > 1: a sibling whose prompt KV this request shares instead of recomputing
    num_cached_tokens: int | None = None  # prompt tokens served from the prefix cache at first admission
    arrival_seq: int = 0  # set by the scheduler: FCFS order, kept across preemption
    arrival_step: int = 0  # set by the scheduler: steps scheduled before it came (same value: arrived together)
    num_skips: int = 0  # times cache-aware admission let a later request go first
    num_overtaken_tokens: int = 0  # shortest-first: tokens admitted for later arrivals while this one waited
    spec_token_ids: list[int] = field(default_factory=list)  # proposals to verify in the next step
    spec_probs: Any = None  # draft distribution [k, V] of those proposals (None: point mass)
    spec_acceptance: float = 1.0  # moving estimate of the chance that its next proposed token is accepted
    output_logprobs: list[TokenLogprob] = field(default_factory=list)  # filled when params.logprobs is set
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # for prompt tokens 1.., if asked
    grammar: Any = None  # structured outputs: its GrammarMatcher (sample/grammar.py), advanced on every token
    # Async scheduling: tokens sampled on the device, not read yet. They count in num_tokens (the
    # scheduler computes them next) and read as PLACEHOLDER until the engine appends their ids.
    num_pending: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far, those still on the device included."""
        return len(self.output_token_ids) + self.num_pending

    def token_slice(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` without concatenating the whole history; pending tokens read
        as PLACEHOLDER."""
        p = len(self.prompt_token_ids)
        if self.num_pending:
            known = p + len(self.output_token_ids)
            if start >= known:  # a decode's one input, still on the device
                return [PLACEHOLDER] * (min(end, known + self.num_pending) - start)
            if end > known:
                return self.token_slice(start, known) + [PLACEHOLDER] * (min(end, known + self.num_pending) - known)
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        if end <= p:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED
