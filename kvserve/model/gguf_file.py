"""Reading single-file GGUF checkpoints: config from metadata, weights as float tensors or raw blocks.

The `gguf` package parses the file and dequantizes every block type it knows (F32, F16, BF16,
Q8_0, Q4_0, Q4_1, the K-quants...). With ``keep_blocks`` the block-quantized matrices are handed
out undecoded instead (``GGUFBlocks``), so a quantized layer can take them in their own format.
We map llama.cpp tensor names to Hugging Face names and undo the Q/K row permutation llama.cpp
applies to Llama-architecture checkpoints (a permutation of rows, so it applies to blocks too).
Mixture-of-experts files stack each layer's experts in one 3-D tensor per projection
([experts, rows, cols]); it is split into the per-expert matrices (blocks stay blocks) under the
names of the shared MoE block (``mlp.experts.E.gate_proj.weight``...), which every MoE class loads.
What the metadata means per architecture is in gguf_arch.py.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvserve.model import gguf_arch
from kvserve.runtime.disk_cache import cache_dir, write_atomically

# llama.cpp converters permute Q/K rows of these architectures for their RoPE layout.
_PERMUTED_QK = {"llama", "mistral", "smollm3"}
# llama.cpp's converter stores Gemma's RMSNorm weights w as 1 + w (the gain they apply).
_NORMS_PLUS_ONE = {"gemma2", "gemma3"}

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",  # Phi-3 keeps q/k/v (and gate/up) fused
    "ffn_gate_inp.weight": "mlp.gate.weight",  # the MoE router
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
# Each layer's experts, stacked: [experts, rows, cols]
_EXPERT_STACKS = {"ffn_gate_exps.weight": "gate_proj", "ffn_up_exps.weight": "up_proj",
                  "ffn_down_exps.weight": "down_proj"}
# Gemma normalises before and after attention and the MLP; llama.cpp's ffn_norm is the one before the MLP.
_GEMMA_NORMS = {"ffn_norm.weight": "pre_feedforward_layernorm.weight",
                "post_attention_norm.weight": "post_attention_layernorm.weight",
                "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
# Phi-3's ffn_up holds gate and up stacked, as its HF checkpoint's gate_up_proj does.
_ARCH_LAYER_NAMES = {"phi3": {"ffn_up.weight": "mlp.gate_up_proj.weight"}, "gemma2": _GEMMA_NORMS,
                     "gemma3": _GEMMA_NORMS}
# LongRoPE's factors: read into the config, not weights.
_ROPE_FACTORS = {"rope_factors_long.weight": "long_factor", "rope_factors_short.weight": "short_factor"}
_FLOAT_TYPES = {"F32", "F16", "BF16", "F64"}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}


_INDEX_VERSION = 2
_SMALL_ARRAY = 1024  # metadata arrays up to this length (per-layer values) are kept whole in the index
_NUMPY_TYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                "I32": np.int32, "I64": np.int64}


def _reader(path: Path):
    import gguf

    return gguf.GGUFReader(str(path))


@lru_cache(maxsize=4)
def _index(path: Path) -> dict[str, Any]:
    """What kvserve reads of a GGUF file's header: scalar metadata and small per-layer arrays (other
    arrays only by length, as ``<key>#len``) and every tensor's name, type, dims and data offset.

    gguf.GGUFReader parses every metadata array element by element, about 3 s for a 49K-token
    vocabulary, which was the largest part of the server's start-up. So the index is built once and
    cached as JSON under the cache directory, keyed by the file's path, size and mtime.
    """
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{_INDEX_VERSION}".encode()).hexdigest()
    cached = cache_dir() / "gguf" / f"{key[:20]}.json"
    try:
        return json.loads(cached.read_text())
    except (OSError, ValueError):
        pass
    import gguf

    reader = _reader(path)
    fields: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if field.types and field.types[0] == gguf.GGUFValueType.ARRAY:
            fields[f"{name}#len"] = len(field.data)
            if len(field.data) <= _SMALL_ARRAY and not name.startswith("tokenizer."):
                fields[name] = field.contents()
        else:
            fields[name] = field.contents()
    tensors = [[t.name, t.tensor_type.name, [int(d) for d in t.shape], int(t.data_offset)] for t in reader.tensors]
    index = {"fields": fields, "tensors": tensors}
    try:
        write_atomically(cached, json.dumps(index).encode())
    except OSError:  # a read-only cache directory costs the parse next time, nothing else
        pass
    return index


def _field(index: dict[str, Any], key: str, default: Any = None) -> Any:
    return index["fields"].get(key, default)


def _scalar(index: dict[str, Any], key: str, default: Any = None) -> Any:
    value = _field(index, key, default)
    if isinstance(value, list):
        raise ValueError(f"GGUF metadata {key!r} holds one value per layer; kvserve reads one value for all layers")
    return value


def read_config(path: Path) -> dict[str, Any]:
    """An HF-style config.json dict built from the file's metadata."""
    index = _index(path)
    arch = _field(index, "general.architecture")
    field = functools.partial(_field, index)
    architecture = gguf_arch.architecture(arch, field)
    names = {t[0] for t in index["tensors"]}
    heads = int(_field(index, f"{arch}.attention.head_count"))
    hidden = int(_field(index, f"{arch}.embedding_length"))
    cfg = {
        "architectures": [architecture],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": int(_scalar(index, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_scalar(index, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_scalar(index, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(_scalar(index, f"{arch}.attention.key_length", hidden // heads)),
        "max_position_embeddings": int(_scalar(index, f"{arch}.context_length", 4096)),
        "rms_norm_eps": float(_scalar(index, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_scalar(index, f"{arch}.rope.freq_base", 10000.0)),
        "vocab_size": _vocab_size(index, arch),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": _field(index, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(index, "tokenizer.ggml.eos_token_id"),
    }
    if "rope_freqs.weight" in names:
        raise ValueError("GGUF files with rope_freqs (Llama 3.1 scaling) are not supported yet; use the HF folder")
    if arch == "phi3":
        cfg.update(_phi3_config(path, index, cfg))
    else:
        cfg.update(gguf_arch.extra_config(arch, field, cfg))
    return cfg


def _vocab_size(index: dict[str, Any], arch: str) -> int:
    """The embedding's rows: llama.cpp's converter may trim the vocabulary to the tokenizer's
    (Gemma 3), so the metadata's count is only the fallback."""
    embedding = next((t for t in index["tensors"] if t[0] == "token_embd.weight"), None)
    if embedding is not None:
        return int(embedding[2][1])  # dims innermost first: [hidden, vocab]
    return int(_scalar(index, f"{arch}.vocab_size", _field(index, "tokenizer.ggml.tokens#len", 0)))


def _phi3_config(path: Path, index: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """What llama.cpp's converter writes of a Phi-3 config: the original context, the rotary dims
    (Phi-4-mini: part of each head), the window (0: none) and LongRoPE's factors as tensors."""
    head_dim = cfg["head_dim"]
    extra: dict[str, Any] = {
        "original_max_position_embeddings": int(_field(index, "phi3.rope.scaling.original_context_length",
                                                       cfg["max_position_embeddings"])),
        "partial_rotary_factor": int(_field(index, "phi3.rope.dimension_count", head_dim)) / head_dim,
        "sliding_window": int(_field(index, "phi3.attention.sliding_window", 0)) or None,
    }
    factors = {key: _float_tensor(path, index, name).tolist() for name, key in _ROPE_FACTORS.items()
               if any(t[0] == name for t in index["tensors"])}
    if factors:
        if len(factors) != 2:
            raise ValueError(f"GGUF file has only {sorted(factors)} of LongRoPE's long and short factors")
        scaling: dict[str, Any] = {"rope_type": "longrope", **factors}
        if _field(index, "phi3.rope.scaling.attn_factor") is not None:
            scaling["attention_factor"] = float(_field(index, "phi3.rope.scaling.attn_factor"))
        extra["rope_scaling"] = scaling
    return extra


def _float_tensor(path: Path, index: dict[str, Any], name: str) -> np.ndarray:
    """A small F32 tensor of the file (e.g. rope factors), read directly."""
    _name, type_name, dims, offset = next(t for t in index["tensors"] if t[0] == name)
    if type_name != "F32":
        raise ValueError(f"GGUF tensor {name!r} is {type_name}; expected F32")
    return np.fromfile(path, dtype=np.float32, count=math.prod(dims), offset=offset)


@dataclass(frozen=True)
class GGUFBlocks:
    """A block-quantized matrix as stored in the file: ``data`` is uint8 [rows, bytes per row]."""

    data: np.ndarray
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, int]  # (rows, cols) = (out_features, in_features), HF order

    @property
    def type_name(self) -> str:
        return self.tensor_type.name

    @property
    def type_size(self) -> int:
        """Bytes of one block."""
        import gguf

        return gguf.GGML_QUANT_SIZES[self.tensor_type][1]

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix (the `gguf` package's reference dequantization)."""
        import gguf

        array = gguf.quants.dequantize(self.data, self.tensor_type)
        return torch.from_numpy(np.array(array, dtype=np.float32, copy=True).reshape(self.shape))

    def take_rows(self, index: np.ndarray) -> GGUFBlocks:
        return GGUFBlocks(self.data[index], self.tensor_type, self.shape)

    def __getitem__(self, rows: slice) -> GGUFBlocks:
        """A range of rows (``blocks[a:b]``), still undecoded."""
        data = self.data[rows]
        return GGUFBlocks(data, self.tensor_type, (data.shape[0], self.shape[1]))


def tensor_types(path: Path) -> dict[str, str]:
    """HF tensor name -> GGML type name (e.g. "Q4_1", "F32") for every tensor in the file (each
    expert of a stacked expert tensor under its own name)."""
    index = _index(path)
    arch = _field(index, "general.architecture")
    return {name: type_name for gguf_name, type_name, dims, _offset in index["tensors"]
            if gguf_name not in _ROPE_FACTORS for name in _hf_names(gguf_name, arch, _experts(dims))}


def iter_weights(path: Path, config: dict[str, Any], keep_blocks: bool = False
                 ) -> Iterator[tuple[str, torch.Tensor | GGUFBlocks]]:
    """Yield (HF name, tensor) for every tensor in the file: float32 tensors, except block-quantized
    matrices, which come as ``GGUFBlocks`` when ``keep_blocks``; a stacked expert tensor as one
    matrix per expert. The data is read through a memory map.

    Gemma's norm weights come as HF stores them (w, not llama.cpp's 1 + w), in float64 so that the
    model's 1 + w gives the file's values back exactly."""
    import gguf

    raw = np.memmap(path, dtype=np.uint8, mode="r")
    arch = config["model_type"]
    for gguf_name, type_name, dims, offset in _index(path)["tensors"]:
        if gguf_name in _ROPE_FACTORS:
            continue
        qtype = gguf.GGMLQuantizationType[type_name]
        shape = tuple(reversed(dims))  # GGUF lists dimensions innermost first
        data = _stored(raw, offset, shape, type_name, qtype)
        names = _hf_names(gguf_name, arch, _experts(dims))
        parts = [(data[e], shape[1:]) for e in range(len(names))] if _stacked(gguf_name) else [(data, shape)]
        for name, (part, part_shape) in zip(names, parts):
            tensor = _tensor(part, part_shape, type_name, qtype, keep_blocks)
            yield name, _to_hf(tensor, name, gguf_name, arch, config)


def _stored(raw: np.ndarray, offset: int, shape: tuple[int, ...], type_name: str, qtype: Any) -> np.ndarray:
    """The tensor's bytes as an array: values for plain types, [..., bytes per row] for blocks."""
    import gguf

    if type_name in _NUMPY_TYPES:
        item = np.dtype(_NUMPY_TYPES[type_name])
        return raw[offset:offset + math.prod(shape) * item.itemsize].view(item).reshape(shape)
    byte_shape = gguf.quants.quant_shape_to_byte_shape(shape, qtype)
    return raw[offset:offset + math.prod(byte_shape)].reshape(byte_shape)


def _tensor(data: np.ndarray, shape: tuple[int, ...], type_name: str, qtype: Any, keep_blocks: bool
            ) -> torch.Tensor | GGUFBlocks:
    import gguf

    if keep_blocks and len(shape) == 2 and type_name not in _FLOAT_TYPES:
        return GGUFBlocks(np.asarray(data).reshape(shape[0], -1), qtype, shape)
    array = gguf.quants.dequantize(data, qtype)
    return torch.from_numpy(np.array(array, dtype=np.float32, copy=True).reshape(shape))


def _to_hf(tensor: torch.Tensor | GGUFBlocks, name: str, gguf_name: str, arch: str, config: dict[str, Any]
           ) -> torch.Tensor | GGUFBlocks:
    """Undo what llama.cpp's converter changed of the HF tensor ``name``."""
    if arch in _PERMUTED_QK and name.endswith(("q_proj.weight", "k_proj.weight")):
        heads = config["num_attention_heads"] if "q_proj" in name else config["num_key_value_heads"]
        return _unpermute_qk(tensor, heads)
    if arch in _NORMS_PLUS_ONE and gguf_name.endswith("norm.weight") and isinstance(tensor, torch.Tensor):
        return tensor.double() - 1.0
    if gguf_name.endswith("ffn_gate_inp_shexp.weight") and isinstance(tensor, torch.Tensor):
        return tensor.reshape(1, -1)  # the shared expert's gate: one output, however the file shapes it
    return tensor


def _experts(dims: list[int]) -> int:
    """How many matrices a tensor stacks: its outermost dimension if it has three."""
    return dims[-1] if len(dims) == 3 else 0


def _stacked(name: str) -> str | None:
    """The projection a stacked expert tensor holds (e.g. "gate_proj"); None for other tensors."""
    parts = name.split(".", 2)
    return _EXPERT_STACKS.get(parts[2]) if len(parts) == 3 and parts[0] == "blk" else None


def _hf_names(name: str, arch: str | None, experts: int) -> list[str]:
    """The HF names a GGUF tensor fills: one, or one per expert of a stacked expert tensor."""
    projection = _stacked(name)
    if projection is None:
        return [_hf_name(name, arch)]
    layer = name.split(".")[1]
    return [f"model.layers.{layer}.mlp.experts.{e}.{projection}.weight" for e in range(experts)]


def _hf_name(name: str, arch: str | None = None) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    prefix, layer, rest = name.split(".", 2)
    names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch or "", {})}
    if prefix != "blk" or rest not in names:
        raise ValueError(f"GGUF tensor {name!r} is not understood by kvserve")
    return f"model.layers.{layer}.{names[rest]}"


def _unpermute_qk(weight: torch.Tensor | GGUFBlocks, num_heads: int) -> torch.Tensor | GGUFBlocks:
    """Undo llama.cpp's per-head interleaving of rotary pairs back to the HF "rotate half" layout."""
    rows = weight.shape[0]
    order = torch.arange(rows).reshape(num_heads, rows // num_heads // 2, 2).transpose(1, 2).reshape(rows)
    if isinstance(weight, GGUFBlocks):
        return weight.take_rows(order.numpy())
    return weight[order]
