"""Move every Linear's weight tensors into one contiguous, huge-page-backed block of memory (CPU).

Decode reads all the weights once per step, layer by layer. Allocated one by one, they are scattered
over 4 KiB pages: the walk over ~100 separate tensors pays TLB misses and restarts the hardware
prefetcher at every one. Laid out back to back in forward order in one buffer that the kernel backs
with 2 MiB pages (``madvise(MADV_HUGEPAGE)``), they stream like one big array, as a memory-mapped
GGUF does for llama.cpp: a single-stream decode step's linears run markedly faster, and the output
head about twice as fast.
"""

from __future__ import annotations

import ctypes
import logging

import torch

log = logging.getLogger(__name__)

_ALIGN = 64  # bytes: every tensor starts on a cache line
_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


def _tensors(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.Tensor]]:
    """(module, attribute, tensor) for every Linear's weight tensors, in forward order, shared ones once."""
    from kvserve.model.layers.linear import Linear

    out, seen = [], set()
    for module in model.modules():
        if not isinstance(module, Linear):
            continue
        for name in module.method.weight_names():
            tensor = getattr(module, name, None)
            if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu" and id(tensor) not in seen:
                seen.add(id(tensor))
                out.append((module, name, tensor))
    return out


def huge_page_buffer(nbytes: int) -> tuple[torch.Tensor, bool]:
    """An untouched uint8 buffer of ``nbytes`` whose 2 MiB-aligned part Linux is asked to back with
    huge pages, and whether it agreed. The pages are faulted in as huge pages by the first writes,
    so the caller must not have touched them before."""
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    start = buffer.data_ptr()
    first = -(-start // _HUGE_PAGE) * _HUGE_PAGE
    length = (start + nbytes - first) // _HUGE_PAGE * _HUGE_PAGE
    if length <= 0:
        return buffer, False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return buffer, libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(length), _MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):  # not Linux / no madvise
        return buffer, False


def pack_linear_weights(model: torch.nn.Module) -> int:
    """Copy every Linear weight tensor into one arena and point the layers at views of it.

    Returns the arena's size in bytes (0 if there was nothing on the CPU to pack).
    """
    entries = _tensors(model)
    if not entries:
        return 0
    offsets, size = [], 0
    for _, _, tensor in entries:
        offsets.append(size)
        size += -(-tensor.numel() * tensor.element_size() // _ALIGN) * _ALIGN
    arena, huge = huge_page_buffer(size)
    for (module, name, tensor), offset in zip(entries, offsets):
        nbytes = tensor.numel() * tensor.element_size()
        view = arena[offset:offset + nbytes].view(tensor.dtype).view(tensor.shape)
        view.copy_(tensor)
        if isinstance(getattr(module, name), torch.nn.Parameter):
            getattr(module, name).data = view
        else:
            setattr(module, name, view)
    log.debug("packed %d weight tensors into %.1f MiB (huge pages: %s)", len(entries), size / 2**20, huge)
    return size
