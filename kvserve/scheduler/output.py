"""Plain data the scheduler hands the worker each step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvserve.types import SamplingParams


@dataclass
class ScheduledRequest:
    """One request's share of a step: compute ``token_ids`` at positions ``start_pos ...``.

    ``sample`` is true when this chunk reaches the end of the request's known tokens, so the
    last position's logits give its next token (a partial prefill chunk samples nothing).
    """

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_table: list[int]  # the KV-cache manager's own list (not a copy): valid for this step
    sample: bool
    sampling_params: SamplingParams
    num_generated: int = 0  # tokens generated so far, e.g. for per-request RNG streams
    spec_token_ids: list[int] = field(default_factory=list)  # proposals at the end of token_ids, to verify
    spec_probs: Any = None  # their draft distribution, or None for point-mass (n-gram) guesses
    # The request's token history, for penalties and prompt logprobs (shared references, not copies).
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    grammar: Any = None  # structured outputs: the request's GrammarMatcher, whose masks constrain sampling
    eos_token_ids: tuple[int, ...] = ()  # the request's own (none with ignore_eos), held back by min_tokens
    # A hybrid model's KV groups 1.. (kv_cache/groups.py): their tables, as live as block_table (group 0's)
    group_block_tables: tuple[list[int], ...] = ()


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst): copy-on-write forks

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
