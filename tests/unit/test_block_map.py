"""The dashboard's KV block map, and the engine's split of computed tokens into prefill, decode and spec."""

from __future__ import annotations

import base64

from kvserve import LLM, SamplingParams
from kvserve.entrypoints.web.sampler import Sampler
from kvserve.kv_cache.block_map import CACHED, FREE, OWNED, SHARED
from kvserve.kv_cache.manager import KVCacheManager
from kvserve.metrics.totals import Totals
from kvserve.request import Request


def test_block_map_codes_free_cached_shared_and_owned_blocks():
    kv = KVCacheManager(num_blocks=12, block_size=4)
    a = Request("a", list(range(10)), SamplingParams(max_tokens=8))
    assert kv.allocate_slots("a", 10)  # 3 blocks, the first two full
    a.num_computed_tokens = 10
    kv.commit_computed(a)
    b = Request("b", list(range(8)) + [99], SamplingParams(max_tokens=8))
    hits = kv.match_prefix(b)
    assert kv.allocate_slots("b", 9, hits)  # shares a's two full blocks, one of its own
    m = kv.block_map()
    assert m.request_ids == ("a", "b") and len(m.cells) == 12
    ta, tb = kv.block_table("a"), kv.block_table("b")
    assert [m.cells[x] for x in ta] == [SHARED, SHARED, OWNED]
    assert m.cells[tb[2]] == OWNED + 1
    assert m.counts == {"free": 8, "cached": 0, "in_use": 4}
    kv.forget("a"), kv.forget("b")
    m = kv.block_map()
    assert m.request_ids == () and m.counts == {"free": 10, "cached": 2, "in_use": 0}
    assert [m.cells[x] for x in ta[:2]] == [CACHED, CACHED] and m.cells.count(FREE) == 10


class _Client:
    """What the sampler reads of AsyncEngineClient, over an LLM's engine."""

    def __init__(self, llm: LLM, with_map: bool) -> None:
        self.core, self.with_map, self.info = llm.engine.core, with_map, object()

    @property
    def snapshot(self):
        return self.core.stats(with_block_map=self.with_map)

    @property
    def num_waiting(self) -> int:
        return self.snapshot.num_waiting


def test_step_split_adds_up_and_the_sampler_reports_it(tiny_llama):
    llm = LLM(model=str(tiny_llama), num_kv_blocks=64, block_size=8, max_model_len=256,
              max_num_batched_tokens=16)  # a 40-token prompt prefills in chunks
    sampler = Sampler(_Client(llm, with_map=True), Totals())
    llm.generate([list(range(1, 41)), list(range(2, 12))], SamplingParams(max_tokens=6, ignore_eos=True))
    s = llm.engine.core.stats()
    assert s.num_prefill_tokens == 50 and s.num_decode_tokens == 2 * 5 and s.num_spec_tokens == 0
    assert s.num_prefill_tokens + s.num_decode_tokens + s.num_spec_tokens == s.num_batched_tokens
    sample = sampler.next()
    steps = sample["steps_per_s"] * sample["interval_s"]
    assert round(steps) == s.num_steps
    split = sample["step_tokens"]
    assert abs(split["prefill"] * steps - 50) < 1e-6 and abs(split["decode"] * steps - 10) < 1e-6
    cells = base64.b64decode(sample["block_map"]["cells"])
    assert len(cells) == 64 and sample["block_map"]["in_use"] == 0 and sample["block_map"]["owners"] == 0
