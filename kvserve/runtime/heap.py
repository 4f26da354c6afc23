"""Keep Python's cyclic garbage collector off the objects that were alive before a generation began,
and off start-up altogether.

A full collection walks every tracked object: in a process that has loaded torch, transformers and
a model that is ~300K objects and a stall of every request in the batch; a long batch triggers a
few, and on a GPU, where steps are short, they are a far larger share. ``frozen_heap`` moves what exists
at the start into the permanent generation for the duration and back afterwards (both O(1) in
CPython), so the collections in between only look at objects the generation itself made, and
nothing stays uncollectable after it.

Start-up (importing torch and transformers, loading a model) allocates about a million objects that
live as long as the process. The collections they trigger, five of them full, only walk them: on two
cores that was ~0.9 s of a server's start. ``collection_paused`` turns collection off meanwhile.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Freeze the heap while the block runs, unless collection is off or someone else froze it
    (``kvserve serve`` freezes for good once its model is loaded): unfreezing would undo theirs."""
    if not gc.isenabled() or gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextmanager
def collection_paused() -> Iterator[None]:
    """Cyclic garbage collection off while the block runs, then on again if it was (start-up: see the
    module doc). What the block made goes straight to the oldest generation (a freeze and unfreeze,
    unless someone else's freeze would be undone): otherwise the first young collection after it
    walks all of it once more (0.18 s after ``import kvserve``). A cycle made meanwhile is collected
    by the next full collection."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        if not gc.get_freeze_count():
            gc.freeze()
            gc.unfreeze()
        gc.enable()
