"""MXFP4 (OCP microscaling FP4), the format of gpt-oss checkpoints' expert weights, dequantized at load.

A block is 32 values along a row's inputs: 16 bytes of FP4 E2M1 codes, two per byte (the low nibble
holds the even element, the high nibble the odd one), and one E8M0 byte shared by the block, the
power of two 2 ** (byte - 127) that scales all 32. The checkpoint stores ``*_blocks`` [..., rows,
G, 16] uint8 and ``*_scales`` [..., rows, G] uint8 for a matrix of [..., rows, 32 * G].
"""

from __future__ import annotations

import torch

BLOCK = 32  # values per shared scale
# FP4 E2M1 by its 4-bit code: a sign bit, two exponent bits (bias 1) and one mantissa bit
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_SCALE_BIAS = 127


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., rows, G * 32] values of ``dtype`` from ``blocks`` [..., rows, G, 16] and ``scales``
    [..., rows, G] (see the module doc). Raises ValueError if the shapes do not pair up."""
    if blocks.shape[-1] != BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair up: "
                         f"need blocks [..., G, {BLOCK // 2}] with scales [..., G]")
    codes = blocks.to(torch.uint8)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    # [..., G, 16, 2]: each byte's low nibble, then its high nibble
    values = table[torch.stack((codes & 0x0F, codes >> 4), dim=-1).long()].flatten(-2)
    exponents = scales.to(torch.int32) - _SCALE_BIAS
    # exact in float32, and bf16 holds an E2M1 value times any power of two within its range
    out = torch.ldexp(values, exponents[..., None].to(torch.float32))
    return out.flatten(-2).to(dtype)
