"""Quantized KV cache formats: int8 or fp8 (float8_e4m3) values with one float16 scale per token and head.

Layout, per layer: one uint8 tensor ``[2, num_blocks, block_size, num_kv_heads, head_dim + 2]``: each
(token, head) row holds ``head_dim`` one-byte values followed by its float16 scale, so the scales
live beside the values in the same block (block copies and prefix sharing move both at once) and
the decode kernel reads a row and its scale from the same cache line.

    int8: scale = max|x| / 127, q = round(x / scale)          (x ~= q * scale)
    fp8:  scale = max|x| / 448, q = float8_e4m3(x / scale)    (448 is e4m3's largest value)

Attention always reads what the cache holds: the prefill path attends to the dequantized values of
its own chunk too, so a prompt scores the same whether it is prefilled in one chunk, in several,
recomputed after preemption, or verified as speculative tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.runtime.host_memory import zeroed

SCALE_BYTES = 2  # float16
_MAX = {"int8": 127.0, "fp8": 448.0}
_TINY = 2.0**-24  # a scale never rounds to 0 in float16


@dataclass(frozen=True)
class KVQuantFormat:
    """One of the quantized cache formats ("int8" or "fp8"); "auto" caches are plain float tensors."""

    name: str

    def __post_init__(self) -> None:
        if self.name not in _MAX:
            raise ValueError(f"kv_cache_dtype={self.name!r} has no quantized format; choose 'int8' or 'fp8'")

    def allocate(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 device: torch.device) -> torch.Tensor:
        # Zeroed: a zero row with a zero scale dequantizes to 0, never NaN (see TorchAttentionBackend).
        return zeroed((2, num_blocks, block_size, num_kv_heads, head_dim + SCALE_BYTES), torch.uint8, device)

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] float -> packed rows [..., D + 2] uint8 (values, then the float16 scale)."""
        x32 = x.float()
        scale = (x32.abs().amax(dim=-1, keepdim=True) / _MAX[self.name]).clamp(min=_TINY).half()
        scaled = x32 / scale.float()
        if self.name == "int8":
            values = scaled.round().clamp(-127, 127).to(torch.int8).view(torch.uint8)
        else:
            values = scaled.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
        return torch.cat((values, scale.view(torch.uint8)), dim=-1)

    def dequantize(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """packed rows [..., D + 2] uint8 -> [..., D] in ``dtype``."""
        head_dim = rows.shape[-1] - SCALE_BYTES
        raw = rows[..., :head_dim]
        values = raw.view(torch.int8) if self.name == "int8" else raw.view(torch.float8_e4m3fn)
        scale = rows[..., head_dim:].contiguous().view(torch.float16)
        return (values.float() * scale.float()).to(dtype)


def kv_quant_format(kv_cache_dtype: str) -> KVQuantFormat | None:
    """The format for a ``kv_cache_dtype`` option: None for "auto" (the model dtype)."""
    return None if kv_cache_dtype == "auto" else KVQuantFormat(kv_cache_dtype)
