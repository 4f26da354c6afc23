"""The packed bf16 linear (layers/csrc/packed_linear.cpp) against torch, and the dense method's
use of it: W is packed at load and kept only packed (embeddings also keep their rows)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.model.layers.linear import Linear, VocabEmbedding, load_checkpoint
from kvserve.model.quant.methods import load_quant_kernels


def _kernels():
    kernels = load_quant_kernels()
    if kernels is None or not kernels.packed_linear_supported():
        pytest.skip("neither AVX512-BF16 nor AVX2 here: dense bf16 weights are not packed")
    return kernels


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x.float(), w.float())


@pytest.mark.parametrize("n,k", [(72, 192), (960, 576), (40, 1536)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 13, 16, 17, 33, 64, 128, 129, 300, 600])
def test_packed_linear_matches_torch(n, k, rows):
    kernels = _kernels()
    torch.manual_seed(rows)
    w = (torch.randn(n, k) * 0.1).bfloat16()
    x = torch.randn(rows, k).bfloat16()
    packed = kernels.pack_bf16_weight(w)
    assert packed.shape == ((n + 15) // 16, k // 32, 16, 32)
    y = kernels.packed_linear(x, packed, n)
    ref = _reference(x, w)
    assert y.shape == (rows, n) and y.dtype == torch.bfloat16
    # float32 sums rounded once to bf16: within a bf16 step of the exact result
    torch.testing.assert_close(y.float(), ref, atol=1e-2 * ref.abs().max().item(), rtol=8e-3)


def test_packed_layout_holds_the_weight_tile_by_tile():
    kernels = _kernels()
    w = torch.arange(40 * 64, dtype=torch.float32).reshape(40, 64).bfloat16()
    packed = kernels.pack_bf16_weight(w)
    if kernels.native_bf16():  # AMX tiles: [strip, chunk, input pair, 2 * channel + which of the pair]
        for n, kk in [(0, 0), (1, 0), (0, 1), (17, 33), (39, 63)]:
            s, j, c, r, e = n // 16, n % 16, kk // 32, kk % 32 // 2, kk % 2
            assert packed[s, c, r, 2 * j + e] == w[n, kk]
        assert torch.all(packed[2, :, :, 16:] == 0)  # channels 40-47 do not exist: zero padding
    else:  # AVX2: [strip, input, position], channels 4-7 and 8-11 swapped (one unpack each half)
        strips = packed.view(3, 64, 16)
        position = [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15]  # of channel j
        for n, kk in [(0, 0), (1, 0), (0, 1), (5, 2), (9, 7), (17, 33), (39, 63)]:
            assert strips[n // 16, kk, position[n % 16]] == w[n, kk]
        assert torch.all(strips[2, :, [position[j] for j in range(8, 16)]] == 0)  # channels 40-47: zero padding


def test_packed_rows_do_not_depend_on_the_batch():
    """A row's sums run in the same order whatever the other rows are: among 1-8 rows (the few-row
    vector path, which a speculative verify step of one request takes), and among more (AMX tiles, or
    the blocked vector path); without AMX every path sums in the same order."""
    kernels = _kernels()
    torch.manual_seed(0)
    w = (torch.randn(96, 576) * 0.1).bfloat16()
    x = torch.randn(70, 576).bfloat16()
    packed = kernels.pack_bf16_weight(w)
    full = kernels.packed_linear(x, packed, 96)
    single = torch.cat([kernels.packed_linear(x[i:i + 1].contiguous(), packed, 96) for i in range(8)])
    for rows in range(2, 9):
        assert torch.equal(kernels.packed_linear(x[:rows].contiguous(), packed, 96), single[:rows])
    for rows in (9, 17, 32, 47):
        assert torch.equal(kernels.packed_linear(x[:rows].contiguous(), packed, 96), full[:rows])
    if not kernels.has_amx():
        assert torch.equal(single, full[:8])


def test_packed_linear_rejects_bad_input():
    kernels = _kernels()
    w = torch.randn(32, 64).bfloat16()
    packed = kernels.pack_bf16_weight(w)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernels.pack_bf16_weight(torch.randn(32, 48).bfloat16())
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernels.pack_bf16_weight(torch.randn(32, 64))
    with pytest.raises(RuntimeError, match="K = 64"):
        kernels.packed_linear(torch.randn(3, 96).bfloat16(), packed, 32)
    with pytest.raises(RuntimeError, match="pack_bf16_weight"):
        kernels.packed_linear(torch.randn(3, 64).bfloat16(), packed, 48)  # 3 strips, not 2
    with pytest.raises(RuntimeError, match="silu_mul needs a weight packed as gated"):
        kernels.packed_linear(torch.randn(3, 64).bfloat16(), packed, 32, silu_mul=True)
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernels.packed_linear(torch.randn(3, 64), packed, 32)


@pytest.mark.parametrize("rows", [3, 40, 1100])
def test_dense_method_packs_at_load_and_matches_torch(rows):
    kernels = _kernels()
    torch.manual_seed(1)
    layer = Linear(128, 80, bias=True, dtype=torch.bfloat16)
    model = torch.nn.Sequential()
    model.add_module("proj", layer)
    w, b = (torch.randn(80, 128) * 0.1).bfloat16(), torch.randn(80).bfloat16()
    load_checkpoint(model, [("proj.weight", w), ("proj.bias", b)])
    assert torch.equal(layer.weight_packed, kernels.pack_bf16_weight(w))
    assert not hasattr(layer, "weight")  # only the packed copy is kept
    x = torch.randn(2, rows, 128).bfloat16()
    y = layer(x)
    ref = _reference(x, w) + b.float()
    assert y.shape == (2, rows, 80)
    torch.testing.assert_close(y.float(), ref, atol=2e-2 * ref.abs().max().item(), rtol=1e-2)
    spec = layer.method.kernel_spec(layer, kernels)  # the fused decoder's view of the same layer
    flat = x.reshape(-1, 128)
    assert torch.equal(spec(flat), y.reshape(-1, 80))
    with pytest.raises(ValueError, match="packed for bfloat16"):
        layer(x.float())


def test_embedding_keeps_its_rows_and_projects_through_the_packed_copy():
    kernels = _kernels()
    torch.manual_seed(3)
    embed = VocabEmbedding(100, 64, torch.bfloat16)
    model = torch.nn.Sequential()
    model.add_module("embed", embed)
    w = (torch.randn(100, 64) * 0.1).bfloat16()
    load_checkpoint(model, [("embed.weight", w)])
    assert torch.equal(embed(torch.tensor([3, 99])), w[[3, 99]])
    assert torch.equal(embed.weight_packed, kernels.pack_bf16_weight(w))
    x = torch.randn(7, 64).bfloat16()
    ref = _reference(x, w)
    torch.testing.assert_close(embed.project(x).float(), ref, atol=2e-2 * ref.abs().max().item(), rtol=1e-2)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 17, 64, 300])
def test_gated_packed_linear_is_silu_mul_of_the_projection_bitwise(rows):
    """The gated copy writes SiLU(gate) * up itself: the same bits as the plain copy + silu_mul."""
    kernels = _kernels()
    torch.manual_seed(rows)
    w = (torch.randn(2 * 96, 576) * 0.1).bfloat16()  # [W_gate; W_up], 96 channels each
    x = torch.randn(rows, 576).bfloat16()
    plain = kernels.packed_linear(x, kernels.pack_bf16_weight(w), 192)
    gated = kernels.packed_linear(x, kernels.pack_bf16_weight(w, gated=True), 192, gated=True, silu_mul=True)
    assert torch.equal(kernels.packed_linear(x, kernels.pack_bf16_weight(w, gated=True), 192, gated=True), plain)
    assert gated.shape == (rows, 96)
    assert torch.equal(gated, kernels.silu_mul(plain))
    gate, up = _reference(x, w).chunk(2, dim=-1)
    ref = F.silu(gate) * up
    torch.testing.assert_close(gated.float(), ref, atol=3e-2 * ref.abs().max().item(), rtol=2e-2)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernels.pack_bf16_weight(w[:48].contiguous(), gated=True)


@pytest.mark.parametrize("rows", [2, 40, 1100])
def test_gated_layer_projects_silu_mul_through_every_path(rows):
    kernels = _kernels()
    torch.manual_seed(2)
    layer = Linear(64, 2 * 48, bias=False, dtype=torch.bfloat16, shards={"gate": (0, 48), "up": (48, 48)},
                   gated=True)
    model = torch.nn.Sequential()
    model.add_module("mlp", torch.nn.Module())
    model.mlp.add_module("gate_up", layer)
    gate_w, up_w = (torch.randn(48, 64) * 0.1).bfloat16(), (torch.randn(48, 64) * 0.1).bfloat16()
    load_checkpoint(model, [("mlp.gate.weight", gate_w), ("mlp.up.weight", up_w)])
    assert layer.packed_gated
    w = torch.cat([gate_w, up_w])
    x = torch.randn(rows, 64).bfloat16()
    fused = layer.project_silu_mul(x)
    plain = kernels.packed_linear(x, kernels.pack_bf16_weight(w), 96)
    assert torch.equal(fused, kernels.silu_mul(plain))  # bitwise the plain copy's result + silu_mul
    assert torch.equal(layer(x), plain)  # the gated copy also writes the plain projection, in W's order
    spec = layer.method.kernel_spec(layer, kernels)
    assert torch.equal(spec.silu_mul(x), fused) and torch.equal(spec(x), plain)
