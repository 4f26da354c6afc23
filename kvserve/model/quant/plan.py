"""Which quantization method each Linear of a freshly built model gets, from the user's option.

``quantization``:
  None     keep a GGUF file's own block quantization (each layer in the int4/int8 layout that holds
           its blocks exactly, float tensors dense); float checkpoints stay dense in ``dtype``;
  "none"   everything dense in ``dtype`` (GGUF blocks dequantized at load);
  "int8"   weight-only int8, symmetric, a float16 scale per ``group_size`` inputs (default 32, as
           llama.cpp's Q8_0; -1 = one scale per output channel), round to nearest. On the bundled
           model per-channel scales keep greedy output identical on 7 of 20 prompts, groups of 32 on
           most of them, for 0.03x of bf16's bytes more (benchmarks/quantization.md);
  "int4"   weight-only int4 with zero points, groups of ``group_size`` (default 32: the bundled
           model is itself a Q4_1 checkpoint, and coarser groups re-quantize its 32-wide blocks:
           perplexity +37% at 128 against +0.1% at 32), scales and zeros as 8-bit codes (4.5 bits
           per weight at 32). The vocabulary embedding, which doubles as the tied output head, is
           the most sensitive matrix: it gets groups of 16 and a clip search (+4% perplexity on the
           bundled model, against +6% for plain groups of 32), and the whole model stays under 0.3x
           its bf16 bytes.
"""

from __future__ import annotations

import logging

import torch

from kvserve.config import QuantConfig
from kvserve.model.layers.linear import Linear, VocabEmbedding
from kvserve.model.quant import gguf_blocks
from kvserve.model.quant.methods import GroupQuant
from kvserve.model.quant.registry import QuantMethod, get_quant_method

log = logging.getLogger(__name__)

DEFAULT_INT4_GROUP = 32
DEFAULT_INT8_GROUP = 32
INT4_EMBEDDING_GROUP = 16
PER_CHANNEL = -1  # group_size meaning one scale per output channel


def assign_quant_methods(model: torch.nn.Module, quant: QuantConfig,
                         gguf_types: dict[str, str] | None = None) -> None:
    """Give every Linear of ``model`` its method (call before loading weights).

    ``gguf_types`` maps HF tensor names to GGML type names when the checkpoint is a GGUF file. The
    quantized methods may quantize few rows of x to int8 (GroupQuant) unless
    ``quant.activation_quantization`` is "none" (loader.resolve_auto resolves "auto"; unresolved it means int8).
    """
    quantization, group_size = quant.quantization, quant.group_size
    int8_activations = quant.activation_quantization != "none"
    for name, layer in model.named_modules():
        if isinstance(layer, Linear) and layer.quantizable:
            method = _method_for(name, layer, quantization, group_size, gguf_types, int8_activations)
            if method is not None:
                layer.set_method(method)


def _method_for(name: str, layer: Linear, quantization: str | None, group_size: int | None,
                gguf_types: dict[str, str] | None, int8_activations: bool) -> QuantMethod | None:
    if quantization is None:
        return _native(name, layer, gguf_types, int8_activations) if gguf_types else None
    if quantization == "none":
        return None
    if quantization == "int8":
        group = None if group_size == PER_CHANNEL else GroupQuant.group_for(
            layer.in_features, group_size or DEFAULT_INT8_GROUP, 8)
        # no group fits: one scale per output channel
        return get_quant_method("int8", group=group, int8_activations=int8_activations)
    embedding = isinstance(layer, VocabEmbedding)
    wanted = INT4_EMBEDDING_GROUP if embedding else group_size or DEFAULT_INT4_GROUP
    group = GroupQuant.group_for(layer.in_features, wanted, 4)
    if group is None:
        log.warning("kvserve: %s has %d inputs, not a multiple of 32: kept dense", name, layer.in_features)
        return None
    return get_quant_method("int4", group=group, search=embedding, int8_activations=int8_activations)


def checkpoint_names(name: str, layer: Linear) -> list[str]:
    """The checkpoint weight names that fill ``layer`` (one per shard of a fused layer)."""
    if not layer.shards:
        return [f"{name}.weight"]
    parent = name.rsplit(".", 1)[0]
    return [f"{parent}.{shard}.weight" for shard in layer.shards]


def _native(name: str, layer: Linear, gguf_types: dict[str, str], int8_activations: bool) -> QuantMethod | None:
    # a checkpoint that stores a fused layer whole (Phi-3's qkv_proj) names it as the layer is named
    names = [n for n in checkpoint_names(name, layer) if n in gguf_types] or [f"{name}.weight"]
    types = {gguf_types.get(n, "") for n in names}
    layout = gguf_blocks.native_layout(types)
    if layout is None:
        if types - {"F32", "F16", "BF16"}:
            log.warning("kvserve: %s has GGUF types %s with no kernel layout: dequantized", name, sorted(types))
        return None
    bits, group, zeros = layout
    if GroupQuant.group_for(layer.in_features, group, bits) != group:
        return None
    return GroupQuant(bits, group, zeros, int8_activations=int8_activations)
