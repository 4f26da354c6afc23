"""Linear layers. Weights are created uninitialised: the loader fills every one of them."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Linear(torch.nn.Module):
    """y = x W^T (+ b). ``shards`` names the checkpoint tensors stacked into this weight, if any."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 shards: dict[str, tuple[int, int]] | None = None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = torch.nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        # shard name -> (row offset, rows) inside this fused weight, e.g. {"q_proj": (0, 576), ...}
        self.shards = shards or {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)
