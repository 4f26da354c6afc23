"""Continuous batching: every step, decide which requests run and how many tokens each computes.

There are no prefill/decode phases. Each request has ``num_computed_tokens`` of ``num_tokens``;
the scheduler closes that gap under a token budget. Running requests go first (a decode costs one
token, an unfinished prompt a chunk), then waiting requests are admitted while budget, sequence
slots and KV blocks last. When blocks run out, the newest running request is preempted: its
blocks are freed and it is recomputed later from its tokens, so nothing is lost.
"""

from __future__ import annotations

from collections import deque

from kvserve.config import SchedulerConfig
from kvserve.kv_cache.manager import KVCacheManager
from kvserve.scheduler.output import ScheduledRequest, SchedulerOutput
from kvserve.types import FinishReason, Request, RequestStatus


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # ---- queue management -------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_request(self, request_id: str, reason: FinishReason) -> Request | None:
        """Remove a request wherever it is and free its blocks. Unknown ids are ignored."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv_cache.free(request_id)
        request.status, request.finish_reason = RequestStatus.FINISHED, reason
        return request

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- the step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted_ids:  # admitting while evicting would only thrash
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._make_room(request, num_new, out):
                break  # the request preempted itself: it was the newest
            out.scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
            i += 1
        return budget

    def _make_room(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Allocate blocks for ``request``, preempting the newest running requests if needed."""
        while not self.kv_cache.allocate_slots(request.request_id, request.num_computed_tokens + num_new):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted_ids.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self.kv_cache.allocate_slots(request.request_id, request.num_computed_tokens + num_new):
                break
            self.waiting.popleft()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            out.scheduled.append(self._scheduled(request, num_new))
            budget -= num_new

    def _scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        tokens = request.token_slice(start, start + num_new)
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=tokens,
            start_pos=start,
            block_table=list(self.kv_cache.block_table(request.request_id)),
            sample=start + num_new == request.num_tokens,
            sampling_params=request.sampling_params,
            num_generated=len(request.output_token_ids),
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
        )

    def update_after_step(self, out: SchedulerOutput) -> None:
        """Advance the counters of every request that ran."""
        for s in out.scheduled:
            request = self.requests.get(s.request_id)
            if request is not None:
                request.num_computed_tokens += len(s.token_ids)
