"""Bytes per parameter for each dtype and quantization scheme, and the model's weight bytes.

A quantized weight costs its bits plus the scales (and zero points) stored per group of inputs,
so every scheme is written as (bits, group size, scale bytes per group): int8 per output channel,
int4 with 128-wide groups, GGUF's 32-wide blocks (Q4_1 = 20 bytes per 32 weights), K-quant
super-blocks of 256. Embeddings and the output head stay in the model dtype for the torch-style
schemes and use Q8_0 for the GGUF ones, as llama.cpp does for the bundled model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvserve.planner.shape import Inventory, Matrix

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
                  "half": "float16"}
KV_DTYPE_BYTES = {**DTYPE_BYTES, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1}


def canonical_dtype(name: str) -> str:
    """Map an alias (bf16, fp16, fp32) to the engine's dtype name; reject anything else."""
    name = _DTYPE_ALIASES.get(name.lower(), name.lower())
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype={name!r} is not supported; choose one of {sorted(DTYPE_BYTES)}")
    return name


def kv_dtype_bytes(kv_cache_dtype: str, dtype: str) -> float:
    """Bytes per cached K or V element; 'auto' stores the cache in the model dtype."""
    if kv_cache_dtype == "auto":
        return DTYPE_BYTES[canonical_dtype(dtype)]
    name = _DTYPE_ALIASES.get(kv_cache_dtype.lower(), kv_cache_dtype.lower())
    if name not in KV_DTYPE_BYTES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not supported; choose 'auto' or one of "
                         f"{sorted(KV_DTYPE_BYTES)}")
    return KV_DTYPE_BYTES[name]


@dataclass(frozen=True)
class QuantScheme:
    """How a linear weight is stored: ``bits`` per weight plus ``scale_bytes`` per group of inputs."""

    name: str
    bits: int | None  # None: stored unquantized in the model dtype
    group_size: int | None = None  # None: one scale per output row (per channel)
    scale_bytes: int = 0
    embeddings: str | None = None  # scheme for embeddings / lm_head; None keeps them in the model dtype
    norms_fp32: bool = False  # GGUF keeps norms in float32
    compute: str = "dtype"  # "fp8" when activations are fp8 too (W8A8), so fp8 tensor cores apply


QUANT_SCHEMES: dict[str, QuantScheme] = {s.name: s for s in (
    QuantScheme("none", None),
    QuantScheme("int8", 8, None, 2),
    QuantScheme("fp8", 8, None, 4, compute="fp8"),
    QuantScheme("int4", 4, 128, 4),  # fp16 scale + fp16 zero point per 128 weights (GPTQ/AWQ-like)
    QuantScheme("q8_0", 8, 32, 2, "q8_0", True),
    QuantScheme("q4_0", 4, 32, 2, "q8_0", True),
    QuantScheme("q4_1", 4, 32, 4, "q8_0", True),
    QuantScheme("q5_0", 5, 32, 2, "q8_0", True),
    QuantScheme("q5_1", 5, 32, 4, "q8_0", True),
    QuantScheme("q4_k", 4, 256, 16, "q8_0", True),
    QuantScheme("q5_k", 5, 256, 16, "q8_0", True),
    QuantScheme("q6_k", 6, 256, 18, "q8_0", True),
)}


def quant_scheme(name: str) -> QuantScheme:
    key = name.lower()
    if key not in QUANT_SCHEMES:
        raise ValueError(f"quantization={name!r} is not supported; choose one of {list(QUANT_SCHEMES)}")
    return QUANT_SCHEMES[key]


def matrix_bytes(rows: int, cols: int, count: int, scheme: QuantScheme, dtype_bytes: int) -> int:
    """Bytes of ``count`` rows x cols weights: packed values plus one scale set per group in each row."""
    if scheme.bits is None:
        return rows * cols * count * dtype_bytes
    groups = math.ceil(cols / (scheme.group_size or cols))
    return count * rows * (math.ceil(cols * scheme.bits / 8) + groups * scheme.scale_bytes)


@dataclass(frozen=True)
class WeightBytes:
    """Weight memory split by how decoding reads it."""

    dense_linear: int  # read in full every step
    routed_linear: int  # MoE experts: a step reads only those its tokens were routed to
    embedding: int  # the input table: a step reads one row per token, unless tied to the head
    lm_head: int  # read in full every step (0 when tied; then the embedding is the head)
    vectors: int  # norms and biases

    @property
    def total(self) -> int:
        return self.dense_linear + self.routed_linear + self.embedding + self.lm_head + self.vectors


def weight_bytes(inv: Inventory, dtype: str, quantization: str = "none") -> WeightBytes:
    """Bytes of every parameter for the model ``dtype`` and a quantization scheme."""
    scheme, width = quant_scheme(quantization), DTYPE_BYTES[canonical_dtype(dtype)]
    embed_scheme = quant_scheme(scheme.embeddings or "none")
    return WeightBytes(
        dense_linear=sum(_bytes(m, scheme, width) for m in inv.matrices if not m.routed),
        routed_linear=sum(_bytes(m, scheme, width) for m in inv.matrices if m.routed),
        embedding=_bytes(inv.embedding, embed_scheme, width),
        lm_head=_bytes(inv.lm_head, embed_scheme, width),
        vectors=inv.vector_params * (4 if scheme.norms_fp32 else width),
    )


def _bytes(m: Matrix, scheme: QuantScheme, width: int) -> int:
    return matrix_bytes(m.rows, m.cols, m.count, scheme, width)
