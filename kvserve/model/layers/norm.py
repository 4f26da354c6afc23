"""RMSNorm, computed in float32 like the reference implementations, then cast back."""

from __future__ import annotations

import torch

from kvserve.model.layers.elementwise import rms_norm


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """Normalised x; with ``residual``, adds x into it in place first and normalises the sum."""
        return rms_norm(x, self.weight, self.eps, residual)
