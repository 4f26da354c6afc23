"""The waiting queue: ordered by (priority, arrival); picks that look past the head (cache-aware, shortest-first)."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator

from kvserve.request import Request


def order_key(request: Request) -> tuple[int, int]:
    return request.priority, request.arrival_seq


class WaitingQueue:
    """Requests waiting for admission; a preempted request keeps its arrival number, so it returns
    ahead of everything that arrived after it within its priority."""

    def __init__(self) -> None:
        self._items: list[Request] = []

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items)

    def __contains__(self, request: Request) -> bool:
        return request in self._items

    def add(self, request: Request) -> None:
        bisect.insort(self._items, request, key=order_key)

    def remove(self, request: Request) -> None:
        self._items.remove(request)

    def candidates(self, window: int) -> list[Request]:
        """The head and up to ``window - 1`` requests behind it with the head's priority."""
        if not self._items:
            return []
        head = self._items[0]
        return [r for r in self._items[:window] if r.priority == head.priority]

    def pick(self, score: Callable[[Request], int], window: int, max_skips: int) -> Request:
        """The best-scoring candidate (ties go to the earliest). A head already passed over
        ``max_skips`` times is taken regardless, so no request starves."""
        cands = self.candidates(window)
        head = cands[0]
        if head.num_skips >= max_skips or len(cands) == 1:
            return head
        best = max(cands, key=lambda r: (score(r), -cands.index(r)))
        if best is not head:
            for r in cands[:cands.index(best)]:
                r.num_skips += 1
        return best

    def pick_least_work(self, work: Callable[[Request], int], window: int, max_overtaken: int) -> Request:
        """The candidate with the least ``work`` (ties go to the earliest), unless one has been
        overtaken by ``max_overtaken`` tokens or more: then the earliest such one."""
        cands = self.candidates(window)
        overdue = next((r for r in cands if r.num_overtaken_tokens >= max_overtaken), None)
        if overdue is not None:
            return overdue
        return min(enumerate(cands), key=lambda ir: (work(ir[1]), ir[0]))[1]

    def charge_overtaken(self, admitted: Request, num_tokens: int) -> None:
        """``admitted`` (still queued) is about to compute ``num_tokens``: charge them to every request
        of its priority that arrived before it, in an earlier step, and still waits. Requests that came
        before the same step arrived together (a burst): their order among themselves starves no one."""
        for r in self._items:
            if r is admitted:
                return
            if r.priority == admitted.priority and r.arrival_step < admitted.arrival_step:
                r.num_overtaken_tokens += num_tokens
