"""The step's block tables kept from step to step equal tables padded by hand, whatever happens to the
requests between steps: tables that grow, requests that leave and come back, a request that starts
over with a new table of the same length, more rows or wider tables than the array holds."""

from __future__ import annotations

import random

import numpy as np

from kvserve.worker.block_tables import BlockTableRows


def _padded(tables: list[list[int]], width: int) -> np.ndarray:
    return np.array([t + [0] * (width - len(t)) for t in tables], dtype=np.int64).reshape(len(tables), width)


def test_rows_equal_hand_padded_tables_through_random_steps():
    rng = random.Random(0)
    rows = BlockTableRows(rows=4, width=3)  # small, so the array must grow both ways
    tables: dict[str, list[int]] = {}
    for _ in range(400):
        for rid in list(tables):
            roll = rng.random()
            if roll < 0.05:
                del tables[rid]  # finished
            elif roll < 0.1:
                tables[rid] = [rng.randrange(1000) for _ in range(len(tables[rid]))]  # preempted, readmitted
            elif roll < 0.4:
                tables[rid].extend(rng.randrange(1000) for _ in range(rng.choice([1, 1, 3])))  # in place
        while len(tables) < rng.randrange(1, 12):
            tables[f"r{rng.randrange(10**6)}"] = [rng.randrange(1000) for _ in range(rng.randrange(0, 6))]
        batch = [rid for rid in tables if rng.random() < 0.8]  # some sit a step out
        if not batch:
            continue
        width = max(len(tables[rid]) for rid in batch) + rng.choice([0, 0, 2])
        got = rows.gather(batch, [tables[rid] for rid in batch], width)
        assert np.array_equal(got, _padded([tables[rid] for rid in batch], width))


def test_gathered_array_is_a_copy():
    rows = BlockTableRows()
    table = [4, 5]
    first = rows.gather(["a"], [table], 2)
    table.append(6)
    second = rows.gather(["a"], [table], 3)
    assert first.tolist() == [[4, 5]] and second.tolist() == [[4, 5, 6]]
