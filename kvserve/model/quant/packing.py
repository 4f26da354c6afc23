"""Round-to-nearest quantization and the packed layouts, in plain PyTorch.

A quantized weight is (values, scales, zeros) with ``w[n, k] = q[n, k] * scale[n, k // group] +
zero[n, k // group]``; scales and zeros are float16, one per ``group`` inputs of a row (per output
channel when ``group == K``). ``zeros`` is None for symmetric int8.

int4 values (0..15) are packed two per byte in 32-value chunks: byte ``16c + j`` of a row holds value
``32c + j`` in its low nibble and ``32c + 16 + j`` in its high nibble (llama.cpp's Q4_0 order, so GGUF
Q4 blocks copy straight in). The C++ kernels (csrc/quant_linear.cpp) read exactly this layout; the
functions here are their reference and the fallback where the kernels cannot be built.
"""

from __future__ import annotations

import torch

_FP16_TINY = 2.0**-24  # smallest positive float16: a scale never rounds to 0


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[N, K] uint8 values in 0..15 -> [N, K / 2] uint8 (K a multiple of 32)."""
    n, k = q.shape
    if k % 32:
        raise ValueError(f"int4 packing needs K a multiple of 32, got K={k}")
    chunks = q.to(torch.uint8).reshape(n, k // 32, 2, 16)
    return (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).reshape(n, k // 2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[N, K / 2] uint8 -> [N, K] uint8 values in 0..15 (inverse of ``pack_int4``)."""
    n, half = packed.shape
    chunks = packed.reshape(n, half // 16, 1, 16)
    return torch.cat((chunks & 15, chunks >> 4), dim=2).reshape(n, half * 2)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
               dtype: torch.dtype) -> torch.Tensor:
    """The dense [N, K] weight in ``dtype`` (computed in float32)."""
    q = unpack_int4(qweight) if bits == 4 else qweight
    n, k = q.shape
    group = k // scales.shape[1]
    w = q.float().reshape(n, -1, group) * scales.float()[:, :, None]
    if zeros is not None:
        w = w + zeros.float()[:, :, None]
    return w.reshape(n, k).to(dtype)


def _grouped(w: torch.Tensor, group: int) -> torch.Tensor:
    n, k = w.shape
    if k % group:
        raise ValueError(f"group size {group} does not divide the {k} inputs of this weight")
    return w.float().reshape(n, k // group, group)


def quantize_int8(w: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric round-to-nearest int8 (-127..127): one scale per ``group`` inputs, or per row if None."""
    g = _grouped(w, group or w.shape[1])
    scales = (g.abs().amax(dim=-1) / 127).clamp(min=_FP16_TINY).half()
    q = torch.round(g / scales.float()[:, :, None]).clamp(-127, 127).to(torch.int8)
    return q.reshape(w.shape), scales


def quantize_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric round-to-nearest int4 (0..15) with a scale and a zero point (the group's minimum)."""
    g = _grouped(w, group)
    low, high = g.amin(dim=-1), g.amax(dim=-1)
    scales = ((high - low) / 15).clamp(min=_FP16_TINY).half()
    zeros = low.half()
    q = torch.round((g - zeros.float()[:, :, None]) / scales.float()[:, :, None]).clamp(0, 15).to(torch.uint8)
    return pack_int4(q.reshape(w.shape)), scales, zeros
