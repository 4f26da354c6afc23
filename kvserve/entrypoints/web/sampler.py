"""What the live dashboard plots: the engine's published snapshot and the running totals, looked at
every interval and turned into that interval's rates and means.

The sampler runs on the event loop and only reads what the engine thread publishes anyway; the one
cost it puts on the engine is the KV block map, built at most every BLOCK_MAP_PERIOD_S while
``AsyncEngineClient.watchers`` is non-zero.
"""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass

from kvserve.engine.stats import EngineSnapshot
from kvserve.frontend.client import AsyncEngineClient
from kvserve.metrics.totals import Totals

MIN_INTERVAL_S = 0.25  # at most four samples a second, whatever the page asks for
MAX_INTERVAL_S = 10.0


@dataclass(frozen=True)
class _Look:
    at: float
    snapshot: EngineSnapshot
    prompt_tokens: int
    generation_tokens: int
    finished: int
    ttft: tuple[int, float]  # count, sum
    itl: tuple[int, float]


def _look(client: AsyncEngineClient, totals: Totals) -> _Look:
    return _Look(time.perf_counter(), client.snapshot, totals.prompt_tokens, totals.generation_tokens,
                 totals.finished, (totals.ttft_count, totals.ttft_sum), (totals.itl_count, totals.itl_sum))


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


class Sampler:
    """Successive samples for one dashboard: ``next()`` gives a JSON-able dict about the time since
    the previous call (the first one covers the time since the sampler was made)."""

    def __init__(self, client: AsyncEngineClient, totals: Totals) -> None:
        self.client = client
        self.totals = totals
        self._last = _look(client, totals)

    def next(self) -> dict:
        now, was = _look(self.client, self.totals), self._last
        self._last = now
        s, p = now.snapshot, was.snapshot
        dt = max(now.at - was.at, 1e-9)
        steps = s.num_steps - p.num_steps
        prefill, decode, spec = (s.num_prefill_tokens - p.num_prefill_tokens, s.num_decode_tokens - p.num_decode_tokens,
                                 s.num_spec_tokens - p.num_spec_tokens)
        info = self.client.info
        sample = {
            "time": time.time(),
            "interval_s": dt,
            "ready": info is not None,
            "running": s.num_running,
            "waiting": self.client.num_waiting,
            "kv_usage": s.kv_cache_usage,
            "preemptions": s.num_preemptions,
            "finished": now.finished - was.finished,
            "generation_tokens_per_s": (now.generation_tokens - was.generation_tokens) / dt,
            "prompt_tokens_per_s": (now.prompt_tokens - was.prompt_tokens) / dt,
            "steps_per_s": steps / dt,
            # each step's tokens on average over the interval, split three ways
            "step_tokens": {"prefill": _ratio(prefill, steps) or 0.0, "decode": _ratio(decode, steps) or 0.0,
                            "spec": _ratio(spec, steps) or 0.0},
            "ttft_s": _ratio(now.ttft[1] - was.ttft[1], now.ttft[0] - was.ttft[0]),
            "itl_s": _ratio(now.itl[1] - was.itl[1], now.itl[0] - was.itl[0]),
            "prefix_hit_rate": _ratio(s.prefix_cache_hits - p.prefix_cache_hits,
                                      s.prefix_cache_queries - p.prefix_cache_queries),
            "prefix_hit_rate_total": _ratio(s.prefix_cache_hits, s.prefix_cache_queries),
            "spec_acceptance": _ratio(s.spec_accepted_tokens - p.spec_accepted_tokens,
                                      s.spec_proposed_tokens - p.spec_proposed_tokens),
            "spec_acceptance_total": _ratio(s.spec_accepted_tokens, s.spec_proposed_tokens),
            "block_map": None,
        }
        if s.block_map is not None:
            sample["block_map"] = {"cells": base64.b64encode(s.block_map.cells).decode("ascii"),
                                   "owners": len(s.block_map.request_ids), **s.block_map.counts}
        return sample
