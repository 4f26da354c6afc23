"""Quantization building blocks: packing round trips, round-to-nearest error bounds, the C++ kernels
against the PyTorch reference, GGUF block decoding against the `gguf` package, KV-cache formats."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from kvserve.model.attention.kv_quant import KVQuantFormat
from kvserve.model.gguf_file import GGUFBlocks
from kvserve.model.quant import gguf_blocks, packing
from kvserve.model.quant.methods import load_quant_kernels


def test_int4_pack_unpack_round_trip():
    q = torch.randint(0, 16, (7, 96), dtype=torch.uint8)
    packed = packing.pack_int4(q)
    assert packed.shape == (7, 48)
    assert torch.equal(packing.unpack_int4(packed), q)
    # llama.cpp order: byte j of a 32-chunk holds value j (low nibble) and value j + 16 (high nibble)
    assert int(packed[0, 0]) == int(q[0, 0]) | int(q[0, 16]) << 4


@pytest.mark.parametrize("group", [None, 32])
def test_int8_round_to_nearest_error_bound(group):
    w = torch.randn(64, 128) * 0.1
    q, scales = packing.quantize_int8(w, group)
    back = packing.dequantize(q, scales, None, 8, torch.float32)
    step = scales.float().repeat_interleave(128 // scales.shape[1], dim=1)
    assert ((back - w).abs() <= step / 2 + 1e-6).all()
    assert q.abs().max() <= 127


@pytest.mark.parametrize("group", [16, 32, 64, 128])
def test_int4_round_to_nearest_error_bound(group):
    w = torch.randn(48, 256) * 0.1
    packed, scales, zeros, factors = packing.quantize_int4(w, group)
    assert factors is None and scales.dtype == zeros.dtype == torch.float16
    back = packing.dequantize(packed, scales, zeros, 4, torch.float32)
    step = scales.float().repeat_interleave(group, dim=1)
    # half a step, plus the float16 rounding of the zero point
    assert ((back - w).abs() <= step / 2 + zeros.float().abs().repeat_interleave(group, dim=1) * 2**-10 + 1e-6).all()


@pytest.mark.parametrize("group", [16, 32])
def test_int4_coded_parameters(group):
    torch.manual_seed(0)
    w = torch.randn(48, 256) * torch.logspace(-2, 0, 48)[:, None]  # rows of very different scale
    packed, codes, zero_codes, factors = packing.quantize_int4(w, group, coded=True)
    assert codes.dtype == torch.uint8 and zero_codes.dtype == torch.int8 and factors.shape == (48, 2)
    back = packing.dequantize(packed, codes, zero_codes, 4, torch.float32, factors)
    scale, zero = packing.decode_params(codes, zero_codes, factors)
    g = w.reshape(48, -1, group)
    low, high = g.amin(-1), g.amax(-1)
    # Rounding error: half a (coded) step, plus how far the coded range misses [low, high]
    miss = torch.maximum((zero - low).abs(), (zero + 15 * scale - high).abs())
    bound = (scale / 2 + miss).repeat_interleave(group, dim=1)
    assert ((back - w).abs() <= bound + 1e-6).all()
    assert (back - w).abs().mean() < 0.3 * scale.mean()  # mostly the int4 rounding itself
    fp16 = packing.dequantize(*packing.quantize_int4(w, group)[:3], 4, torch.float32)
    assert ((back - w) ** 2).mean() < 1.2 * ((fp16 - w) ** 2).mean()  # codes cost little accuracy


def test_int4_clip_search_lowers_the_error():
    torch.manual_seed(1)
    w = torch.randn(64, 256)
    errors = []
    for search in (False, True):
        packed, s, z, f = packing.quantize_int4(w, 16, coded=True, search=search)
        errors.append(((packing.dequantize(packed, s, z, 4, torch.float32, f) - w) ** 2).mean())
    plain, searched = errors
    assert searched < 0.97 * plain, (searched, plain)


def test_int4_importance_weights_the_error_where_it_matters():
    torch.manual_seed(2)
    w = torch.randn(64, 256)
    importance = torch.ones(256)
    importance[::4] = 50.0  # every fourth input matters much more (a large norm weight before it)
    weighted_errors = []
    for imp in (None, importance):
        packed, s, z, f = packing.quantize_int4(w, 16, coded=True, search=True, importance=imp)
        err = (packing.dequantize(packed, s, z, 4, torch.float32, f) - w) ** 2
        weighted_errors.append((err * importance).mean())
    assert weighted_errors[1] < 0.9 * weighted_errors[0], weighted_errors


def _kernels():
    kernels = load_quant_kernels()
    if kernels is None:
        pytest.skip("C++ kernels could not be built on this machine")
    return kernels


@pytest.mark.parametrize("bits, group, zeros, coded", [(4, 32, True, False), (4, 64, True, False), (4, 32, True, True),
                                                       (4, 16, True, True), (8, 96, False, False),
                                                       (8, 16, False, False), (8, 32, True, False)])
@pytest.mark.parametrize("rows", [1, 3, 5, 70])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_reference(bits, group, zeros, coded, rows, dtype):
    kernels = _kernels()
    torch.manual_seed(0)
    n, k = 72, 192  # 72: a partial block of 16 output channels
    w = torch.randn(n, k) * 0.1
    if bits == 4:
        q, s, z, f = packing.quantize_int4(w, group, coded=coded)
    else:
        q, s = packing.quantize_int8(w, group)
        z = (torch.randn_like(s.float()) * 0.01).half() if zeros else None
        f = None
    ref_w = packing.dequantize(q, s, z, bits, torch.float32, f)
    # float16 parameters: q * scale is exact, so the kernel's fused multiply-add matches bit for bit
    tol = 1e-6 if coded else 0
    torch.testing.assert_close(kernels.dequantize(q, s, z, f, group, bits, torch.float32), ref_w, rtol=tol, atol=tol)
    x = torch.randn(rows, k).to(dtype)
    for max_fused, max_amx in ((64, 0), (0, 128), (0, 0)):  # fused, AMX (bf16, where present), tiled + at::mm
        y = kernels.quant_linear(x, q, s, z, f, group, bits, max_fused, max_amx, 4096, dtype != torch.float32)
        ref = torch.nn.functional.linear(x.float(), ref_w)
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        assert y.dtype == dtype
        torch.testing.assert_close(y.float(), ref, atol=tol * ref.abs().max().item(), rtol=tol)


@pytest.mark.parametrize("bits, group, coded", [(4, 32, False), (4, 16, True), (8, 32, False), (8, 16, False)])
@pytest.mark.parametrize("n", [72, 75])
@pytest.mark.parametrize("rows", [2, 4, 50, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_kernel_matches_reference(bits, group, coded, n, rows, dtype):
    """Batches past the fused kernel's rows: on AVX2, float32 panels of 16 rows of W, dotted with 3 rows
    of x by 4 rows of W at a time in blocks of 48 rows; n = 75 ends in a partial panel whose last
    4 rows are partial too, and 50 / 100 rows leave remainders of 2 and 1 row and a second block."""
    kernels = _kernels()
    torch.manual_seed(n + rows + bits)
    k = 320
    w = torch.randn(n, k) * 0.1
    if bits == 4:
        q, s, z, f = packing.quantize_int4(w, group, coded=coded)
    else:
        q, s = packing.quantize_int8(w, group)
        z, f = (torch.randn_like(s.float()) * 0.01).half(), None
    ref_w = packing.dequantize(q, s, z, bits, torch.float32, f)
    x = torch.randn(rows, k).to(dtype)
    y = kernels.quant_linear(x, q, s, z, f, group, bits, 0, 1 << 30, 4096, False)
    assert y.dtype == dtype and y.shape == (rows, n)
    ref = x.double() @ ref_w.double().T
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: y's own rounding
    torch.testing.assert_close(y.double(), ref, atol=tol * ref.abs().max().item(), rtol=tol)


def _int8_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x as the int4 / int8 kernels quantize it: int8 per 32 inputs (a row ending in half a block: its
    last 16), step amax / 127, round to nearest even. Returns (x_hat, step per input, step where the
    rounding is a tie else 0)."""
    rows, k = x.shape
    padded = torch.nn.functional.pad(x.float(), (0, -k % 32))
    blocks = padded.reshape(rows, -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    step = amax / 127
    scaled = blocks * inv
    x_hat = scaled.round() * step
    # inputs land on exact halves of a step now and then (often for bf16 / float16 x), where the
    # kernel's float arithmetic (fast-math) may round the other way: one step off, allowed for by the caller
    tie = ((scaled - scaled.floor() - 0.5).abs() < 1e-3).float()
    return tuple(t.reshape(rows, -1)[:, :k] for t in (x_hat, step.expand_as(blocks), tie * step))


def _integer_path(kernels, bits: int, k: int, coded: bool) -> bool:
    """Whether quant_linear(quantize_x=True) multiplies in integers for this weight: the AVX2 kernels
    take every layout; AVX512-VNNI's int8 kernel wants whole chunks of 32 and float16 scales."""
    if not kernels.has_int8_activations():
        return False
    return kernels.vector_bits() == 256 or bits == 4 or (k % 32 == 0 and not coded)


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("k, group", [(576, 16), (576, 32), (576, 64), (1536, 128), (96, 32), (96, 48), (160, 32)])
@pytest.mark.parametrize("coded", [False, True])
@pytest.mark.parametrize("zeros", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_int4_int8_activation_kernel(k, group, coded, zeros, dtype):
    """The few-row int4 kernel quantizes x to int8 per 32 inputs: it computes w . x_hat, so its
    distance to x . w is bounded by sum_k |w_k| * step_k / 2 (plus the output's own rounding)."""
    kernels = _kernels()
    torch.manual_seed(k + group)
    n = 75  # 4 rows of W per pass, plus a remainder of 3
    w = torch.randn(n, k) * 0.1
    q, s, z, f = packing.quantize_int4(w, group, coded=coded)
    if not zeros:
        z = None
    ref_w = packing.dequantize(q, s, z, 4, torch.float32, f)
    _check_activation_kernel(kernels, q, s, z, f, group, 4, ref_w, k, dtype)


@pytest.mark.parametrize("k, group", [(576, 16), (576, 32), (576, 576), (1536, 128), (96, 32), (96, 48), (160, 32),
                                      (80, 16), (208, 208)])
@pytest.mark.parametrize("zeros", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_int8_activation_kernel(k, group, zeros, dtype):
    """The few-row int8 kernel does the same with int8 weights: symmetric like Q8_0 and int8
    quantization, or with zero points (GGUF K-quants kept as int8 groups), per channel too; rows of
    80 and 208 inputs end in half a block of 32 (groups of 16, or one per row)."""
    kernels = _kernels()
    torch.manual_seed(k + group)
    w = torch.randn(75, k) * 0.1
    q, s = packing.quantize_int8(w, group)
    z = (torch.randn_like(s.float()) * s.float() * 20).half() if zeros else None
    ref_w = packing.dequantize(q, s, z, 8, torch.float32)
    _check_activation_kernel(kernels, q, s, z, None, group, 8, ref_w, k, dtype)


def _check_activation_kernel(kernels, q, s, z, f, group, bits, ref_w, k, dtype):
    out_eps = {torch.bfloat16: 2**-8, torch.float16: 2**-11, torch.float32: 0}[dtype]  # rounding of y to x's dtype
    for rows in (1, 2, 3, 5, 13):  # 13: a pass of 8 rows of x and one of 5
        x = torch.randn(rows, k)
        x[:, 7] *= 30  # an outlier input: its block's step is large, others stay fine
        if rows > 1:
            x[1] = 0  # an all-zero row (step 0)
        x = x.to(dtype)
        y = kernels.quant_linear(x, q, s, z, f, group, bits, 16, 0, 4096, True)
        assert y.dtype == dtype
        y = y.float()
        ref = x.float() @ ref_w.T
        x_hat, step, tie_step = _int8_blocks(x)
        bound = ref_w.abs() @ (step / 2).T  # [n, rows]: the activation rounding, worst case
        slack = out_eps * ref.abs() + 1e-5 * (ref_w.abs() @ x.float().abs().T).T
        assert ((y - ref).abs() <= bound.T * 1.001 + slack).all(), ((y - ref).abs() / (bound.T + slack)).max()
        if not _integer_path(kernels, bits, k, f is not None):  # x stays float: y is x . w rounded
            assert ((y - ref).abs() <= slack + 1e-5 * ref.abs().max()).all()
            continue
        # ... and it is exactly w . x_hat up to float rounding: a wrong lane, group or step would show here
        emulated = x_hat @ ref_w.T
        ties = tie_step @ ref_w.abs().T
        atol = 1e-5 * (x_hat.abs() @ ref_w.abs().T).max().item()
        assert ((y - emulated).abs() <= ties * 1.001 + atol + out_eps * emulated.abs()).all()
        assert (y - ref).abs().mean() < 0.3 * bound.mean()  # typical errors are well inside the bound


def test_float_activations_stay_exact():
    """quantize_x=False (activation_quantization "none", or dtype float32 asked for): few rows of x
    stay float, so y is x . w to float32 rounding, far inside the int8 activations' error."""
    kernels = _kernels()
    torch.manual_seed(3)
    w = torch.randn(40, 256) * 0.1
    q, s, z, f = packing.quantize_int4(w, 32, coded=True)
    ref_w = packing.dequantize(q, s, z, 4, torch.float32, f)
    x = torch.randn(3, 256)
    ref = x.double() @ ref_w.double().T
    exact = kernels.quant_linear(x, q, s, z, f, 32, 4, 8, 0, 4096, False)
    torch.testing.assert_close(exact.double(), ref, atol=1e-5, rtol=1e-5)
    if kernels.has_int8_activations():
        quantized = kernels.quant_linear(x, q, s, z, f, 32, 4, 8, 0, 4096, True)
        assert (quantized.double() - ref).abs().max() > 10 * (exact.double() - ref).abs().max()


@pytest.mark.parametrize("k", [1000, 1040, 1024])
def test_a_layer_quantizes_x_only_where_an_integer_kernel_takes_its_w(k):
    """int8 per output channel: a width of 1024 meets an integer kernel, which quantizes x; 1000 (not
    whole chunks of 32, nor groups of 16) meets none, so x stays float, exact to float rounding;
    1040 (groups of 16, not chunks of 32) meets AVX2's kernel, not VNNI's. The layer asks the kernels
    which, rather than keeping a rule of its own."""
    from kvserve.model.layers.linear import Linear
    from kvserve.model.quant.methods import int8

    kernels = _kernels()
    if not kernels.has_int8_activations():
        pytest.skip("no integer kernels on this CPU")
    torch.manual_seed(5)
    w = torch.randn(48, k) * 0.1
    layer = Linear(k, 48, bias=False, dtype=torch.float32)
    layer.set_method(int8(group=None))
    layer.load_weight("weight", w, None, "proj")
    layer.method.finish_loading(layer)
    x = torch.randn(3, k)
    error = (layer.project(x).double() - x.double() @ layer.method.dense(layer, torch.float32).double().T).abs().max()
    serves = kernels.int8_x_serves(8, k, k, False)
    assert serves == (k == 1024 or (k == 1040 and kernels.vector_bits() == 256))
    assert (error > 1e-3) == serves, error
    assert layer.method.kernel_spec(layer, kernels) is not None


@pytest.mark.parametrize("bits, group, n", [(4, 32, 200), (8, 32, 200), (4, 16, 75), (8, 16, 75)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_few_row_kernel_rows_do_not_depend_on_the_batch(bits, group, n, dtype):
    # Up to 8 rows (a verify step's k + 1 tokens of one request) each row gets bitwise what a 1-row
    # call gives it: verification then scores what plain decoding would.
    kernels = _kernels()
    torch.manual_seed(bits)
    w = torch.randn(n, 576) * 0.05
    q, s, z = (packing.quantize_int4(w, group)[:3] if bits == 4 else (*packing.quantize_int8(w, group), None))
    x = torch.randn(8, 576).to(dtype)
    args = (q, s, z, None, group, bits, 8, 256, 4096, True)
    single = torch.cat([kernels.quant_linear(x[i:i + 1].contiguous(), *args) for i in range(8)])
    for rows in range(2, 9):
        assert torch.equal(kernels.quant_linear(x[:rows].contiguous(), *args), single[:rows])


# ---- strips: W repacked at load for the integer kernels (packing.to_strips) --------------------------
def _strip_kernel_takes(kernels, bits: int) -> bool:
    """Whether this build has a strip kernel for ``bits``: AVX512-VNNI or AVX2, int4 and int8."""
    return kernels.has_int8_activations() and kernels.vector_bits() in (256, 512) and bits in (4, 8)


def _strip_weight(bits: int, group: int, coded: bool, zeros: bool, n: int = 96, k: int = 576, seed: int = 0):
    torch.manual_seed(seed)
    w = torch.randn(n, k) * 0.1
    if bits == 4:
        q, s, z, f = packing.quantize_int4(w, group, coded=coded)
    else:
        q, s = packing.quantize_int8(w, group)
        z, f = ((torch.randn_like(s.float()) * s.float() * 20).half() if zeros else None), None
    return q, s, z, f


@pytest.mark.parametrize("bits, group, coded, zeros", [(4, 32, True, True), (4, 64, False, True), (8, 32, False, False),
                                                       (8, 64, False, True)])
def test_strips_round_trip(bits, group, coded, zeros):
    q, s, z, f = _strip_weight(bits, group, coded, zeros)
    strips = packing.to_strips(q, s, z, f, bits)
    assert strips[0].shape == (6, 18, 256 if bits == 4 else 512) and strips[1].shape == (6, 576 // group, 16)
    for a, b in zip((q, s, z, f), packing.from_strips(*strips, bits)):
        assert (a is None and b is None) or torch.equal(a, b)
    ids = torch.tensor([95, 0, 17, 17])  # an embedding lookup: these rows, in this order
    for a, b in zip((q, s, z, f), packing.from_strips(*strips, bits, ids)):
        assert (a is None and b is None) or torch.equal(a[ids], b)
    dense = packing.dequantize(q, s, z, bits, torch.float32, f)
    assert torch.equal(packing.dequantize_strip_rows(*strips, bits, ids, torch.float32), dense[ids])


@pytest.mark.parametrize("bits, group, coded, zeros", [(4, 32, True, True), (4, 32, False, True), (4, 96, True, True),
                                                       (4, 192, False, True), (8, 32, False, False), (8, 64, False, True)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_strip_kernel_computes_w_dot_quantized_x(bits, group, coded, zeros, dtype):
    """The strips' kernel quantizes x as the row-major few-row kernels do (int8 per 32 inputs) and
    computes w . x_hat. With VNNI, past its rows (and for float32 x) W's tiles are dequantized for
    at::mm; AVX2's kernel takes every number of rows of x of any dtype, and only quantized x."""
    kernels = _kernels()
    if not _strip_kernel_takes(kernels, bits):
        pytest.skip("no strip kernel for this W here (AVX512-VNNI or AVX2)")
    q, s, z, f = _strip_weight(bits, group, coded, zeros)
    strips = packing.to_strips(q, s, z, f, bits)
    ref_w = packing.dequantize(q, s, z, bits, torch.float32, f)
    avx2 = kernels.vector_bits() == 256

    def assert_w_dot_x_hat(y, x, out_eps):
        x_hat, _, tie_step = _int8_blocks(x)
        emulated = x_hat @ ref_w.T
        atol = 1e-5 * (x_hat.abs() @ ref_w.abs().T).max().item()
        assert ((y.float() - emulated).abs() <= tie_step @ ref_w.abs().T * 1.001 + atol + out_eps * emulated.abs()).all()

    out_eps = 2**-8 if dtype == torch.bfloat16 else 2**-11
    for rows in (1, 3, 8, 11):
        x = torch.randn(rows, 576)
        x[:, 7] *= 30  # an outlier input: its chunk's step is large
        x[-1] = 0  # an all-zero row (step 0)
        x = x.to(dtype)
        y = kernels.quant_linear(x, *strips, group, bits, 256, 0, 4096, True)
        assert y.dtype == dtype and y.shape == (rows, 96)
        assert_w_dot_x_hat(y, x, out_eps)
        # the rows past the kernel's (prefill): bf16 / fp16 tiles of W with VNNI, the same kernel on AVX2
        tiled = kernels.quant_linear(x, *strips, group, bits, 0, 0, 4096, True)
        if avx2:
            assert torch.equal(tiled, y)
        ref = x.float() @ ref_w.T
        torch.testing.assert_close(tiled.float(), ref, atol=3e-2 * ref.abs().max().item(), rtol=3e-2)
    x32 = torch.randn(5, 576)
    y32 = kernels.quant_linear(x32, *strips, group, bits, 256, 0, 4096, True)
    if avx2:  # float32 x quantized too
        assert_w_dot_x_hat(y32, x32, 2**-20)
        with pytest.raises(RuntimeError, match="int8 x"):
            kernels.quant_linear(x32, *strips, group, bits, 256, 0, 4096, False)
    else:  # float32 x: dequantized tiles
        torch.testing.assert_close(y32, x32 @ ref_w.T, atol=1e-4, rtol=1e-4)


def test_avx2_strip_kernel_matches_the_row_kernel():
    """On AVX2 strips and rows are two layouts of one product: the same x quantized the same way, the
    sums only reordered; int4 and int8, every row count (decode, a verify step, prefill blocks of 4)."""
    kernels = _kernels()
    if not (kernels.vector_bits() == 256 and kernels.has_int8_activations()):
        pytest.skip("the AVX2 build's kernels")
    for bits, coded, zeros, n, k in ((4, True, True, 96, 576), (4, False, True, 576, 1536), (4, True, True, 208, 64),
                                     (8, False, False, 96, 576), (8, False, True, 208, 64)):
        q, s, z, f = _strip_weight(bits, 32, coded, zeros, n=n, k=k)
        strips = packing.to_strips(q, s, z, f, bits)
        for rows in (1, 2, 5, 9, 70):
            x = torch.randn(rows, k)
            by_rows = kernels.quant_linear(x, q, s, z, f, 32, bits, 1 << 62, 1 << 62, 4096, True)
            by_strips = kernels.quant_linear(x, *strips, 32, bits, 1 << 62, 1 << 62, 4096, True)
            torch.testing.assert_close(by_strips, by_rows, atol=1e-5 * by_rows.abs().max().item(), rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_avx2_integer_kernels_round_y_once(dtype):
    """The AVX2 integer kernels store y in x's dtype as they go: each output is the float32 sum
    rounded once, bitwise what the same x in float32 gives, converted by torch (rows and strips,
    int4 and int8, decode and prefill rows; the huge weights' rows overflow to inf)."""
    kernels = _kernels()
    if not (kernels.vector_bits() == 256 and kernels.has_int8_activations()):
        pytest.skip("the AVX2 build's kernels")
    torch.manual_seed(3)
    for bits in (4, 8):
        q, s, z, f = _strip_weight(bits, 32, False, True, n=96, k=576)
        if dtype == torch.float16:
            s = s.clone()
            s[:8] = 60000.0  # a few channels past float16's range
        layouts = [(q, s, z, f), packing.to_strips(q, s, z, f, bits)]
        for w in layouts:
            for rows in (1, 3, 9):
                x = (torch.randn(rows, 576) * 4).to(dtype)
                y = kernels.quant_linear(x, *w, 32, bits, 1 << 62, 1 << 62, 4096, True)
                y32 = kernels.quant_linear(x.float(), *w, 32, bits, 1 << 62, 1 << 62, 4096, True)
                assert y.dtype == dtype and torch.equal(y, y32.to(dtype))
        if dtype == torch.float16:
            assert y.isinf().any()


@pytest.mark.parametrize("bits", [4, 8])
def test_strip_kernel_rows_do_not_depend_on_the_batch(bits):
    # Every row of x gets bitwise what a 1-row call gives it, whatever the rows around it: a verify
    # step (k + 1 rows of one request) scores what plain decoding would, and decode batches too.
    kernels = _kernels()
    if not _strip_kernel_takes(kernels, bits):
        pytest.skip("no strip kernel for this W here (AVX512-VNNI or AVX2)")
    q, s, z, f = _strip_weight(bits, 32, bits == 4, False, n=208)
    args = (*packing.to_strips(q, s, z, f, bits), 32, bits, 256, 0, 4096, True)
    x = torch.randn(19, 576).bfloat16()
    single = torch.cat([kernels.quant_linear(x[i:i + 1].contiguous(), *args) for i in range(19)])
    for rows in (2, 5, 8, 9, 16, 19):
        assert torch.equal(kernels.quant_linear(x[:rows].contiguous(), *args), single[:rows])


@pytest.mark.parametrize("bits", [4, 8])
def test_strips_serve_a_quantized_layer(bits):
    """A bf16 layer on a CPU with VNNI and without AMX, or on AVX2, keeps W only as strips; its
    products, the embedding lookup and the dense weight read them."""
    from kvserve.model.layers.linear import VocabEmbedding
    from kvserve.model.quant.methods import int4, int8

    kernels = _kernels()
    if not _strip_kernel_takes(kernels, bits) or kernels.has_amx():
        pytest.skip("W is repacked as strips on VNNI CPUs without AMX, and on AVX2")
    torch.manual_seed(0)
    w = torch.randn(64, 96) * 0.1
    layer = VocabEmbedding(64, 96, torch.bfloat16)
    layer.set_method(int4(group=32) if bits == 4 else int8(group=32))
    layer.load_weight("weight", w, None, "embed")
    layer.method.finish_loading(layer)
    assert layer.qweight.shape == (4, 3, 256 if bits == 4 else 512)
    dense = layer.method.dense(layer, torch.float32)
    if bits == 4:
        q, scales, zeros, factors = packing.quantize_int4(w, 32, coded=True)
    else:
        (q, scales), zeros, factors = packing.quantize_int8(w, 32), None, None
    assert torch.equal(dense, packing.dequantize(q, scales, zeros, bits, torch.float32, factors))
    ids = torch.tensor([[3, 63], [17, 3]])
    assert torch.equal(layer(ids), dense.bfloat16()[ids])
    x = torch.randn(2, 96).bfloat16()
    torch.testing.assert_close(layer.project(x).float(), x.float() @ dense.T, atol=0.05, rtol=0.05)


@pytest.mark.parametrize("rows", [1, 2, 4, 5, 40, 300])
def test_dense_bf16_kernel_matches_torch(rows):
    kernels = _kernels()
    torch.manual_seed(0)
    w = (torch.randn(72, 192) * 0.1).bfloat16()
    x = torch.randn(rows, 192).bfloat16()
    y = kernels.dense_linear(x, w, 4)  # the fused loop or at::mm by rows
    ref = torch.nn.functional.linear(x.float(), w.float())
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref, atol=1e-2 * ref.abs().max().item(), rtol=1e-2)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernels.dense_linear(x[:, :48].contiguous(), w[:, :48].contiguous(), 4)


# ---- GGUF blocks ----------------------------------------------------------------------------------
def _random_blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> GGUFBlocks:
    """Random block bytes with sane float16 scale fields, so every value is finite."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    block_values, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(rows * cols // block_values, type_size), dtype=np.uint8)
    half_offsets = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2],
                    "Q5_K": [0, 2], "Q6_K": [208]}[type_name]
    for off in half_offsets:
        data[:, off:off + 2] = (rng.normal(0, 0.01, size=data.shape[0]).astype(np.float16)
                                .view(np.uint8).reshape(-1, 2))
    return GGUFBlocks(data.reshape(rows, -1), qtype, (rows, cols))


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_gguf_blocks_decode_exactly(type_name):
    blocks = _random_blocks(type_name, rows=6, cols=512)
    reference = blocks.dequantize()
    dec = gguf_blocks.decode(blocks)
    group_rep = 512 // dec.scale.shape[1]
    decoded = dec.q.astype(np.float32) * np.repeat(dec.scale, group_rep, axis=1)
    if dec.zero is not None:
        decoded = decoded + np.repeat(dec.zero, group_rep, axis=1)
    np.testing.assert_allclose(decoded, reference.numpy(), rtol=1e-6, atol=1e-7)
    # ... and the kernel layout (float16 scales: exact for legacy types, 2^-11 relative for K-quants)
    bits, group, zeros = gguf_blocks.native_layout({type_name})
    q, s, z = gguf_blocks.to_group_layout(blocks, bits, group, zeros)
    packed = packing.dequantize(q, s, z, bits, torch.float32)
    tol = 0 if type_name in ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1") else 2e-3
    torch.testing.assert_close(packed, reference, rtol=tol, atol=tol * reference.abs().max().item() + 1e-8)


def test_gguf_native_layouts():
    assert gguf_blocks.native_layout({"Q4_1"}) == (4, 32, True)
    assert gguf_blocks.native_layout({"Q4_K", "Q4_0"}) == (4, 32, True)
    assert gguf_blocks.native_layout({"Q8_0"}) == (8, 32, False)
    assert gguf_blocks.native_layout({"Q4_K", "Q6_K"}) == (8, 16, True)  # mixed shards of a fused layer
    assert gguf_blocks.native_layout({"Q4_K", "F16"}) is None
    blocks = _random_blocks("Q6_K", 2, 256)
    assert gguf_blocks.to_group_layout(blocks, 4, 32, True) is None  # 6-bit values do not fit int4
    assert gguf_blocks.to_group_layout(blocks, 8, 32, False) is None  # scales per 16 do not fit groups of 32


def test_gguf_blocks_rows_and_permutation():
    from kvserve.model.gguf_file import _unpermute_qk

    blocks = _random_blocks("Q4_1", rows=8, cols=64)
    dense = blocks.dequantize()
    torch.testing.assert_close(_unpermute_qk(blocks, 2).dequantize(), _unpermute_qk(dense, 2))
    torch.testing.assert_close(blocks[2:5].dequantize(), dense[2:5])


# ---- KV cache formats ------------------------------------------------------------------------------
@pytest.mark.parametrize("name, rel", [("int8", 1 / 254), ("fp8", 1 / 16)])
def test_kv_quant_round_trip(name, rel):
    fmt = KVQuantFormat(name)
    x = torch.randn(10, 3, 64) * torch.logspace(-3, 2, 10)[:, None, None]  # rows of very different scale
    rows = fmt.quantize(x)
    assert rows.dtype == torch.uint8 and rows.shape == (10, 3, 66)
    back = fmt.dequantize(rows, torch.float32)
    amax = x.abs().amax(dim=-1, keepdim=True)
    err = (back - x).abs()
    bound = amax * rel * 1.01 if name == "int8" else torch.maximum(x.abs() * rel, amax * 2**-9) * 1.01
    assert (err <= bound + 1e-12).all()


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_kernel_reads_quantized_cache(kv_dtype, dtype):
    from kvserve.model.attention.torch_sdpa import TorchAttentionBackend
    from kvserve.model.cpu_kernels import load_kernels as load_cpu_kernels
    from tests.unit.test_attention_backend import _decode_meta

    if load_cpu_kernels() is None:
        pytest.skip("C++ kernels could not be built on this machine")
    torch.manual_seed(0)
    lens, bs, dim, heads, kv_heads = [1, 5, 16, 17, 90, 33], 8, 32, 8, 2
    meta = _decode_meta(lens, bs, num_blocks=64)
    fast = TorchAttentionBackend(kv_cache_dtype=kv_dtype)
    ref = TorchAttentionBackend(use_kernels=False, kv_cache_dtype=kv_dtype)
    exact = TorchAttentionBackend(use_kernels=False)
    dense = torch.randn(2, 64, bs, kv_heads, dim)
    cache = KVQuantFormat(kv_dtype).quantize(dense)
    q = torch.randn(len(lens), heads, dim).to(dtype)
    k = torch.randn(len(lens), kv_heads, dim).to(dtype)
    v = torch.randn(len(lens), kv_heads, dim).to(dtype)
    out_fast = fast.forward(q, k, v, cache.clone(), meta, dim**-0.5)
    out_ref = ref.forward(q, k, v, cache.clone(), meta, dim**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out_fast.float(), out_ref.float(), atol=tol, rtol=tol)
    # and close to attention over the unquantized cache
    out_exact = exact.forward(q, k, v, dense.to(dtype), meta, dim**-0.5)
    assert (out_fast.float() - out_exact.float()).abs().max() < (0.05 if kv_dtype == "int8" else 0.15)


def test_vector_bits_names_the_build():
    """``vector_bits`` picks the quantized kernels' row limits (methods._max_fused_rows, _max_mid_rows):
    256 only for the AVX2 build, which has no bf16 arithmetic and packs dense bf16 weights as float32
    strips."""
    kernels = _kernels()
    bits = kernels.vector_bits()
    assert bits in (0, 256, 512)
    if os.environ.get("KVSERVE_CPU_TARGET", "native").startswith("avx2"):  # built for AVX2 on any x86 CPU
        assert bits == 256 and kernels.has_int8_activations()
    if bits == 256:
        assert not kernels.native_bf16() and not kernels.has_amx() and kernels.packed_linear_supported()
    if bits == 0:
        assert not kernels.packed_linear_supported()


@pytest.mark.parametrize("bits, group, coded, zeros", [(4, 32, True, True), (4, 64, False, True), (4, 16, True, True),
                                                       (8, 32, False, False), (8, 64, False, True), (8, 96, False, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quant_embed_is_the_dequantized_rows(bits, group, coded, zeros, dtype):
    """The C++ embedding lookup gives bitwise the rows of packing.dequantize, from rows and from strips;
    an id outside the table is an error, not a read past it."""
    kernels = _kernels()
    q, s, z, f = _strip_weight(bits, group, coded, zeros, n=64, k=192)
    dense = packing.dequantize(q, s, z, bits, torch.float32, f).to(dtype)
    ids = torch.tensor([[63, 0, 17], [17, 5, 40]])
    assert torch.equal(kernels.quant_embed(q, s, z, f, bits, ids, dtype), dense[ids.reshape(-1)])
    if group % 32 == 0:
        strips = packing.to_strips(q, s, z, f, bits)
        assert torch.equal(kernels.quant_embed(*strips, bits, ids, dtype), dense[ids.reshape(-1)])
    with pytest.raises(RuntimeError, match="outside the table"):
        kernels.quant_embed(q, s, z, f, bits, torch.tensor([64]), dtype)
