"""frozen_heap: start-up objects are out of the collector's reach while a generation runs, and
everything is collectable again afterwards (no leak), without undoing somebody else's freeze.
collection_paused: no collection during start-up, collection as before after it."""

from __future__ import annotations

import gc
import weakref

import pytest

from kvserve.runtime.heap import collection_paused, frozen_heap


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


@pytest.mark.parametrize("block", [frozen_heap, collection_paused])
def test_an_earlier_freeze_is_left_alone(monkeypatch, block):
    # The calls are watched rather than the freeze count: the count also drops whenever a frozen
    # object is freed, which a thread left running by an earlier test in the suite can do meanwhile.
    calls = []
    gc.freeze()
    try:
        monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze"))
        monkeypatch.setattr(gc, "unfreeze", lambda: calls.append("unfreeze"))
        with block():
            pass
    finally:
        monkeypatch.undo()
        gc.unfreeze()
    assert calls == [] and gc.isenabled()


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


def test_collection_is_off_while_paused_and_on_again_after():
    assert gc.isenabled()
    with collection_paused():
        assert not gc.isenabled()
        made = _garbage_cycle()
    assert gc.isenabled()
    gc.collect()
    assert made() is None  # a cycle made while paused is collected afterwards


def test_what_a_pause_made_goes_to_the_oldest_generation():
    """So the first young collection after a pause does not walk all of it once more."""
    with collection_paused():
        made = _Node()
    assert gc.get_freeze_count() == 0
    assert any(o is made for o in gc.get_objects(generation=2))


def test_a_collector_switched_off_by_someone_else_stays_off():
    gc.disable()
    try:
        with collection_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_importing_kvserve_runs_no_full_collection():
    """``import kvserve`` (torch, transformers) leaves collection on, having paused it meanwhile."""
    import subprocess
    import sys

    code = ("import gc, sys; full = lambda: gc.get_stats()[2]['collections']; before = full(); "
            "import kvserve; print(gc.isenabled(), full() - before, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "0", "True"]
