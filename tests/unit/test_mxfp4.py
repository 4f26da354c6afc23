"""MXFP4 dequantization: FP4 E2M1 codes, two per byte (low nibble first), times a shared E8M0 scale."""

from __future__ import annotations

import pytest
import torch

from kvserve.model.quant.mxfp4 import E2M1_VALUES, dequantize_mxfp4


def test_every_code_and_scale_dequantizes_to_its_value():
    # row r, block g: the 32 values walk the 16 codes twice (low nibble = even element), scale 2 ** (r - g)
    codes = torch.arange(32) % 16
    packed = (codes[0::2] | (codes[1::2] << 4)).to(torch.uint8)  # [16]
    blocks = packed.expand(3, 2, 16).clone()  # [rows, G, 16]
    exponents = torch.tensor([[r - g for g in range(2)] for r in range(3)])
    scales = (exponents + 127).to(torch.uint8)
    out = dequantize_mxfp4(blocks, scales, torch.float32)
    assert out.shape == (3, 64)
    for r in range(3):
        for g in range(2):
            want = [E2M1_VALUES[c] * 2.0 ** (r - g) for c in codes.tolist()]
            assert out[r, 32 * g:32 * (g + 1)].tolist() == want


def test_hand_written_bytes():
    # byte 0x2F: low nibble 0xF = -6.0 (element 0), high nibble 0x2 = 1.0 (element 1); scale 2 ** -1
    blocks = torch.zeros(1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0], blocks[0, 0, 15] = 0x2F, 0x9B  # last byte: 0xB = -1.5, 0x9 = -0.5
    scales = torch.tensor([[126]], dtype=torch.uint8)
    out = dequantize_mxfp4(blocks, scales, torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert out[0, :2].tolist() == [-3.0, 0.5] and out[0, 30:].tolist() == [-0.75, -0.25]
    assert out[0, 2:30].abs().sum() == 0


def test_batch_dims_and_shape_errors():
    blocks = torch.randint(0, 256, (4, 5, 3, 16), dtype=torch.uint8)
    scales = torch.randint(120, 135, (4, 5, 3), dtype=torch.uint8)
    out = dequantize_mxfp4(blocks, scales, torch.float32)
    assert out.shape == (4, 5, 96)
    torch.testing.assert_close(out[2], dequantize_mxfp4(blocks[2], scales[2], torch.float32), atol=0, rtol=0)
    with pytest.raises(ValueError, match="do not pair up"):
        dequantize_mxfp4(blocks, scales[..., :2], torch.float32)
