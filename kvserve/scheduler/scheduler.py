"""Continuous batching: every step, decide which requests run and how many tokens each computes.

There are no prefill/decode phases. Each request has ``num_computed_tokens`` of ``num_tokens``;
the scheduler closes that gap under a token budget. Running requests go first (a decode costs one
token, an unfinished prompt a chunk), then waiting requests are admitted while budget, sequence
slots and KV blocks last. When blocks run out, the newest running request is preempted: its
blocks are freed and it is recomputed later from its tokens, so nothing is lost.
"""

from __future__ import annotations

import itertools

from kvserve.config import SchedulerConfig
from kvserve.kv_cache.manager import KVCacheManager
from kvserve.request import Request, RequestStatus
from kvserve.scheduler.output import ScheduledRequest, SchedulerOutput
from kvserve.scheduler.policies import make_policy
from kvserve.scheduler.queues import WaitingQueue, order_key
from kvserve.types import FinishReason


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.waiting = WaitingQueue()
        self.policy = make_policy(config.policy, kv_cache, config.max_num_batched_tokens)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._arrivals = itertools.count()
        self._num_schedules = 0

    # ---- queue management -------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        request.arrival_seq = next(self._arrivals)
        request.arrival_step = self._num_schedules
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_request(self, request_id: str, reason: FinishReason) -> Request | None:
        """Remove a request wherever it is and free its blocks. Unknown ids are ignored."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv_cache.forget(request_id)
        request.status, request.finish_reason = RequestStatus.FINISHED, reason
        return request

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- the step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._num_schedules += 1
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted_ids:  # admitting while evicting would only thrash
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        # Every running request passes here every step: the loop reads each value once (this is
        # most of a large decode batch's host time).
        i, running, scheduled = 0, self.running, out.scheduled
        while i < len(running) and budget > 0:
            request = running[i]
            if request.num_pending and request.num_output_tokens >= request.sampling_params.max_tokens:
                i += 1  # its last token is still on the device: it ends when that is read, computing nothing more
                continue
            num_tokens = request.num_tokens
            num_new = min(num_tokens - request.num_computed_tokens, budget)
            spec = self._fit_proposals(request, num_tokens, budget - num_new) if request.spec_token_ids else []
            if not self._make_room(request, num_new + len(spec), out):
                break  # the request preempted itself: it was the last in line
            scheduled.append(self._scheduled(request, num_new, spec, num_tokens))
            budget -= num_new + len(spec)
            i += 1
        return budget

    @staticmethod
    def _fit_proposals(request: Request, num_tokens: int, budget_left: int) -> list[int]:
        """A decoding request's proposals, cut to the token budget (they are verified in its slot)."""
        if not request.spec_token_ids or request.num_computed_tokens != num_tokens - 1:
            return []
        return request.spec_token_ids[:max(0, budget_left)]

    def _make_room(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Allocate blocks for ``request``, preempting the lowest-priority, newest requests if needed."""
        while not self.kv_cache.allocate_slots(request.request_id, request.num_computed_tokens + num_new):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted_ids.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        """Free the blocks (full ones stay in the prefix cache, so resuming is mostly a cache hit)."""
        self.kv_cache.free(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add(request)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        if not self.waiting:
            return  # most decode steps: nothing below (in-flight blocks, first tokens) is needed
        # Held back this step: fork followers whose sibling has not computed the shared prompt yet,
        # and requests whose next uncached block another request is computing (next step it is a hit).
        deferred, admitted = [], False
        in_flight = self._in_flight_blocks()
        first_tokens = any(_is_first_token(s) for s in out.scheduled)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.policy.pick(self.waiting, self._work_left)
            leader = self._fork_leader(request)
            if (leader is not None and not self._can_fork_from(leader, request)) or self._waits_for(request, in_flight):
                self.waiting.remove(request)
                deferred.append(request)
                continue
            if first_tokens and self._work_left(request) > budget:
                # A chunk that cannot finish its prompt now would only delay the first tokens this step
                # already brings; next step it goes first among prompts (it is the least work left, or
                # overdue), so nothing starves. Decodes alone never hold a chunk back.
                break
            num_new = self._admit(request, leader, budget, out)
            if num_new == 0:
                break
            self.policy.admitted(self.waiting, request, num_new)
            self.waiting.remove(request)
            self.running.append(request)
            admitted = True
            request.status = RequestStatus.RUNNING
            out.scheduled.append(self._scheduled(request, num_new))
            first_tokens = first_tokens or _is_first_token(out.scheduled[-1])
            budget -= num_new
            in_flight.update(self.kv_cache.uncached_keys(request, request.num_computed_tokens // self.kv_cache.block_size))
        for request in deferred:
            self.waiting.add(request)
        if admitted:  # highest priority first (preemption takes from the back); only admissions unsort it
            self.running.sort(key=order_key)

    def _in_flight_blocks(self) -> set[int]:
        """Block hashes that running requests are still prefilling."""
        keys: set[int] = set()
        for r in self.running:
            if r.num_computed_tokens < r.num_prompt_tokens:
                keys.update(self.kv_cache.uncached_keys(r, r.num_computed_tokens // self.kv_cache.block_size))
        return keys

    def _waits_for(self, request: Request, in_flight: set[int]) -> bool:
        """True if the request's first uncached block is being computed by another request."""
        if not in_flight or request.fork_of is not None:
            return False
        pending = self.kv_cache.uncached_keys(request, len(self.kv_cache.match_prefix(request)))
        return bool(pending) and pending[0] in in_flight

    def _work_left(self, request: Request) -> int:
        """Tokens a waiting request must compute before its next token: all of them (a preempted one's
        output too) less its cached prefix. A fork follower reuses its sibling's prompt: one token."""
        if self._fork_leader(request) is not None:
            return 1
        return request.num_tokens - len(self.kv_cache.match_prefix(request)) * self.kv_cache.block_size

    def _fork_leader(self, request: Request) -> Request | None:
        """The sibling to fork from, if it is still around; otherwise the request stands alone."""
        if request.fork_of is None:
            return None
        leader = self.requests.get(request.fork_of)
        # (a sliding-window leader may have gone past the prompt and released blocks the follower reads)
        if (leader is None or request.num_computed_tokens or request.output_token_ids
                or not self.kv_cache.can_fork(leader.request_id, request.num_prompt_tokens - 1)):
            request.fork_of = None
            return None
        return leader

    @staticmethod
    def _can_fork_from(leader: Request, request: Request) -> bool:
        return leader.status == RequestStatus.RUNNING and leader.num_computed_tokens >= request.num_prompt_tokens - 1

    def _admit(self, request: Request, leader: Request | None, budget: int, out: SchedulerOutput) -> int:
        """Give a waiting request its blocks (shared where possible); returns tokens to compute, 0 if full."""
        kv = self.kv_cache
        if leader is not None:
            shared = request.num_prompt_tokens - 1
            copies = kv.fork(leader.request_id, request.request_id, shared)
            if copies is None or not kv.allocate_slots(request.request_id, shared + 1):
                kv.free(request.request_id)
                return 0
            out.block_copies.extend(copies)
            request.fork_of = None
            request.num_computed_tokens = shared
            request.num_cached_tokens = shared
            return 1
        use_cache = kv.enable_prefix_caching and request.sampling_params.prompt_logprobs is None  # 0 asks too
        prefix = kv.match_prefix(request) if use_cache and request.num_computed_tokens == 0 else []
        cached = len(prefix) * kv.block_size + request.num_computed_tokens
        num_new = min(request.num_tokens - cached, budget)
        if not kv.allocate_slots(request.request_id, cached + num_new, prefix):
            return 0
        request.num_computed_tokens = cached
        if use_cache:
            kv.record_prefix_query(request.num_tokens, len(prefix) * kv.block_size)
        if request.num_cached_tokens is None:
            request.num_cached_tokens = cached
        return num_new

    def _scheduled(self, request: Request, num_new: int, spec: list[int] | None = None,
                   num_tokens: int | None = None) -> ScheduledRequest:
        start = request.num_computed_tokens
        num_tokens = request.num_tokens if num_tokens is None else num_tokens
        tokens = request.token_slice(start, start + num_new)
        if spec:
            tokens += spec
        tables = self.kv_cache.block_tables(request.request_id)  # the live lists: read them this step only
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=tokens,
            start_pos=start,
            block_table=tables[0],
            group_block_tables=tuple(tables[1:]),
            sample=start + num_new == num_tokens,
            sampling_params=request.sampling_params,
            num_generated=num_tokens - len(request.prompt_token_ids),
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            spec_token_ids=list(spec) if spec else [],
            spec_probs=None if not spec or request.spec_probs is None else request.spec_probs[:len(spec)],
            grammar=request.grammar,
            eos_token_ids=request.eos_token_ids,
        )

    def update_after_step(self, out: SchedulerOutput, num_accepted: dict[str, int] | None = None) -> None:
        """Advance the counters of every request that ran, then publish their KV (``advance``, ``commit``)."""
        self.advance(out, num_accepted)
        self.commit(out)

    def advance(self, out: SchedulerOutput, num_accepted: dict[str, int] | None = None) -> None:
        """Count the step's tokens as computed. A verified request keeps the KV of its last token and
        its accepted proposals; the slots of rejected ones are simply overwritten later."""
        for s in out.scheduled:
            request = self.requests.get(s.request_id)
            if request is not None:
                rejected = len(s.spec_token_ids) - (num_accepted or {}).get(s.request_id, 0)
                request.num_computed_tokens += len(s.token_ids) - rejected

    def commit(self, out: SchedulerOutput) -> None:
        """Publish the step's newly full blocks in the prefix cache (hashed by content: every token they
        hold must be known by now) and release the blocks behind a sliding window."""
        for s in out.scheduled:
            request = self.requests.get(s.request_id)
            if request is not None:
                self.kv_cache.commit_computed(request)


def _is_first_token(s: ScheduledRequest) -> bool:
    """The step computes the end of this request's prompt and samples: its first token (or, resuming
    after preemption, its next one)."""
    return s.sample and s.start_pos < len(s.prompt_token_ids)
