"""Which replica serves a request: round-robin, least-load, or prefix-aware (the default).

Prefix-aware routing keeps, per replica, an approximate picture of its prefix cache: the chained
hashes (kv_cache/hashing.py) of the full blocks of the prompts it was sent, least recently sent
first, at most as many as the replica's KV pool holds (older ones are taken as evicted, each
prompt's tail before its head, as the replica's pool evicts). A request goes to the replica that
holds the longest run of its leading blocks, so a multi-turn conversation or an agent resending its
history lands where its KV already is. A request that no replica holds at least ``min_match`` of
(a new conversation that shares at most a system prompt, or one whose history was evicted) goes
where it displaces the least: the replica with the most room in its pool, else the one whose least
recently used block is the oldest, which keeps each replica's share of the conversations within its
pool. Affinity yields to balance: when the chosen replica has ``balance_abs`` more requests in flight
than the least-loaded one and more than ``balance_rel`` times its load, the request goes to the
least-loaded replica instead (the knobs SGLang's router exposes, with its defaults' spirit).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

from kvserve.kv_cache.hashing import chain_keys

ROUTERS = ("prefix-aware", "least-load", "round-robin")


class Router:
    """Tracks each replica's in-flight requests and health; subclasses choose among the healthy."""

    def __init__(self, num_replicas: int) -> None:
        self.load = [0] * num_replicas
        self.healthy = [True] * num_replicas

    def choose(self, token_ids: list[int], exclude: frozenset[int] = frozenset()) -> int:
        """The replica for a prompt (never one in ``exclude`` or marked down); raises LookupError if none."""
        candidates = [i for i, ok in enumerate(self.healthy) if ok and i not in exclude]
        if not candidates:
            raise LookupError("no healthy replica")
        return self._pick(token_ids, candidates)

    def _pick(self, token_ids: list[int], candidates: list[int]) -> int:
        raise NotImplementedError

    def started(self, replica: int) -> None:
        self.load[replica] += 1

    def finished(self, replica: int) -> None:
        self.load[replica] -= 1

    def mark_down(self, replica: int) -> None:
        self.healthy[replica] = False

    def mark_up(self, replica: int) -> None:
        self.healthy[replica] = True

    def set_capacity(self, replica: int, blocks: int) -> None:
        """The blocks ``replica``'s KV pool holds; routers that model its cache use it."""

    def least_loaded(self, candidates: list[int]) -> int:
        return min(candidates, key=lambda i: (self.load[i], i))


class RoundRobin(Router):
    def __init__(self, num_replicas: int) -> None:
        super().__init__(num_replicas)
        self._next = itertools.count()

    def _pick(self, token_ids: list[int], candidates: list[int]) -> int:
        return candidates[next(self._next) % len(candidates)]


class LeastLoad(Router):
    def _pick(self, token_ids: list[int], candidates: list[int]) -> int:
        return self.least_loaded(candidates)


class PrefixAware(Router):
    def __init__(self, num_replicas: int, block_size: int = 16, max_blocks: int = 65536,
                 balance_abs: int = 4, balance_rel: float = 1.5, min_match: float = 0.5) -> None:
        super().__init__(num_replicas)
        self.block_size = block_size
        self.balance_abs, self.balance_rel, self.min_match = balance_abs, balance_rel, min_match
        self.capacity = [max_blocks] * num_replicas  # blocks each replica's pool holds (set_capacity)
        # per replica: block hash -> when it was last sent there, least recently sent first
        self.trees: list[OrderedDict[int, int]] = [OrderedDict() for _ in range(num_replicas)]
        self._clock = itertools.count()

    def set_capacity(self, replica: int, blocks: int) -> None:
        """Remember at most ``blocks`` blocks for ``replica``: what its KV pool holds."""
        self.capacity[replica] = max(1, blocks)
        self._trim(replica)

    def _pick(self, token_ids: list[int], candidates: list[int]) -> int:
        hashes = [k.hash for k in chain_keys(token_ids, self.block_size, [])]
        matched = {i: self.matched_blocks(i, hashes) for i in candidates}
        best = max(candidates, key=lambda i: (matched[i], -self.load[i], -i))
        idle = self.least_loaded(candidates)
        if not hashes:  # not a full block: nothing to find or to keep
            return idle
        if matched[best] < self.min_match * len(hashes):
            best = self.roomiest(candidates)
        if self._imbalanced(best, idle):
            best = idle
        self._remember(best, hashes)
        return best

    def matched_blocks(self, replica: int, hashes: list[int]) -> int:
        """How many leading blocks of a prompt (as chained hashes) ``replica`` is taken to hold."""
        tree = self.trees[replica]
        n = 0
        for h in hashes:
            if h not in tree:
                break
            n += 1
        return n

    def roomiest(self, candidates: list[int]) -> int:
        """Where new KV displaces the least: the most free blocks, else the oldest least recently
        used block, else the least load."""
        def displaced(i: int) -> tuple[int, int, int, int]:
            tree = self.trees[i]
            oldest = tree[next(iter(tree))] if len(tree) >= self.capacity[i] else -1
            return len(tree) - self.capacity[i], oldest, self.load[i], i
        return min(candidates, key=displaced)

    def _imbalanced(self, best: int, idle: int) -> bool:
        hi, lo = self.load[best], self.load[idle]
        return hi - lo > self.balance_abs and hi > self.balance_rel * lo

    def _remember(self, replica: int, hashes: list[int]) -> None:
        tree, now = self.trees[replica], next(self._clock)
        for h in reversed(hashes):  # the head last: the most recent, evicted after the tail
            tree[h] = now
            tree.move_to_end(h)
        self._trim(replica)

    def _trim(self, replica: int) -> None:
        tree = self.trees[replica]
        while len(tree) > self.capacity[replica]:
            tree.popitem(last=False)

    def mark_down(self, replica: int) -> None:
        super().mark_down(replica)
        self.trees[replica].clear()  # a restarted replica's cache starts empty


def make_router(name: str, num_replicas: int, block_size: int = 16) -> Router:
    if name == "prefix-aware":
        return PrefixAware(num_replicas, block_size)
    if name == "least-load":
        return LeastLoad(num_replicas)
    if name == "round-robin":
        return RoundRobin(num_replicas)
    raise ValueError(f"router={name!r} must be one of {list(ROUTERS)}")
