"""frozen_heap: start-up objects are out of the collector's reach while a generation runs, and
everything is collectable again afterwards (no leak), without undoing somebody else's freeze."""

from __future__ import annotations

import gc
import weakref

import pytest

from kvserve.runtime.heap import frozen_heap


class _Node:
    pass


def _garbage_cycle() -> weakref.ref:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


@pytest.fixture(autouse=True)
def _unfrozen():
    gc.collect()
    assert gc.get_freeze_count() == 0
    yield
    gc.unfreeze()


def test_objects_from_before_are_frozen_during_the_block_and_collectable_after():
    before = _garbage_cycle()
    with frozen_heap():
        assert gc.get_freeze_count() > 0
        gc.collect()
        assert before() is not None  # frozen: a full collection does not look at it
        during = _garbage_cycle()
        gc.collect()
        assert during() is None  # what the block itself makes is collected as usual
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert before() is None


def test_an_earlier_freeze_is_left_alone(monkeypatch):
    # The calls are watched rather than the freeze count: the count also drops whenever a frozen
    # object is freed, which a thread left running by an earlier test in the suite can do meanwhile.
    calls = []
    gc.freeze()
    try:
        monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze"))
        monkeypatch.setattr(gc, "unfreeze", lambda: calls.append("unfreeze"))
        with frozen_heap():
            pass
    finally:
        monkeypatch.undo()
        gc.unfreeze()
    assert calls == []


def test_generate_unfreezes_even_when_it_fails(tiny_llama):
    from kvserve import LLM, SamplingParams

    llm = LLM(model=str(tiny_llama), dtype="float32", num_kv_blocks=32, block_size=8)
    seen = []
    step = llm.engine.step

    def failing_step(**kwargs):
        seen.append(gc.get_freeze_count())
        if len(seen) == 2:
            raise RuntimeError("boom")
        return step(**kwargs)

    llm.engine.step = failing_step
    with pytest.raises(RuntimeError, match="boom"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert seen[0] > 0 and gc.get_freeze_count() == 0
