"""Keep a step's large CPU tensors in the heap for reuse instead of fresh memory maps (glibc).

glibc serves an allocation above its mmap threshold (adjusted at run time, at most 32 MiB) with a
fresh ``mmap`` and unmaps it on free, so a tensor that size made every step touches new pages and
takes a page fault per 4 KiB. Sampling's float32 [rows, vocabulary] tensors at 256 rows of a 49K
vocabulary are 50 MB, and converting into fresh pages took several times as long as into reused
ones (main thread and worker thread alike). Raising the
mmap threshold (and the trim threshold that would hand the memory back to the OS) keeps blocks up
to ``MMAP_THRESHOLD`` in the heap. The cost: a process keeps up to ``TRIM_THRESHOLD`` of freed
memory instead of returning it. Another thread's arena still maps anything over 64 MiB afresh.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from functools import cache

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 256 << 20  # above float32 logits for 256 rows of a 152K vocabulary (155 MB)
TRIM_THRESHOLD = 512 << 20


@cache
def keep_freed_memory() -> bool:
    """Apply the thresholds once per process; False where the C library is not glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    if not hasattr(libc, "gnu_get_libc_version"):  # musl and others: not glibc's malloc
        return False
    ok = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not ok:
        log.warning("kvserve: glibc refused the mmap/trim thresholds; large step tensors stay memory-mapped")
    return ok
