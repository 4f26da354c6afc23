"""The built-in methods: dense float, and weight-only int8 / int4 with per-group scales.

``GroupQuant`` stores ``w = q * scale + zero`` with a scale (and zero point) per ``group`` inputs
of each output row, as float16 or as 8-bit codes (see packing.py for the layouts). One class covers:
  - "int8": symmetric, float16 scales per group of 32 (or per output channel), round to nearest;
  - "int4": asymmetric (scale + zero point), groups of 16/32/64/128, coded scales and zeros, round
    to nearest (optionally after a clip search) at load;
  - GGUF blocks kept in their own quantization: Q4_0/Q4_1/Q4_K as int4 groups of 32, and
    Q8_0/Q5_0/Q5_1/Q5_K (groups of 32) and Q6_K (groups of 16) as int8, all exact (gguf_blocks.py).
On the CPU the C++ kernels in csrc/quant_linear.cpp apply it; elsewhere (or without a compiler)
the weight is dequantized per call and multiplied with torch (correct, not fast). On a CPU with
AVX512-VNNI and without AMX, and on AVX2, the loaded weight is repacked as strips
(packing.to_strips) for them.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kvserve.model.cpu_kernels import load_kernels
from kvserve.model.quant import gguf_blocks, packing
from kvserve.model.quant.registry import CheckpointTensor, InputSlice, QuantMethod, register_quant_method

# Quantized W, three CPU paths by rows of x (crossovers timed per layer on an AMX CPU, one thread):
# up to _MAX_FUSED_ROWS the fused dequantize+dot kernel (reads each weight once); then, for bf16, AMX
# tiles of W dequantized in registers (no per-call weight reorder, faster than at::mm for 8-128 rows);
# beyond _MAX_AMX_ROWS (prefill) L2-sized dequantized tiles + at::mm. AVX2 CPUs have
# float32 panels of W as their middle path, for every batch (_MAX_PANEL_ROWS_AVX2, below).
# bf16 on AMX: the fused kernel up to 8 rows, which covers speculative verification (k + 1 rows of one
# request) and small decode batches. On the default model's GGUF layers (30 layers, one thread) it took
# 4.5 ms at 1 row, 15 at 5, 18 at 8, against the AMX tiles' 17.7 ms at 1 row and 18 at 5 or 8: the AMX path
# pays for dequantizing all of W whatever the rows. Keeping verification on the decode kernel also
# gives each verified row bitwise the result a plain decode step of that token gets.
_MAX_FUSED_ROWS = {torch.float32: 64, torch.bfloat16: 8, torch.float16: 4}
_MAX_AMX_ROWS = 256
# Without AMX, bf16 rows past the fused kernel go to the dequantized tiles + at::mm, which the fused
# kernel beats up to 16-24 rows on the default model's GGUF layers (4x at 4 rows, even by 32).
_MAX_FUSED_ROWS_WITHOUT_AMX = 16
# W repacked as strips (VNNI without AMX, GroupQuant._strips_wanted): the strips' kernel runs 16-bit x
# up to here. On the default model's layers (Zen 5, two threads) it took half the time of the
# dequantized tiles + at::mm at 8-64 rows and 0.7-0.8x at 128-256, even at 512; prefill chunks past
# this keep at::mm on bf16 tiles of W.
_MAX_STRIP_ROWS = 256
# AVX2 (no AVX-512) with float activations: x of any dtype is multiplied in float32, by the fused
# kernel up to 8 rows, then against float32 panels of W for every batch (csrc/quant_linear.cpp): on
# the default model's GGUF layers the panels overtake the fused kernel at about 8 rows.
_MAX_FUSED_ROWS_AVX2 = 8
# AVX2 with int8 activations: the integer kernel (csrc/quant_linear_avx2.cpp) for every number of rows,
# faster than both the fused loop and the float32 panels at every size measured (1 to 1,024 rows).
_MAX_INT_ROWS_AVX2 = 1 << 62
_MAX_PANEL_ROWS_AVX2 = 1 << 62
# Dense bf16 W on a CPU with AVX512-BF16: W is kept only in the AMX tile layout
# (layers/csrc/packed_linear.cpp), packed at load; its kernel serves every number of rows, on AMX
# tiles where the CPU has them; it is faster than oneDNN on W as stored at every size, on AMX and on
# vdpbf16ps alike (docs/cpu-kernels.md).
# Dense bf16 W not packed (AVX-512 without BF16, e.g. Skylake-SP; AVX512-BF16 and AVX2 CPUs pack it):
# the fused kernel up to here, then float32 tiles of W through at::mm (oneDNN's bf16 matmul emulates
# bf16 there). The crossover (the fused kernel ahead up to ~64 rows, even by 128) was timed with the
# AVX2 fused kernel, not on an AVX-512 CPU without BF16.
_MAX_DENSE_FUSED_ROWS = 64
_TILE_BYTES = 1 << 21  # a dequantized tile of W that stays in L2 while at::mm reads it
_LOAD_CHUNK_VALUES = 1 << 18


# The compiled matmul kernels, or None where they cannot be built (a cached call: every linear, every step).
load_quant_kernels = load_kernels


@functools.cache
def _max_mid_rows() -> int:
    """Rows of x up to which the CPU's mid-size kernel runs (AMX tiles for bf16 x, or float32 panels of
    W on AVX2), beyond them dequantized tiles of W + at::mm."""
    kernels = load_quant_kernels()
    return _MAX_PANEL_ROWS_AVX2 if kernels is not None and kernels.vector_bits() == 256 else _MAX_AMX_ROWS


def _few_rows(qweight: torch.Tensor, dtype: torch.dtype, int8_activations: bool) -> int:
    """The few-row kernels' row limit for this stored W: the strips' own (VNNI; AVX2's strip kernel
    takes every number of rows), else _max_fused_rows."""
    return _MAX_STRIP_ROWS if qweight.dim() == 3 else _max_fused_rows(dtype, int8_activations)


@functools.cache
def _max_fused_rows(dtype: torch.dtype, int8_activations: bool) -> int:
    """Rows of x up to which the few-row kernels run (the fused dequantize+dot loop, or the integer
    kernels for int8 activations), for x of ``dtype`` on this CPU."""
    kernels = load_quant_kernels()
    if kernels is not None and kernels.vector_bits() == 256:
        return _MAX_INT_ROWS_AVX2 if int8_activations else _MAX_FUSED_ROWS_AVX2
    if dtype == torch.bfloat16 and kernels is not None and not kernels.has_amx():
        return _MAX_FUSED_ROWS_WITHOUT_AMX
    return _MAX_FUSED_ROWS.get(dtype, 8)


def _dest_rows(layer, rows: tuple[int, int] | None) -> tuple[int, int]:
    return rows if rows is not None else (0, layer.out_features)


@register_quant_method("dense")
class Dense(QuantMethod):
    """W kept as a float matrix in the layer's dtype; GGUF blocks are dequantized at load."""

    name = "dense"

    def create_weights(self, layer) -> None:
        weight = torch.empty(layer.out_features, layer.in_features, dtype=layer.dtype)
        layer.weight = torch.nn.Parameter(weight, requires_grad=False)
        layer.packed_gated = False  # finish_loading may add a packed copy (gated or not)

    def weight_names(self) -> tuple[str, ...]:
        return ("weight", "weight_packed")

    def load(self, layer, tensor: CheckpointTensor, rows: tuple[int, int] | None) -> None:
        start, count = _dest_rows(layer, rows)
        dense = tensor if isinstance(tensor, torch.Tensor) else tensor.dequantize()
        layer.weight.data[start:start + count].copy_(dense)

    def finish_loading(self, layer) -> None:
        w = layer.weight
        kernels = load_quant_kernels() if w.device.type == "cpu" and w.dtype == torch.bfloat16 else None
        if kernels is not None and layer.in_features % 32 == 0 and kernels.packed_linear_supported():
            # A gated layer's copy can also write SiLU(gate) * up itself (project_silu_mul).
            layer.packed_gated = layer.gated and layer.out_features % 32 == 0
            layer.register_buffer("weight_packed", kernels.pack_bf16_weight(w.data.contiguous(), layer.packed_gated))
            if not layer.row_lookup:  # the packed copy serves every product; only embeddings read rows of W
                del layer.weight

    def _packed(self, layer, x: torch.Tensor, silu_mul: bool) -> torch.Tensor | None:
        """x through the packed copy (SiLU(gate) * up if ``silu_mul``), or None if the layer has none."""
        packed = layer._buffers.get("weight_packed")
        if packed is None:
            return None
        if x.device.type != "cpu" or x.dtype != torch.bfloat16:
            raise ValueError(f"this layer's weight is packed for bfloat16 inputs on the CPU, got {x.dtype} on {x.device}")
        flat = x if x.dim() == 2 else x.reshape(-1, layer.in_features)
        y = load_quant_kernels().packed_linear(flat.contiguous(), packed, layer.out_features, layer.packed_gated,
                                               silu_mul)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])

    def apply_silu_mul(self, layer, x: torch.Tensor) -> torch.Tensor:
        if layer.packed_gated:  # its packed copy writes SiLU(gate) * up itself
            return self._packed(layer, x, silu_mul=True)
        return super().apply_silu_mul(layer, x)

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        y = self._packed(layer, x, silu_mul=False)
        if y is not None:
            return y
        w = layer._parameters["weight"]  # not layer.weight: nn.Module's attribute lookup costs µs per call
        if x.device.type == "cpu" and w.dtype == torch.bfloat16 and x.dtype == torch.bfloat16 and layer.in_features % 32 == 0:
            kernels = load_quant_kernels()
            if kernels is not None:  # reached only where W is not packed (neither AVX512-BF16 nor AVX2)
                flat = x if x.dim() == 2 else x.reshape(-1, layer.in_features)
                y = kernels.dense_linear(flat.contiguous(), w, _MAX_DENSE_FUSED_ROWS)
                return y if x.dim() == 2 else y.reshape(*x.shape[:-1], layer.out_features)
        return F.linear(x, w)

    def kernel_spec(self, layer, kernels):
        bias = layer.bias
        packed = layer._buffers.get("weight_packed")
        if packed is not None:
            return kernels.LinearSpec(3, packed, bias=bias, out_features=layer.out_features, gated=layer.packed_gated)
        w = layer._parameters["weight"]
        if w.dtype == torch.bfloat16 and layer.in_features % 32 == 0:
            return kernels.LinearSpec(0, w, bias=bias, max_fused_rows=_MAX_DENSE_FUSED_ROWS)
        return kernels.LinearSpec(2, w, bias=bias)

    def embed(self, layer, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, layer.weight)


class GroupQuant(QuantMethod):
    """Weight-only quantization: ``bits`` 8 or 4, a scale (+ zero point) per ``group`` inputs.

    ``group=None`` means one group per row (per output channel). A layer whose input size the group
    does not divide uses the largest power-of-two fraction of it that does (e.g. 128 -> 64 for K=576).
    ``coded``: scales and zeros as 8-bit codes of a per-row step instead of float16 (int4 only, 0.5
    bits per weight less at groups of 32); ``search``: pick each group's clipping range by rounding
    error rather than taking its [min, max] (int4 only). ``int8_activations``: x may be quantized to
    int8 per 32 inputs and multiplied in integers where the CPU has such a kernel (few rows with
    AVX512-VNNI, every batch on AVX2; QuantConfig.activation_quantization); else it stays float and
    each weight is dequantized.
    """

    def __init__(self, bits: int, group: int | None, zeros: bool, coded: bool = False, search: bool = False,
                 int8_activations: bool = True) -> None:
        if bits not in (4, 8):
            raise ValueError(f"bits={bits} must be 4 or 8")
        if bits == 4 and (group is None or group % 16):
            raise ValueError(f"int4 group size {group} must be a multiple of 16")
        if bits == 8 and (coded or search):
            raise ValueError("coded parameters and the clip search are for int4 only")
        self.bits, self.group, self.has_zeros = bits, group, zeros or bits == 4
        self.coded, self.search, self.int8_activations = coded, search, int8_activations
        self.name = (f"int{bits}" + (f"-g{group}" if group else "") + ("-coded" if coded else "")
                     + ("-clip" if search else ""))

    @staticmethod
    def group_for(in_features: int, group: int | None, bits: int) -> int | None:
        """The group size a layer with ``in_features`` inputs uses, or None if it cannot be quantized."""
        if group is None:
            return in_features
        while group > 16 and in_features % group:
            group //= 2
        fits = group >= 16 and group % 16 == 0 and in_features % group == 0
        return group if fits and (bits == 8 or in_features % 32 == 0) else None

    def layer_group(self, layer) -> int:
        group = self.group_for(layer.in_features, self.group, self.bits)
        if group is None:
            raise ValueError(f"{self.name} cannot hold a weight with {layer.in_features} inputs")
        return group

    def create_weights(self, layer) -> None:
        n, k = layer.out_features, layer.in_features
        groups = k // self.layer_group(layer)
        if self.bits == 4:
            layer.register_buffer("qweight", torch.empty(n, k // 2, dtype=torch.uint8))
        else:
            layer.register_buffer("qweight", torch.empty(n, k, dtype=torch.int8))
        scale_dtype, zero_dtype = (torch.uint8, torch.int8) if self.coded else (torch.float16, torch.float16)
        layer.register_buffer("scales", torch.empty(n, groups, dtype=scale_dtype))
        layer.register_buffer("zeros", torch.empty(n, groups, dtype=zero_dtype) if self.has_zeros else None)
        layer.register_buffer("factors", torch.empty(n, 2, dtype=torch.float32) if self.coded else None)

    def weight_names(self) -> tuple[str, ...]:
        return ("qweight", "scales", "zeros", "factors")

    def load(self, layer, tensor: CheckpointTensor, rows: tuple[int, int] | None) -> None:
        if self.search:  # weighted by the layer's input importance, known once everything is loaded
            dense = tensor if isinstance(tensor, torch.Tensor) else tensor.dequantize()
            layer._pending_weights = [*getattr(layer, "_pending_weights", []), (dense.float(), rows)]
            return
        self._store(layer, tensor, rows)

    def finish_loading(self, layer) -> None:
        for dense, rows in getattr(layer, "_pending_weights", []):
            self._store(layer, dense, rows)
        layer._pending_weights = []
        if self._strips_wanted(layer):
            strips = packing.to_strips(layer.qweight, layer.scales, layer.zeros, layer.factors, self.bits)
            for name, tensor in zip(("qweight", "scales", "zeros", "factors"), strips):
                setattr(layer, name, tensor)

    def _strips_wanted(self, layer) -> bool:
        """Whether to repack W as strips (packing.to_strips) for the integer kernels: on a CPU with
        AVX512-VNNI and without AMX for 16-bit activations (AMX CPUs keep rows: their kernel past the
        few rows, AMX tiles, reads W by rows; the strips' other paths, prefill and float32 x,
        dequantize tiles of W for at::mm, as rows do); on AVX2, whose strip kernels serve every number
        of rows of x of any dtype."""
        kernels = load_quant_kernels()
        if not (self.int8_activations and kernels is not None and layer.qweight.device.type == "cpu"
                and kernels.has_int8_activations()
                and layer.out_features % 16 == 0 and layer.in_features % 32 == 0 and self.layer_group(layer) % 32 == 0):
            return False
        if kernels.vector_bits() == 256:
            return self.bits in (4, 8)
        return kernels.vector_bits() == 512 and not kernels.has_amx() and layer.dtype in (torch.bfloat16, torch.float16)

    def _rows(self, layer, rows: torch.Tensor | None = None):
        """(qweight, scales, zeros, factors) in the row-major layout: every row, or ``rows``."""
        if layer.qweight.dim() == 3:
            return packing.from_strips(layer.qweight, layer.scales, layer.zeros, layer.factors, self.bits, rows)
        if rows is None:
            return layer.qweight, layer.scales, layer.zeros, layer.factors
        return tuple(None if t is None else t[rows] for t in (layer.qweight, layer.scales, layer.zeros, layer.factors))

    def _store(self, layer, tensor: CheckpointTensor, rows: tuple[int, int] | None) -> None:
        group = self.layer_group(layer)
        start, count = _dest_rows(layer, rows)
        # A few rows at a time: small temporaries are recycled by the allocator, while big ones are
        # fresh pages every time (page faults dominate loading otherwise).
        step = max(1, _LOAD_CHUNK_VALUES // layer.in_features)
        for first in range(0, count, step):
            last = min(first + step, count)
            q, scales, zeros, factors = self._convert(layer, tensor[first:last], group)
            dest = slice(start + first, start + last)
            layer.qweight[dest].copy_(q)
            layer.scales[dest].copy_(scales)
            if self.has_zeros:
                layer.zeros[dest].copy_(zeros if zeros is not None else torch.zeros_like(scales))
            if self.coded:
                layer.factors[dest].copy_(factors)

    def _convert(self, layer, tensor: CheckpointTensor, group: int):
        """(qweight, scales, zeros, factors) rows for a float tensor or GGUF blocks: exact for blocks
        this layout holds (gguf_blocks.py), else dequantize and round to nearest."""
        if isinstance(tensor, InputSlice):
            return self._convert_columns(layer, tensor, group)
        if not isinstance(tensor, torch.Tensor):
            packed = None if self.coded else gguf_blocks.to_group_layout(tensor, self.bits, group, self.has_zeros)
            if packed is not None:
                return (*packed, None)
            tensor = tensor.dequantize()
        return self.quantize(layer, tensor, group)

    def _convert_columns(self, layer, part: InputSlice, group: int):
        """A rank's columns of a row-parallel layer as the whole layer would store them: quantize full
        rows with the whole layer's group, then keep this rank's groups (per-row parameters, such as
        coded steps or per-channel scales, stay the whole row's). Where the whole layer's group does
        not fall on this rank's boundaries, the columns are quantized on their own."""
        full_in = part.full.shape[1]
        whole = self.group_for(full_in, self.group, self.bits)
        per_row = whole == full_in and group == layer.in_features  # one group per row, in both
        if whole is None or not (per_row or (whole == group and part.start % group == 0)):
            return self._convert(layer, part.dequantize(), group)
        q, scales, zeros, factors = self._convert(layer, part.full, whole)
        per_byte = 2 if self.bits == 4 else 1  # pack_int4 keeps each 32-column chunk in its own 16 bytes
        q = q[:, part.start // per_byte:(part.start + part.length) // per_byte]
        if not per_row:
            cut = slice(part.start // group, (part.start + part.length) // group)
            scales = scales[:, cut]
            zeros = None if zeros is None else zeros[:, cut]
        return q.contiguous(), scales.contiguous(), None if zeros is None else zeros.contiguous(), factors

    def quantize(self, layer, w: torch.Tensor, group: int):
        if self.bits == 4:
            importance = layer.input_importance() if self.search and layer.input_importance else None
            return packing.quantize_int4(w, group, coded=self.coded, search=self.search, importance=importance)
        q, scales = packing.quantize_int8(w, group)
        return q, scales, None, None

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        kernels = load_quant_kernels() if x.device.type == "cpu" else None
        flat = x.reshape(-1, layer.in_features)
        if kernels is None:
            y = F.linear(flat, self.dense(layer, x.dtype))
        else:
            # The weight tensors and their layout, gathered once: per call it cost more than a small layer's
            # whole decode matmul (module attribute lookups, the group size search).
            call = layer.__dict__.get("_kernel_call")
            if call is None or call[0][0] is not layer._buffers["qweight"]:  # first call, or tensors rebound
                args = (layer.qweight, layer.scales, layer.zeros, layer.factors, self.layer_group(layer), self.bits)
                call = layer._kernel_call = (args, self._int8_x(layer, kernels))
            args, int8_x = call
            y = kernels.quant_linear(flat.contiguous(), *args, _few_rows(args[0], x.dtype, int8_x), _max_mid_rows(),
                                     _TILE_BYTES, int8_x)
        return y.reshape(*x.shape[:-1], layer.out_features)

    def _int8_x(self, layer, kernels) -> bool:
        """Whether this layer's x is quantized: asked for, and an integer kernel takes W's layout (the
        kernels say; one that none takes, say int8 per channel of an odd width, keeps the float loop
        and its row limits)."""
        return self.int8_activations and kernels.int8_x_serves(self.bits, self.layer_group(layer), layer.in_features,
                                                               layer.factors is not None)

    def kernel_spec(self, layer, kernels):
        int8_x = self._int8_x(layer, kernels)
        return kernels.LinearSpec(1, layer.qweight, layer.scales, layer.zeros, layer.factors, layer.bias,
                                  self.layer_group(layer), self.bits, _few_rows(layer.qweight, layer.dtype, int8_x),
                                  _max_mid_rows(), _TILE_BYTES, quantize_x=int8_x)

    def dense(self, layer, dtype: torch.dtype) -> torch.Tensor:
        q, scales, zeros, factors = self._rows(layer)
        return packing.dequantize(q, scales, zeros, self.bits, dtype, factors)

    def embed(self, layer, ids: torch.Tensor) -> torch.Tensor:
        kernels = load_quant_kernels() if layer.qweight.device.type == "cpu" else None
        if kernels is not None:  # one call, bitwise the tensor ops below
            rows = kernels.quant_embed(layer.qweight, layer.scales, layer.zeros, layer.factors, self.bits, ids, layer.dtype)
            return rows.reshape(*ids.shape, layer.in_features)
        flat = ids.reshape(-1)
        if layer.qweight.dim() == 3:
            rows = packing.dequantize_strip_rows(layer.qweight, layer.scales, layer.zeros, layer.factors, self.bits,
                                                 flat, layer.dtype)
        else:
            q, scales, zeros, factors = self._rows(layer, flat)
            rows = packing.dequantize(q, scales, zeros, self.bits, layer.dtype, factors)
        return rows.reshape(*ids.shape, layer.in_features)


@register_quant_method("int8")
def int8(group: int | None = None, zeros: bool = False, int8_activations: bool = True) -> GroupQuant:
    return GroupQuant(8, group, zeros, int8_activations=int8_activations)


@register_quant_method("int4")
def int4(group: int = 32, coded: bool = True, search: bool = False, int8_activations: bool = True) -> GroupQuant:
    return GroupQuant(4, group, True, coded, search, int8_activations)
