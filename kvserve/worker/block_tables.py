"""A step's block tables as one int64 array, kept from step to step.

Building the [batch, width] table from every request's Python list each step cost time in the total
number of blocks, host time a GPU waits for. Here a request
keeps its row while it is scheduled step after step; a step writes only the blocks its requests
gained since their last step (a decode gains one every ``block_size`` tokens) and gathers the
batch's rows with one numpy index.

A row mirrors one table *object*. The KV-cache manager only appends to a request's table, and a
request that starts over (preempted, then readmitted) gets a new list, so "the same list, longer"
is an append and anything else a rewrite; no notice of finishes or preemptions is needed. A row
whose request is missing from a step is released (it is rewritten if the request comes back).
Entries past a table's length are 0, as in a table padded by hand.
"""

from __future__ import annotations

import numpy as np


class BlockTableRows:
    def __init__(self, rows: int = 64, width: int = 64) -> None:
        self._array = np.zeros((rows, width), dtype=np.int64)
        self._row_of: dict[str, int] = {}
        self._table_of: list[list[int] | None] = [None] * rows  # the list each row mirrors (held, so ids stay unique)
        self._len_of = [0] * rows  # entries written in each row; the rest are 0
        self._free = list(range(rows - 1, -1, -1))

    def gather(self, request_ids: list[str], tables: list[list[int]], width: int) -> np.ndarray:
        """A new [len(tables), width] array: row i is ``tables[i]`` padded with 0 (width >= every length)."""
        self._release_all_but(request_ids)
        rows = []
        for request_id, table in zip(request_ids, tables):
            row = self._row_of.get(request_id)
            if row is None:
                row = self._take(request_id)
            if self._table_of[row] is not table:
                self._write(row, table, 0)
            elif len(table) != self._len_of[row]:
                self._write(row, table, self._len_of[row])
            rows.append(row)
        self._fit_width(width)
        return self._array[rows, :width]

    def _write(self, row: int, table: list[int], start: int) -> None:
        """Write ``table[start:]`` into the row; a rewrite (start 0) also clears the previous table's tail."""
        self._fit_width(len(table))
        old = self._len_of[row]
        self._array[row, start:len(table)] = table[start:]
        if start == 0 and old > len(table):
            self._array[row, len(table):old] = 0
        self._table_of[row], self._len_of[row] = table, len(table)

    def _take(self, request_id: str) -> int:
        if not self._free:
            self._grow_rows()
        row = self._free.pop()
        self._row_of[request_id] = row
        return row

    def _release_all_but(self, request_ids: list[str]) -> None:
        keep = set(request_ids)
        for request_id in [r for r in self._row_of if r not in keep]:
            row = self._row_of.pop(request_id)
            self._table_of[row] = None  # its entries stay until the next occupant rewrites them
            self._free.append(row)

    def _grow_rows(self) -> None:
        rows, width = self._array.shape
        self._array = np.concatenate([self._array, np.zeros((rows, width), dtype=np.int64)])
        self._table_of += [None] * rows
        self._len_of += [0] * rows
        self._free.extend(range(2 * rows - 1, rows - 1, -1))

    def _fit_width(self, width: int) -> None:
        rows, have = self._array.shape
        if width > have:
            self._array = np.concatenate([self._array, np.zeros((rows, max(width, 2 * have) - have), dtype=np.int64)],
                                         axis=1)
