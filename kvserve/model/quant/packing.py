"""Round-to-nearest quantization and the packed layouts, in plain PyTorch.

A quantized weight is (values, scales, zeros) with ``w[n, k] = q[n, k] * scale[n, k // group] +
zero[n, k // group]``, one scale and zero per ``group`` inputs of a row (per output channel when
``group == K``); ``zeros`` is None for symmetric int8. Scales and zeros are stored either

  - as float16 (exact for GGUF blocks, 16 + 16 bits per group), or
  - *coded*: a uint8 scale code and an int8 zero code per group times a per-row float32 step
    (``factors`` [N, 2]): 8 + 8 bits per group, so int4 in groups of 32 costs 4.5 bits per weight
    instead of 5 (what takes the bundled model's int4 form under 0.3x its bf16 bytes).

int4 values (0..15) are packed two per byte in 32-value chunks: byte ``16c + j`` of a row holds value
``32c + j`` in its low nibble and ``32c + 16 + j`` in its high nibble (llama.cpp's Q4_0 order, so GGUF
Q4 blocks copy straight in). The C++ kernels (csrc/quant_linear.cpp) read exactly this layout; the
functions here are their reference and the fallback where the kernels cannot be built.

On CPUs with AVX512-VNNI and without AMX, and on AVX2, a loaded weight is repacked as
*strips* (``to_strips``): 16 output channels side by side, one per 32-bit lane, which the integer
kernels there read (AVX2 takes a strip as two halves of 8 channels).
"""

from __future__ import annotations

import torch

_FP16_TINY = 2.0**-24  # smallest positive float16: a scale never rounds to 0
_LOW_NIBBLES = 0x0F0F0F0F  # in each byte of a 32-bit word
_BYTE_SIGNS = -0x7F7F7F80  # 0x80808080 as an int32: flips each byte between int8 and w + 128


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


def to_strips(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, factors: torch.Tensor | None,
              bits: int):
    """A row-major weight -> the strips the few-row VNNI kernels read (csrc/quant_linear.cpp, "Strips"):
    16 output channels per strip, 32 inputs per chunk, a channel per 32-bit lane. N must be a multiple
    of 16 and K of 32. Returns (qweight [S, C, 256 or 512] uint8, scales and zeros [S, G, 16],
    factors [S, 2, 16])."""
    n = qweight.shape[0]
    strips = n // 16
    # Whole 32-bit words, 4 inputs of a row each: loading is ~4x faster than moving single bytes.
    words = qweight.contiguous().view(torch.int32)
    if bits == 4:
        # A row's 16-byte chunk is words W0..W3; W_i's bytes hold inputs 32c + 4i + byte (low nibble)
        # and 32c + 16 + 4i + byte (high). Strip word j holds inputs 32c + 8j + byte (low) and
        # 32c + 8j + 4 + byte (high): j = 0, 1 from the low nibbles of (W0, W1), (W2, W3), j = 2, 3
        # from their high nibbles.
        pairs = words.reshape(n, -1, 2, 2)  # [N, chunk, (W0 W1 | W2 W3), first or second word]
        first, second = pairs[..., 0], pairs[..., 1]
        low = (first & _LOW_NIBBLES) | ((second & _LOW_NIBBLES) << 4)
        high = ((first >> 4) & _LOW_NIBBLES) | (second & ~_LOW_NIBBLES)
        rows = torch.cat((low, high), dim=-1)  # [N, chunk, j]
    else:  # w + 128 as bytes: strip word j holds inputs 32c + 4j + byte
        rows = (words ^ _BYTE_SIGNS).reshape(n, -1, 8)
    chunks = rows.shape[1]
    q = rows.reshape(strips, 16, chunks, -1).permute(0, 2, 3, 1).contiguous()  # [S, chunk, j, lane]
    q = q.view(torch.uint8).reshape(strips, chunks, -1)

    def lanes(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.reshape(strips, 16, -1).transpose(1, 2).contiguous()

    return q, lanes(scales), lanes(zeros), lanes(factors)


def from_strips(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                factors: torch.Tensor | None, bits: int, rows: torch.Tensor | None = None):
    """The row-major (qweight, scales, zeros, factors) of a weight stored as strips (inverse of
    ``to_strips``): every row, or only ``rows`` (an embedding lookup)."""
    strips, chunks, _ = qweight.shape
    ids = torch.arange(strips * 16) if rows is None else rows.reshape(-1)
    s, lane = ids // 16, ids % 16
    if bits == 4:
        b = qweight.reshape(strips, chunks, 4, 16, 4)[s, :, :, lane]  # [R, chunk, j, byte]
        v = torch.stack((b & 15, b >> 4), dim=-1).transpose(-1, -2)  # [R, chunk, j, half, byte]
        q = pack_int4(v.reshape(len(ids), chunks * 32))
    else:
        b = qweight.reshape(strips, chunks, 8, 16, 4)[s, :, :, lane]  # [R, chunk, j, byte]
        q = (b.reshape(len(ids), chunks * 32).to(torch.int16) - 128).to(torch.int8)

    def rows_of(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[s, :, lane]

    return q, rows_of(scales), rows_of(zeros), rows_of(factors)


def dequantize_strip_rows(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                          factors: torch.Tensor | None, bits: int, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``rows`` of a weight stored as strips, dense in ``dtype`` (an embedding lookup): the
    values of ``dequantize(*from_strips(..., rows))``, in half as many tensor ops (one a token)."""
    strips, chunks, _ = qweight.shape
    s, lane = rows // 16, rows % 16
    if bits == 4:
        b = qweight.view(strips, chunks, 4, 16, 4)[s, :, :, lane]  # [R, chunk, j, byte]
        q = torch.stack((b & 15, b >> 4), dim=-2).float()  # [R, chunk, j, half, byte]
    else:
        q = qweight.view(strips, chunks, 8, 16, 4)[s, :, :, lane].float() - 128
    scale, zero = decode_params(scales[s, :, lane], None if zeros is None else zeros[s, :, lane],
                                None if factors is None else factors[s, :, lane])
    w = q.reshape(len(rows), scale.shape[1], -1) * scale[:, :, None]
    if zero is not None:
        w = w + zero[:, :, None]
    return w.reshape(len(rows), -1).to(dtype)


def decode_params(scales: torch.Tensor, zeros: torch.Tensor | None, factors: torch.Tensor | None):
    """Float32 (scales, zeros) from their stored form (float16, or codes with per-row ``factors``)."""
    if factors is None:
        return scales.float(), None if zeros is None else zeros.float()
    return (scales.float() * factors[:, :1], None if zeros is None else zeros.float() * factors[:, 1:])


def encode_params(scales: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float32 [N, G] scales (> 0) and zeros -> uint8 scale codes, int8 zero codes, factors [N, 2]."""
    step_s = (scales.amax(dim=-1) / 255).clamp(min=_FP16_TINY)
    step_z = (zeros.abs().amax(dim=-1) / 127).clamp(min=_FP16_TINY)
    scale_codes = torch.round(scales / step_s[:, None]).clamp(1, 255).to(torch.uint8)
    zero_codes = torch.round(zeros / step_z[:, None]).clamp(-127, 127).to(torch.int8)
    return scale_codes, zero_codes, torch.stack((step_s, step_z), dim=-1).float()


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
               dtype: torch.dtype, factors: torch.Tensor | None = None) -> torch.Tensor:
    """The dense [N, K] weight in ``dtype`` (computed in float32)."""
    q = unpack_int4(qweight) if bits == 4 else qweight
    n, k = q.shape
    group = k // scales.shape[1]
    s, z = decode_params(scales, zeros, factors)
    w = q.float().reshape(n, -1, group) * s[:, :, None]
    if z is not None:
        w = w + z[:, :, None]
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


_CLIP_FRACTIONS = tuple(1 - i / 40 for i in range(17))  # shares of a group's range the clip search tries
_REFITS = 3  # least-squares refits of (scale, zero) after the clip search


def quantize_int4(w: torch.Tensor, group: int, coded: bool = False, search: bool = False,
                  importance: torch.Tensor | None = None):
    """Asymmetric int4 (0..15) with a scale and a zero point per group, values rounded to nearest.

    Returns (packed, scales, zeros, factors): float16 scales and zeros (factors None), or codes when
    ``coded``. The range is the group's [min, max]; with ``search``, the centred share of it (see
    ``_CLIP_FRACTIONS``) whose rounding error is smallest, then (scale, zero) refitted by least
    squares to the values chosen.
    """
    g = _grouped(w, group)
    imp = None if importance is None else importance.float().reshape(1, -1, group)
    low, high = g.amin(dim=-1), g.amax(dim=-1)
    scale, zero = _int4_range(low, high)
    if search:
        best_error = _int4_error(g, scale, zero, imp)
        for fraction in _CLIP_FRACTIONS[1:]:
            cut = (high - low) * (1 - fraction) / 2
            s, z = _int4_range(low + cut, high - cut)
            error = _int4_error(g, s, z, imp)
            better = error < best_error
            scale, zero = torch.where(better, s, scale), torch.where(better, z, zero)
            best_error = torch.minimum(error, best_error)
        for _ in range(_REFITS):
            scale, zero = _refit(g, _int4_values(g, scale, zero), scale, zero, imp)
    if coded:
        stored_scales, stored_zeros, factors = encode_params(scale, zero)
    else:
        stored_scales, stored_zeros, factors = scale.half(), zero.half(), None
    scale, zero = decode_params(stored_scales, stored_zeros, factors)
    q = _int4_values(g, scale, zero)
    return pack_int4(q.to(torch.uint8).reshape(w.shape)), stored_scales, stored_zeros, factors


def _int4_range(low: torch.Tensor, high: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return ((high - low) / 15).clamp(min=_FP16_TINY), low


def _int4_values(g: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return torch.round((g - zero[:, :, None]) / scale[:, :, None]).clamp(0, 15)


def _int4_error(g: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, imp: torch.Tensor | None) -> torch.Tensor:
    err = (_int4_values(g, scale, zero) * scale[:, :, None] + zero[:, :, None] - g) ** 2
    return (err if imp is None else err * imp).sum(-1)


def _refit(g: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, imp: torch.Tensor | None):
    """The (weighted) least-squares (scale, zero) for fixed values q, where it lowers the error."""
    wt = torch.ones_like(g) if imp is None else imp.expand_as(g)
    total = wt.sum(-1, keepdim=True)
    qm, gm = (wt * q).sum(-1, keepdim=True) / total, (wt * g).sum(-1, keepdim=True) / total
    qc = q - qm
    var = (wt * qc * qc).sum(-1)
    s = ((wt * qc * (g - gm)).sum(-1) / var.clamp(min=1e-12)).clamp(min=_FP16_TINY)
    z = gm.squeeze(-1) - s * qm.squeeze(-1)
    better = (var > 0) & (_int4_error(g, s, z, imp) < _int4_error(g, scale, zero, imp))
    return torch.where(better, s, scale), torch.where(better, z, zero)
