"""The decoder's elementwise steps (RMSNorm with the residual add, rotary embedding, SiLU * up):
one compiled call each on the CPU (csrc/elementwise.cpp), plain PyTorch elsewhere.

Both paths have the same semantics, including the in-place updates (the residual stream, and q/k
for rotary), so the model code does not care which one runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.model.cpu_kernels import load_kernels

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# The compiled kernels, or None where they cannot be built (a cached call: several per layer and step).
load_elementwise_kernels = load_kernels


def _kernels_for(x: torch.Tensor):
    if x.device.type != "cpu" or x.dtype not in _KERNEL_DTYPES:
        return None
    return load_elementwise_kernels()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """weight * x / rms(x) over the last dimension, computed in float32 and rounded to x's dtype
    before the weight is applied (as Hugging Face does). With ``residual`` ([rows, dim]): first
    ``residual += x`` in place, then normalise the updated residual."""
    kernels = _kernels_for(x)
    if kernels is not None and weight.dtype == x.dtype:
        return kernels.rms_norm(x, residual, weight, eps)
    if residual is not None:
        x = residual.add_(x)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def apply_rotary_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> None:
    """Rotate-half RoPE of q [T, Hq, D] and k [T, Hkv, D] in place; cos/sin: float32 [max_pos, D/2]."""
    kernels = _kernels_for(q)
    if kernels is not None:
        kernels.rotary_(q, k, positions, cos, sin)
        return
    c = cos[positions].to(q.dtype)[:, None, :]
    s = sin[positions].to(q.dtype)[:, None, :]
    for x in (q, k):
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        x.copy_(torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1))


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """SiLU(x[..., :n]) * x[..., n:] for the fused gate/up projection's output [..., 2n]."""
    kernels = _kernels_for(x)
    if kernels is not None:
        return kernels.silu_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
