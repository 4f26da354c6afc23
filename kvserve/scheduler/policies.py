"""Admission policies: which waiting request the scheduler admits next, within a priority.

A policy is chosen by name (``SchedulerConfig.policy``) from a small registry, so the scheduler's
admission loop stays the same whatever the order: it asks ``pick`` for a request and, once the
request is admitted, tells the policy with ``admitted``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from kvserve.kv_cache.manager import KVCacheManager
from kvserve.request import Request
from kvserve.scheduler.queues import WaitingQueue

WorkLeft = Callable[[Request], int]  # tokens a waiting request must compute before its next token


class AdmissionPolicy(Protocol):
    def pick(self, waiting: WaitingQueue, work_left: WorkLeft) -> Request: ...

    def admitted(self, waiting: WaitingQueue, request: Request, num_tokens: int) -> None: ...


_POLICIES: dict[str, type] = {}


def register_policy(name: str):
    def wrap(cls: type) -> type:
        _POLICIES[name] = cls
        return cls
    return wrap


def make_policy(name: str, kv_cache: KVCacheManager, token_budget: int) -> AdmissionPolicy:
    if name not in _POLICIES:
        raise ValueError(f"scheduling policy {name!r} is not one of {sorted(_POLICIES)}")
    return _POLICIES[name](kv_cache, token_budget)


@register_policy("fcfs")
class FirstComeFirstServed:
    """Arrival order; with prefix caching, the next few waiting requests are compared and the one with
    the longest cached prefix goes first, unless the head has been passed over MAX_SKIPS times."""

    CACHE_AWARE_WINDOW = 16  # waiting requests looked at when preferring cached prefixes
    MAX_SKIPS = 8  # a request passed over this often is admitted next regardless

    def __init__(self, kv_cache: KVCacheManager, token_budget: int) -> None:
        self.kv_cache = kv_cache

    def pick(self, waiting: WaitingQueue, work_left: WorkLeft) -> Request:
        if not self.kv_cache.enable_prefix_caching:
            return next(iter(waiting))
        return waiting.pick(lambda r: len(self.kv_cache.match_prefix(r)), self.CACHE_AWARE_WINDOW, self.MAX_SKIPS)

    def admitted(self, waiting: WaitingQueue, request: Request, num_tokens: int) -> None:
        pass


@register_policy("shortest-first")
class ShortestFirst:
    """The fewest tokens left to compute first; a request overtaken by MAX_OVERTAKEN_STEPS token budgets
    of later arrivals (requests that came in a later step) goes next, so a long prompt waits a bounded
    time. Within a burst the order is by length alone: counting a burst's own members as later
    arrivals would force its first-come long prompt in ahead of the short ones."""

    WINDOW = 256  # waiting requests compared
    MAX_OVERTAKEN_STEPS = 4

    def __init__(self, kv_cache: KVCacheManager, token_budget: int) -> None:
        self.max_overtaken = self.MAX_OVERTAKEN_STEPS * token_budget

    def pick(self, waiting: WaitingQueue, work_left: WorkLeft) -> Request:
        return waiting.pick_least_work(work_left, self.WINDOW, self.max_overtaken)

    def admitted(self, waiting: WaitingQueue, request: Request, num_tokens: int) -> None:
        waiting.charge_overtaken(request, num_tokens)
