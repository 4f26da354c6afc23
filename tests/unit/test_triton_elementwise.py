"""The CUDA path's elementwise Triton kernels agree with the PyTorch reference ops.

Without a GPU they run in Triton's interpreter on CPU tensors (conftest.py sets ``TRITON_INTERPRET=1``),
which checks float32 and float16; a GPU run adds bfloat16. The kernels mirror the reference's
roundings, so float16/bfloat16 results may differ only where float32 sums are ordered differently.
"""

from __future__ import annotations

import pytest
import torch

from kvserve.model.layers import elementwise

pytest.importorskip("triton")

_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
_DTYPES = [(torch.float32, 1e-6), (torch.float16, 1e-3)] + ([(torch.bfloat16, 1e-2)] if _DEVICE.type == "cuda" else [])


@pytest.fixture(scope="module")
def kernels():
    from kvserve.model.layers import triton_elementwise

    return triton_elementwise


def _close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    err = (got.float() - want.float()).norm() / want.float().norm()
    assert err <= tol, f"relative error {err:.2e} > {tol:.0e}"


def _randn(*shape, dtype):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)), dtype=torch.float32).to(
        dtype).to(_DEVICE)


@pytest.mark.parametrize("dtype, tol", _DTYPES)
@pytest.mark.parametrize("rows, dim", [(1, 64), (7, 576), (33, 100)])
def test_rms_norm_matches_reference(kernels, dtype, tol, rows, dim):
    x, weight = _randn(rows, dim, dtype=dtype), _randn(dim, dtype=dtype)
    _close(kernels.rms_norm(x, weight, 1e-6), elementwise.rms_norm_reference(x, weight, 1e-6), tol)


@pytest.mark.parametrize("dtype, tol", _DTYPES)
def test_rms_norm_adds_into_the_residual_first(kernels, dtype, tol):
    x, weight, residual = _randn(5, 96, dtype=dtype), _randn(96, dtype=dtype), _randn(5, 96, dtype=dtype) * 3
    mine, theirs = residual.clone(), residual.clone()
    got = kernels.rms_norm(x, weight, 1e-5, mine)
    want = elementwise.rms_norm_reference(x, weight, 1e-5, theirs)
    _close(got, want, tol)
    torch.testing.assert_close(mine, theirs, rtol=0, atol=0)  # the same rounded sums, in place


@pytest.mark.parametrize("dtype, tol", _DTYPES)
def test_rms_norm_over_heads_of_a_strided_view(kernels, dtype, tol):
    """q/k norm: x [T, H, D] is a view into a fused qkv output, rows of D with a gap between tokens."""
    qkv = _randn(6, 4 * 48 + 2 * 48, dtype=dtype)
    q = qkv[:, :4 * 48].view(6, 4, 48)
    weight = _randn(48, dtype=dtype)
    got = kernels.rms_norm(q, weight, 1e-6)
    assert got.is_contiguous()
    _close(got, elementwise.rms_norm_reference(q, weight, 1e-6), tol)


@pytest.mark.parametrize("dtype, tol", _DTYPES)
@pytest.mark.parametrize("heads, kv_heads, dim", [(4, 2, 64), (9, 3, 48), (2, 2, 32)])
def test_rotary_matches_reference_in_place_on_qkv_views(kernels, dtype, tol, heads, kv_heads, dim):
    tokens = 11
    qkv = _randn(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype)
    positions = torch.randint(0, 200, (tokens,), generator=torch.Generator().manual_seed(1)).to(_DEVICE)
    angles = torch.arange(256, dtype=torch.float32)[:, None] * (0.5 ** torch.arange(dim // 2))[None, :]
    cos, sin = angles.cos().to(_DEVICE), angles.sin().to(_DEVICE)
    mine, theirs = qkv.clone(), qkv.clone()
    views = [(t[:, :heads * dim].view(tokens, heads, dim), t[:, heads * dim:(heads + kv_heads) * dim].view(
        tokens, kv_heads, dim)) for t in (mine, theirs)]
    kernels.apply_rotary_(positions, *views[0], cos, sin)
    elementwise.apply_rotary_reference_(positions, *views[1], cos, sin)
    _close(mine, theirs, tol)
    v = slice((heads + kv_heads) * dim, None)
    torch.testing.assert_close(mine[:, v], qkv[:, v], rtol=0, atol=0)  # v is left alone


@pytest.mark.parametrize("dtype, tol", _DTYPES)
@pytest.mark.parametrize("rows, inter", [(1, 64), (5, 1408), (3, 2500)])
def test_silu_mul_matches_reference(kernels, dtype, tol, rows, inter):
    x = _randn(rows, 2 * inter, dtype=dtype)
    _close(kernels.silu_mul(x), elementwise.silu_mul_reference(x), tol)


def test_empty_inputs(kernels):
    x = torch.empty(0, 64, device=_DEVICE)
    assert kernels.rms_norm(x, torch.ones(64, device=_DEVICE), 1e-6).shape == (0, 64)
    assert kernels.silu_mul(torch.empty(0, 128, device=_DEVICE)).shape == (0, 64)
    kernels.apply_rotary_(torch.empty(0, dtype=torch.long, device=_DEVICE), torch.empty(0, 2, 8, device=_DEVICE),
                          torch.empty(0, 1, 8, device=_DEVICE), torch.ones(4, 4, device=_DEVICE),
                          torch.ones(4, 4, device=_DEVICE))


@pytest.mark.skipif(_DEVICE.type != "cuda", reason="the dispatch picks the Triton kernels for CUDA tensors only")
def test_dispatch_uses_triton_on_cuda(monkeypatch, kernels):
    calls = []
    monkeypatch.setattr(kernels, "silu_mul", lambda x: calls.append(x) or elementwise.silu_mul_reference(x))
    elementwise.silu_mul(_randn(2, 64, dtype=torch.bfloat16))
    assert calls
