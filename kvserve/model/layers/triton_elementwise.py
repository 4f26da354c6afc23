"""The decoder's elementwise steps on CUDA as Triton kernels, one launch each.

Written with PyTorch ops, RMSNorm with its residual add is nine kernels, rotary embedding about
twenty and SiLU * up three: a small decode step is then bound by launches (eagerly, by the host
issuing them; in a CUDA graph, by the GPU starting a thousand tiny kernels per token). Each kernel
here reproduces the PyTorch path's roundings (every op of the reference rounds to the model dtype
where PyTorch's does), so both paths give the same results up to float32 summation order.

The tests run these kernels on the CPU through Triton's interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm(x_ptr, res_ptr, w_ptr, out_ptr, x_stride_t, x_stride_h, res_stride, eps,
              HEADS: tl.constexpr, N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """One row (token row // HEADS, head row % HEADS of x): (residual += x), then
    out = w * round(s / rms(s)) with s the (updated) row; out is contiguous."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(x_ptr + (row // HEADS) * x_stride_t + (row % HEADS) * x_stride_h + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=ok, other=0.0)
        x = (r.to(tl.float32) + x.to(tl.float32)).to(x.dtype)
        tl.store(res_ptr + row * res_stride + cols, x, mask=ok)
    s = x.to(tl.float32)
    normed = (s * tl.rsqrt(tl.sum(s * s, 0) / N + eps)).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    tl.store(out_ptr + row * N + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(w.dtype), mask=ok)


@triton.jit
def _rotary(q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, q_stride_t, q_stride_h, k_stride_t, k_stride_h, cos_stride,
            Q_HEADS: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    """Token t, head h of q (h < Q_HEADS) or of k: [x1, x2] -> [x1 c - x2 s, x2 c + x1 s] in place."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    if h < Q_HEADS:
        base = q_ptr + t * q_stride_t + h * q_stride_h
    else:
        base = k_ptr + t * k_stride_t + (h - Q_HEADS) * k_stride_h
    cols = tl.arange(0, HALF_PAD)
    ok = cols < HALF
    pos = tl.load(pos_ptr + t)
    x1 = tl.load(base + cols, mask=ok, other=0.0)
    x2 = tl.load(base + HALF + cols, mask=ok, other=0.0)
    dtype = x1.dtype
    c = tl.load(cos_ptr + pos * cos_stride + cols, mask=ok, other=0.0).to(dtype).to(tl.float32)
    s = tl.load(sin_ptr + pos * cos_stride + cols, mask=ok, other=0.0).to(dtype).to(tl.float32)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    out1 = ((a * c).to(dtype).to(tl.float32) - (b * s).to(dtype).to(tl.float32)).to(dtype)
    out2 = ((b * c).to(dtype).to(tl.float32) + (a * s).to(dtype).to(tl.float32)).to(dtype)
    tl.store(base + cols, out1, mask=ok)
    tl.store(base + HALF + cols, out2, mask=ok)


@triton.jit
def _silu_mul(x_ptr, out_ptr, x_stride, out_stride, N: tl.constexpr, BLOCK: tl.constexpr):
    """Row t, columns [j, j + BLOCK): out = round(silu(gate)) * up with [gate | up] = x[t]."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    gate = tl.load(x_ptr + t * x_stride + cols, mask=ok, other=0.0)
    up = tl.load(x_ptr + t * x_stride + N + cols, mask=ok, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    tl.store(out_ptr + t * out_stride + cols, (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """``elementwise.rms_norm`` for x [T, N] or [T, H, N] (q/k norm over heads) with contiguous rows
    of N; ``residual`` [T, N] with x 2-D. Returns a new contiguous tensor."""
    heads = x.shape[1] if x.dim() == 3 else 1
    n = x.shape[-1]
    out = torch.empty(x.shape, dtype=weight.dtype, device=x.device)
    if out.numel():
        res = x if residual is None else residual
        _rms_norm[(x.shape[0] * heads,)](x, res, weight, out, x.stride(0), x.stride(1) if heads > 1 else 0,
                                        res.stride(0), eps, HEADS=heads, N=n, BLOCK=triton.next_power_of_2(n),
                                        HAS_RESIDUAL=residual is not None)
    return out


def apply_rotary_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> None:
    """``elementwise.apply_rotary_`` for q [T, Hq, D], k [T, Hkv, D] with contiguous heads."""
    tokens, q_heads, dim = q.shape
    if tokens:
        half = dim // 2
        _rotary[(tokens, q_heads + k.shape[1])](q, k, positions, cos, sin, q.stride(0), q.stride(1), k.stride(0),
                                                k.stride(1), cos.stride(0), Q_HEADS=q_heads, HALF=half,
                                                HALF_PAD=triton.next_power_of_2(half))


_SILU_BLOCK = 1024


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """``elementwise.silu_mul`` for 2-D x with contiguous rows."""
    rows, n = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows:
        block = min(_SILU_BLOCK, triton.next_power_of_2(n))
        _silu_mul[(rows, triton.cdiv(n, block))](x, out, x.stride(0), out.stride(0), N=n, BLOCK=block)
    return out
