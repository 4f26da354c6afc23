"""GGUF block quantizations mapped exactly onto the int4 / int8 group layouts.

Every supported block type stores ``w = q * scale + zero`` over sub-blocks of 16 or 32 values, so
it is decoded here to integer values plus one float scale (and zero) per sub-block, never to a dense
float matrix, then packed into the kernels' layout:

    type   values        sub-block  scale        zero          kernel layout
    Q4_0   0..15 - 8     32         d            -             int4 g32 (zero = -8 d)
    Q4_1   0..15         32         d            m             int4 g32
    Q4_K   0..15         32         d * sc (6b)  -dmin * m     int4 g32
    Q5_0   0..31 - 16    32         d            -             int8 g32
    Q5_1   0..31         32         d            m             int8 g32 + zeros
    Q5_K   0..31         32         d * sc (6b)  -dmin * m     int8 g32 + zeros
    Q6_K   0..63 - 32    16         d * sc (8b)  -             int8 g16
    Q8_0   -128..127     32         d            -             int8 g32

Scales and zeros are stored as float16: exact for the legacy types (d, m and 8 d are float16 in
the file); for the K-quants the product d * sc is rounded to float16 (relative error <= 2^-11).
The decoders mirror the `gguf` package's reference dequantizers, which the tests compare against.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from kvserve.model.quant.packing import pack_int4

if TYPE_CHECKING:
    from kvserve.model.gguf_file import GGUFBlocks

_FP16_MAX = 65504.0


class Decoded(NamedTuple):
    q: np.ndarray  # int16 [rows, K]
    scale: np.ndarray  # float32 [rows, K / sub]
    zero: np.ndarray | None  # float32 [rows, K / sub], None when w = q * scale
    sub: int


def _f16(b: np.ndarray) -> np.ndarray:
    return b.view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Bytes [n, ..., width] -> values [n, ..., 2 * width]: low nibbles first, then high nibbles."""
    return np.concatenate((qs & 15, qs >> 4), axis=-1)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and mins packed into 12 bytes of a Q4_K / Q5_K super-block."""
    n = scales.shape[0]
    d, m, m_d = np.split(scales.reshape(n, 3, 4), 3, axis=-2)
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1).reshape(n, 8)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1).reshape(n, 8)
    return sc.astype(np.float32), mn.astype(np.float32)


def _high_bits_32(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: 4 bytes = 32 little-endian bits, bit j is value j's fifth bit."""
    return np.unpackbits(qh, axis=-1, bitorder="little").astype(np.int16)


def _q4_0(b):
    return Decoded(_nibbles(b[:, 2:]).astype(np.int16) - 8, _f16(b[:, :2]), None, 32)


def _q4_1(b):
    return Decoded(_nibbles(b[:, 4:]).astype(np.int16), _f16(b[:, :2]), _f16(b[:, 2:4]), 32)


def _q5_0(b):
    q = _nibbles(b[:, 6:]).astype(np.int16) | (_high_bits_32(b[:, 2:6]) << 4)
    return Decoded(q - 16, _f16(b[:, :2]), None, 32)


def _q5_1(b):
    q = _nibbles(b[:, 8:]).astype(np.int16) | (_high_bits_32(b[:, 4:8]) << 4)
    return Decoded(q, _f16(b[:, :2]), _f16(b[:, 2:4]), 32)


def _q8_0(b):
    return Decoded(b[:, 2:].view(np.int8).astype(np.int16), _f16(b[:, :2]), None, 32)


def _q4_k(b):
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    q = _nibbles(b[:, 16:].reshape(n, 4, 32)).reshape(n, 256).astype(np.int16)
    return Decoded(q, d * sc, -dmin * mn, 32)


def _q5_k(b):
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    low = _nibbles(b[:, 48:].reshape(n, 4, 32)).reshape(n, 8, 32)
    high = (b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    q = (low.astype(np.int16) | (high.astype(np.int16) << 4)).reshape(n, 256)
    return Decoded(q, d * sc, -dmin * mn, 32)


def _q6_k(b):
    n = b.shape[0]
    ql, qh = b[:, :128], b[:, 128:192]
    sc, d = b[:, 192:208].view(np.int8).astype(np.float32), _f16(b[:, 208:210])
    low = _nibbles(ql.reshape(n, 2, 64)).reshape(n, 8, 32)
    high = (qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    q = (low.astype(np.int16) | (high.reshape(n, 8, 32).astype(np.int16) << 4)) - 32
    return Decoded(q.reshape(n, 256), d * sc, None, 16)


_DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
             "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}
_INT4_TYPES = {"Q4_0", "Q4_1", "Q4_K"}
_ZERO_TYPES = {"Q4_1", "Q5_1", "Q4_K", "Q5_K"}


def supported(type_name: str) -> bool:
    return type_name in _DECODERS


def decode(blocks: GGUFBlocks) -> Decoded | None:
    """Integer values and per-sub-block scales/zeros of a block tensor, or None for other types."""
    decoder = _DECODERS.get(blocks.type_name)
    if decoder is None:
        return None
    rows, cols = blocks.shape
    dec = decoder(np.ascontiguousarray(blocks.data).reshape(-1, blocks.type_size))
    per_row = cols // dec.sub
    zero = None if dec.zero is None else dec.zero.reshape(rows, per_row)
    return Decoded(dec.q.reshape(rows, cols), dec.scale.reshape(rows, per_row), zero, dec.sub)


def native_layout(type_names: set[str]) -> tuple[int, int, bool] | None:
    """(bits, group, zeros) of the group layout holding every given block type exactly, or None."""
    if not type_names or not all(supported(t) for t in type_names):
        return None
    if type_names <= _INT4_TYPES:
        return 4, 32, True
    return 8, 16 if "Q6_K" in type_names else 32, bool(type_names & _ZERO_TYPES)


def to_group_layout(blocks: GGUFBlocks, bits: int, group: int, has_zeros: bool):
    """(qweight, fp16 scales, fp16 zeros or None) in the kernels' layout, or None if this layout
    cannot hold the blocks exactly (the caller then dequantizes and rounds to nearest)."""
    direct = _as_stored(blocks, bits, group, has_zeros)
    if direct is not None:
        return direct
    dec = decode(blocks)
    if dec is None or group > dec.sub or dec.sub % group:
        return None
    q, scale, zero = dec.q, dec.scale, dec.zero
    if bits == 4 and zero is None:  # signed values: shift into 0..15 and move the offset to the zero
        q, zero = q + 8, -8 * scale
    lo, hi = (0, 15) if bits == 4 else (-128, 127)
    if int(q.min()) < lo or int(q.max()) > hi or (zero is not None and not has_zeros):
        return None
    if max(np.abs(scale).max(), 0 if zero is None else np.abs(zero).max()) > _FP16_MAX:
        return None
    repeat = dec.sub // group

    def fp16(a):
        return torch.from_numpy(np.repeat(a, repeat, axis=1)).half()

    qt = torch.from_numpy(q)
    qt = pack_int4(qt.to(torch.uint8)) if bits == 4 else qt.to(torch.int8)
    return qt, fp16(scale), None if zero is None else fp16(zero)


def _as_stored(blocks: GGUFBlocks, bits: int, group: int, has_zeros: bool):
    """Q4_0 / Q4_1 / Q8_0 in groups of 32 without decoding: their value bytes are the kernels' layout
    already (a Q4 block's byte j holds value j in its low nibble and value j + 16 in its high one,
    as ``pack_int4`` packs), and their scales (and mins) are float16 in the file. Loading the
    default model's 121 matrices this way took 0.22 s instead of 0.47 s. None for anything else."""
    name, (rows, cols) = blocks.type_name, blocks.shape
    if group != 32 or (bits, name) not in ((4, "Q4_0"), (4, "Q4_1"), (8, "Q8_0")) or (name == "Q4_0" and not has_zeros):
        return None
    b = np.ascontiguousarray(blocks.data).reshape(rows, cols // 32, blocks.type_size)
    head = 4 if name == "Q4_1" else 2
    scale = b[:, :, 0:2].copy().view(np.float16).reshape(rows, -1)
    if not np.isfinite(scale).all():
        return None
    values = torch.from_numpy(b[:, :, head:].reshape(rows, -1).copy())
    if name == "Q8_0":
        return values.view(torch.int8), torch.from_numpy(scale), None
    # Q4_0 stores value + 8: the same nibbles with zero = -8 * d; Q4_1 stores its min m.
    zero = b[:, :, 2:4].copy().view(np.float16).reshape(rows, -1) if name == "Q4_1" else -8 * scale
    if not np.isfinite(zero).all():
        return None
    return values, torch.from_numpy(scale), torch.from_numpy(zero)
