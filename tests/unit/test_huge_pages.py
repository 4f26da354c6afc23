"""Huge-page buffers: zeroed like torch.zeros whether or not Linux grants the advice."""

from __future__ import annotations

import torch

from kvserve.model import huge_pages


def test_zeros_are_zero_with_the_requested_shape_and_dtype():
    t = huge_pages.zeros(2, 3, 1 << 20, dtype=torch.bfloat16, device=torch.device("cpu"))
    assert t.shape == (2, 3, 1 << 20) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert not t.any()


def test_advice_covers_only_whole_huge_pages():
    small = torch.empty(4096, dtype=torch.uint8)  # no 2 MiB-aligned page inside
    assert huge_pages.advise_huge_pages(small) is False
