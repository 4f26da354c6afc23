"""Large, long-lived CPU buffers on 2 MiB pages (Linux transparent huge pages, on request).

The weight arena and the KV cache are hundreds of MB that every step walks through: on 4 KiB pages
that walk pays a TLB miss every few KB and the hardware prefetchers stop at every page boundary.
"""

from __future__ import annotations

import ctypes

import torch

_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


def advise_huge_pages(buffer: torch.Tensor) -> bool:
    """Ask Linux to back the 2 MiB-aligned part of ``buffer`` with huge pages; False where it cannot.

    Only pages not yet touched are affected, so call it before the buffer is first written."""
    start = buffer.data_ptr()
    nbytes = buffer.numel() * buffer.element_size()
    first = -(-start // _HUGE_PAGE) * _HUGE_PAGE
    length = (start + nbytes - first) // _HUGE_PAGE * _HUGE_PAGE
    if length <= 0 or buffer.device.type != "cpu":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(length), _MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):  # not Linux / no madvise
        return False


def zeros(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros, on huge pages where the device is the CPU and Linux allows."""
    out = torch.empty(*shape, dtype=dtype, device=device)
    advise_huge_pages(out)
    return out.zero_()
