"""Phi-3 and Phi-4-mini: the Llama decoder, stored with fused projections and rotated by LongRoPE.

- the checkpoint fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``: they are split at
  load time into the q/k/v and gate/up shards the Llama layers fuse again by rows, so every Llama
  path (the C++ kernels, the fused decode step, quantized layers, GGUF blocks) runs unchanged;
- an optional sliding window over every layer (``sliding_window``, read by ``layer_windows``);
- ``rope_scaling`` LongRoPE ("longrope", earlier "su"): per-pair frequency divisors for the original
  context (short) and beyond (long), with a cos/sin gain (layers/rotary.py picks the set);
- Phi-4-mini rotates only part of each head (``partial_rotary_factor``), see layers/rotary.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from kvserve.config import ModelConfig
from kvserve.model.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        if cfg.hidden_act != "silu":
            raise ValueError(f"hidden_act={cfg.hidden_act!r} is not supported for Phi-3; supported: silu")
        super().__init__(cfg, dtype)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._split_fused(weights))

    def _split_fused(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """qkv_proj rows are q, then k, then v; gate_up_proj rows are gate, then up (transformers'
        ``chunk(2)``). Slices of rows work alike on tensors and undecoded GGUF blocks."""
        cfg = self.config
        q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
        parts = {"self_attn.qkv_proj.weight": (("q_proj", q), ("k_proj", kv), ("v_proj", kv)),
                 "mlp.gate_up_proj.weight": (("gate_proj", inter), ("up_proj", inter))}
        for name, tensor in weights:
            fused = next((f for f in parts if name.endswith(f)), None)
            if fused is None:
                yield name, tensor
                continue
            shards = parts[fused]
            if tensor.shape[0] != sum(n for _, n in shards):
                raise ValueError(f"checkpoint tensor {name!r} has {tensor.shape[0]} rows, expected "
                                 f"{' + '.join(str(n) for _, n in shards)}")
            prefix, start = name[:-len(fused)] + fused.split(".")[0], 0
            for shard, rows in shards:
                yield f"{prefix}.{shard}.weight", tensor[start:start + rows]
                start += rows
