"""Zeroed CPU memory that costs nothing up front.

The KV cache is the largest allocation a server makes (1 GiB by default). ``torch.zeros`` writes
every byte of it before the first request: 0.45 s of every start on two cores. Fresh anonymous
memory from ``mmap`` is zero already: the kernel supplies each page zeroed when it is first
touched, so the cost moves to the first write of each 4 KiB page, spread over serving (a decode
step of 32 requests touches a few hundred new pages at most), and only the part of the cache that
requests use becomes resident. Because nothing is committed up front, ``check_fits`` refuses at
start-up a cache larger than the memory the machine has free, which would otherwise fail only
later, under load.
"""

from __future__ import annotations

import math
import mmap
import os
from pathlib import Path

import torch


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor; on the CPU, over fresh private anonymous pages that stay zero until written,
    instead of memory filled with zeros now. Elsewhere, ``torch.zeros``.

    No huge pages here: a first write into a 2 MiB page stalls the step that makes it, and decode
    attention over the cache runs no faster with them."""
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes < mmap.PAGESIZE or not hasattr(mmap, "MAP_ANONYMOUS"):  # Windows: no flags
        return torch.zeros(shape, dtype=dtype, device=device)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # The tensor holds ``pages`` open (and mapped) for as long as it or a view of it lives.
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)


def available_bytes() -> int | None:
    """Memory the OS could give this process now (Linux: MemAvailable); None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_fits(nbytes: int, what: str, hint: str) -> None:
    """ValueError naming ``what`` if ``nbytes`` exceeds the memory available now."""
    available = available_bytes()
    if available is not None and nbytes > available:
        raise ValueError(f"{what} needs {nbytes / 2**30:.2f} GiB but only {available / 2**30:.2f} GiB of memory is "
                         f"available; {hint}")
