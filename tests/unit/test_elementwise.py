"""The compiled elementwise kernels against the plain PyTorch path they replace (same semantics,
including the in-place residual and rotary updates)."""

import pytest
import torch

from kvserve.model.layers import elementwise as E

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
pytestmark = pytest.mark.skipif(E.load_elementwise_kernels() is None, reason="C++ kernels unavailable")


@pytest.fixture
def reference(monkeypatch):
    """Runs a function with the compiled kernels switched off (the PyTorch path)."""
    def run(fn, *args):
        with monkeypatch.context() as m:
            m.setattr(E, "load_elementwise_kernels", lambda: None)
            return fn(*args)
    return run


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    # float32 sums in another order; in 16-bit dtypes at most one rounding step apart
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_rms_norm_matches_reference(dtype, rows, reference):
    torch.manual_seed(rows)
    x, w = torch.randn(rows, 576, dtype=dtype) * 3, torch.randn(576, dtype=dtype)
    _close(E.rms_norm(x, w, 1e-6), reference(E.rms_norm, x, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_adds_into_the_residual_in_place(dtype, reference):
    torch.manual_seed(0)
    x, w, residual = torch.randn(5, 64, dtype=dtype), torch.randn(64, dtype=dtype), torch.randn(5, 64, dtype=dtype)
    mine, theirs = residual.clone(), residual.clone()
    out = E.rms_norm(x, w, 1e-5, mine)
    expected = reference(E.rms_norm, x, w, 1e-5, theirs)
    assert torch.equal(mine, theirs) and torch.equal(mine, residual + x)  # the sum, rounded to the dtype
    _close(out, expected, dtype)


def test_rms_norm_bf16_is_bitwise_the_reference(reference):
    x, w = torch.randn(8, 576, dtype=torch.bfloat16), torch.randn(576, dtype=torch.bfloat16)
    assert torch.equal(E.rms_norm(x, w, 1e-5), reference(E.rms_norm, x, w, 1e-5))


def test_rms_norm_of_heads(reference):
    """Qwen3's q/k norm: [tokens, heads, head_dim] views into the fused qkv output."""
    qkv = torch.randn(4, 3 * 64 + 2 * 64)
    q = qkv[:, :192].view(4, 3, 64)
    w = torch.randn(64)
    _close(E.rms_norm(q, w, 1e-6), reference(E.rms_norm, q, w, 1e-6), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_on_strided_views(dtype, reference):
    torch.manual_seed(1)
    heads, kv_heads, dim = 6, 2, 32
    qkv = torch.randn(7, (heads + 2 * kv_heads) * dim, dtype=dtype)
    cos, sin = torch.rand(100, dim // 2), torch.rand(100, dim // 2)
    positions = torch.tensor([0, 3, 99, 50, 7, 7, 1])

    def views(t):
        return t[:, :heads * dim].view(7, heads, dim), t[:, heads * dim:(heads + kv_heads) * dim].view(7, kv_heads, dim)

    mine, theirs = qkv.clone(), qkv.clone()
    E.apply_rotary_(positions, *views(mine), cos, sin)
    reference(E.apply_rotary_, positions, *views(theirs), cos, sin)
    _close(mine, theirs, dtype)
    assert torch.equal(mine[:, (heads + kv_heads) * dim:], qkv[:, (heads + kv_heads) * dim:])  # v untouched
    if dtype != torch.float32:  # rounded at the same points as the reference
        assert torch.equal(mine, theirs)


def test_rotary_rejects_positions_outside_the_table():
    q, k = torch.randn(2, 2, 8), torch.randn(2, 1, 8)
    cos = sin = torch.ones(10, 4)
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        E.apply_rotary_(torch.tensor([3, 10]), q, k, cos, sin)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_reference(dtype, reference):
    torch.manual_seed(2)
    x = torch.randn(9, 2 * 1536, dtype=dtype) * 6  # large |x| too: exp must not overflow
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    out = E.silu_mul(x)
    assert out.shape == (9, 1536)
    _close(out, reference(E.silu_mul, x), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [1, 15, 16, 49152 + 7])  # below, at and past the vector width, with a tail
def test_argmax_rows_matches_torch(dtype, width):
    from kvserve.sample.sampler import argmax_rows

    torch.manual_seed(0)
    x = torch.randn(9, width).to(dtype)
    x[1] = 0.5  # a row of ties: the first index wins
    x[2] = float("-inf")
    x[3, -1] = 100.0  # the winner in the scalar tail
    if width > 40:
        x[4, 3] = x[4, 37] = 100.0  # tie across vector lanes and steps
    assert torch.equal(argmax_rows(x), x.max(dim=-1).indices)
    assert torch.equal(argmax_rows(x[:, : max(1, width // 2)]), x[:, : max(1, width // 2)].max(dim=-1).indices)
