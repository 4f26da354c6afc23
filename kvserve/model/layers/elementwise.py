"""The decoder's elementwise steps (RMSNorm with the residual add, rotary embedding, SiLU * up):
one compiled call each on the CPU (csrc/elementwise.cpp), one Triton kernel each on CUDA
(triton_elementwise.py), plain PyTorch elsewhere (the ``*_reference`` functions).

Every path has the same semantics, including the in-place updates (the residual stream, and q/k
for rotary), so the model code does not care which one runs.
"""

from __future__ import annotations

import functools

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


@functools.cache
def _load_triton_kernels():
    try:
        from kvserve.model.layers import triton_elementwise
    except ImportError:  # no triton: the PyTorch path
        return None
    return triton_elementwise


def _triton_for(*tensors: torch.Tensor):
    """The Triton kernels for CUDA tensors of a model dtype whose last dimension is contiguous, or None."""
    x = tensors[0]
    if x.device.type != "cuda" or x.dtype not in _KERNEL_DTYPES or any(t.stride(-1) != 1 for t in tensors):
        return None
    return _load_triton_kernels()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """weight * x / rms(x) over the last dimension, computed in float32 and rounded to x's dtype
    before the weight is applied (as Hugging Face does). With ``residual`` ([rows, dim]): first
    ``residual += x`` in place, then normalise the updated residual."""
    kernels = _kernels_for(x)
    if kernels is not None and weight.dtype == x.dtype:
        return kernels.rms_norm(x, residual, weight, eps)
    triton_kernels = _triton_for(x, weight, *(() if residual is None else (residual,)))
    if triton_kernels is not None and weight.dtype == x.dtype and x.dim() in (2, 3) and \
            (residual is None or (x.dim() == 2 and residual.shape == x.shape)):
        return triton_kernels.rms_norm(x, weight, eps, residual)
    return rms_norm_reference(x, weight, eps, residual)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None) -> torch.Tensor:
    """``rms_norm`` in PyTorch ops."""
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
    triton_kernels = _triton_for(q, k, cos, sin)
    if triton_kernels is not None:
        triton_kernels.apply_rotary_(positions, q, k, cos, sin)
        return
    apply_rotary_reference_(positions, q, k, cos, sin)


def apply_rotary_reference_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                            sin: torch.Tensor) -> None:
    """``apply_rotary_`` in PyTorch ops."""
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
    triton_kernels = _triton_for(x)
    if triton_kernels is not None and x.dim() == 2:
        return triton_kernels.silu_mul(x)
    return silu_mul_reference(x)


def silu_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """``silu_mul`` in PyTorch ops."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
