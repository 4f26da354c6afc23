"""Reading single-file GGUF checkpoints: config from metadata, weights as float tensors or raw blocks.

The `gguf` package parses the file and dequantizes every block type it knows (F32, F16, BF16,
Q8_0, Q4_0, Q4_1, the K-quants...). With ``keep_blocks`` the block-quantized matrices are handed
out undecoded instead (``GGUFBlocks``), so a quantized layer can take them in their own format.
We map llama.cpp tensor names to Hugging Face names and undo the Q/K row permutation llama.cpp
applies to Llama-architecture checkpoints (a permutation of rows, so it applies to blocks too).
"""

from __future__ import annotations

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

from kvserve.runtime.disk_cache import cache_dir, write_atomically

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                  "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# llama.cpp converters permute Q/K rows of these architectures for their RoPE layout.
_PERMUTED_QK = {"llama", "mistral"}

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
}
_FLOAT_TYPES = {"F32", "F16", "BF16", "F64"}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}


_INDEX_VERSION = 1
_NUMPY_TYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                "I32": np.int32, "I64": np.int64}


def _reader(path: Path):
    import gguf

    return gguf.GGUFReader(str(path))


@lru_cache(maxsize=4)
def _index(path: Path) -> dict[str, Any]:
    """What kvserve reads of a GGUF file's header: scalar metadata (arrays only by length, as
    ``<key>#len``) and every tensor's name, type, dims and data offset.

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


def read_config(path: Path) -> dict[str, Any]:
    """An HF-style config.json dict built from the file's metadata."""
    index = _index(path)
    arch = _field(index, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {sorted(_ARCHITECTURES)}")
    names = {t[0] for t in index["tensors"]}
    heads = int(_field(index, f"{arch}.attention.head_count"))
    hidden = int(_field(index, f"{arch}.embedding_length"))
    cfg = {
        "architectures": [_ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": int(_field(index, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_field(index, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(index, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(_field(index, f"{arch}.attention.key_length", hidden // heads)),
        "max_position_embeddings": int(_field(index, f"{arch}.context_length", 4096)),
        "rms_norm_eps": float(_field(index, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_field(index, f"{arch}.rope.freq_base", 10000.0)),
        "vocab_size": int(_field(index, f"{arch}.vocab_size", _field(index, "tokenizer.ggml.tokens#len", 0))),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": _field(index, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(index, "tokenizer.ggml.eos_token_id"),
    }
    if "rope_freqs.weight" in names:
        raise ValueError("GGUF files with rope_freqs (Llama 3.1 scaling) are not supported yet; use the HF folder")
    return cfg


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
    """HF tensor name -> GGML type name (e.g. "Q4_1", "F32") for every tensor in the file."""
    return {_hf_name(name): type_name for name, type_name, _dims, _offset in _index(path)["tensors"]}


def iter_weights(path: Path, config: dict[str, Any], keep_blocks: bool = False
                 ) -> Iterator[tuple[str, torch.Tensor | GGUFBlocks]]:
    """Yield (HF name, tensor) for every tensor in the file: float32 tensors, except block-quantized
    matrices, which come as ``GGUFBlocks`` when ``keep_blocks``. The data is read through a memory map."""
    import gguf

    raw = np.memmap(path, dtype=np.uint8, mode="r")
    arch = config["model_type"]
    for gguf_name, type_name, dims, offset in _index(path)["tensors"]:
        name = _hf_name(gguf_name)
        qtype = gguf.GGMLQuantizationType[type_name]
        shape = tuple(reversed(dims))  # GGUF lists dimensions innermost first
        if type_name in _NUMPY_TYPES:
            item = np.dtype(_NUMPY_TYPES[type_name])
            data = raw[offset:offset + math.prod(shape) * item.itemsize].view(item).reshape(shape)
        else:
            byte_shape = gguf.quants.quant_shape_to_byte_shape(shape, qtype)
            data = raw[offset:offset + math.prod(byte_shape)].reshape(byte_shape)
        if keep_blocks and len(shape) == 2 and type_name not in _FLOAT_TYPES:
            tensor: torch.Tensor | GGUFBlocks = GGUFBlocks(np.asarray(data).reshape(shape[0], -1), qtype, shape)
        else:
            array = gguf.quants.dequantize(data, qtype)
            tensor = torch.from_numpy(np.array(array, dtype=np.float32, copy=True).reshape(shape))
        if arch in _PERMUTED_QK and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads"] if "q_proj" in name else config["num_key_value_heads"]
            tensor = _unpermute_qk(tensor, heads)
        yield name, tensor


def _hf_name(name: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    prefix, layer, rest = name.split(".", 2)
    if prefix != "blk" or rest not in _LAYER_NAMES:
        raise ValueError(f"GGUF tensor {name!r} is not understood by kvserve")
    return f"model.layers.{layer}.{_LAYER_NAMES[rest]}"


def _unpermute_qk(weight: torch.Tensor | GGUFBlocks, num_heads: int) -> torch.Tensor | GGUFBlocks:
    """Undo llama.cpp's per-head interleaving of rotary pairs back to the HF "rotate half" layout."""
    rows = weight.shape[0]
    order = torch.arange(rows).reshape(num_heads, rows // num_heads // 2, 2).transpose(1, 2).reshape(rows)
    if isinstance(weight, GGUFBlocks):
        return weight.take_rows(order.numpy())
    return weight[order]
