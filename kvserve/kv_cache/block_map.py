"""A picture of the KV pool for the live dashboard: one small code per block."""

from __future__ import annotations

from dataclasses import dataclass

FREE = 0  # holds nothing
CACHED = 1  # unused, but still holds KV a later request with the same prefix can reuse
SHARED = 2  # owned by several requests at once (a prefix-cache hit or an n > 1 fork)
OWNED = 3  # OWNED + i: owned by request_ids[i] alone


@dataclass(frozen=True)
class BlockMap:
    """``cells[b]`` is block b's code; ``request_ids`` names the owners of the OWNED + i codes."""

    cells: bytes  # one byte per block; owners past 252 requests share the last code
    request_ids: tuple[str, ...]

    @property
    def counts(self) -> dict[str, int]:
        free = self.cells.count(FREE)
        cached = self.cells.count(CACHED)
        return {"free": free, "cached": cached, "in_use": len(self.cells) - free - cached}
