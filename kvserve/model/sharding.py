"""Megatron-style tensor-parallel sharding of a Llama-family checkpoint: which slice of each weight
one rank of N keeps, and where the partial sums meet.

Column-parallel (rows of W split): q/k/v and gate/up, so each rank computes its own attention heads
and its own slice of the MLP's intermediate. Row-parallel (columns of W split): o_proj and down_proj,
whose outputs are partial sums that one all-reduce each completes (after attention, after the MLP).
Norms, embeddings and the LM head are replicated: on small models the head is a small share of a
step, and a replicated head keeps sampling on rank 0 with no gather.

A rank's model is the ordinary model class built with a smaller ``ModelConfig`` (its heads, its
slice of the intermediate) and loaded from sliced checkpoint tensors, so the same kernels and
quantization methods run on every rank: slicing happens before quantizing or packing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from kvserve.config import ModelConfig
from kvserve.model.quant.registry import CheckpointTensor, InputSlice

# Model classes whose layers the slicing rules below describe (o_proj / down_proj as the only
# row-parallel projections, heads read from the config).
SHARDABLE_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@dataclass(frozen=True)
class TensorShard:
    """Rank ``rank`` of ``world_size`` tensor-parallel ranks."""

    rank: int
    world_size: int

    def check(self, cfg: ModelConfig) -> None:
        """Raise ValueError, naming the numbers, if ``cfg`` cannot be split over ``world_size`` ranks."""
        n = self.world_size
        if cfg.architecture not in SHARDABLE_ARCHITECTURES:
            raise ValueError(f"tensor_parallel_size={n}: architecture {cfg.architecture!r} cannot be sharded yet; "
                             f"supported: {', '.join(SHARDABLE_ARCHITECTURES)}")
        if cfg.num_heads % n:
            raise ValueError(f"tensor_parallel_size={n} does not divide the model's {cfg.num_heads} attention heads; "
                             "choose a size that does")
        kv = cfg.num_kv_heads
        if (kv % n if kv >= n else n % kv):
            raise ValueError(f"tensor_parallel_size={n} and the model's {kv} KV heads: one must divide the other "
                             "(KV heads are split across ranks, or replicated where there are fewer than ranks)")
        if cfg.intermediate_size % n:
            raise ValueError(f"tensor_parallel_size={n} does not divide the model's intermediate size "
                             f"{cfg.intermediate_size}")

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The shape of this rank's part: its query heads, its KV heads, its slice of the MLP."""
        self.check(cfg)
        n = self.world_size
        return dataclasses.replace(cfg, num_heads=cfg.num_heads // n, num_kv_heads=max(1, cfg.num_kv_heads // n),
                                   intermediate_size=cfg.intermediate_size // n)

    def kv_heads(self, cfg: ModelConfig) -> tuple[int, int]:
        """(first KV head, count) this rank keeps. With fewer KV heads than ranks, each is replicated on
        the ranks whose query heads read it: query head h reads KV head h // (heads / KV heads)."""
        n, kv = self.world_size, cfg.num_kv_heads
        if kv >= n:
            return self.rank * (kv // n), kv // n
        return self.rank // (n // kv), 1

    def shard_weights(self, cfg: ModelConfig,
                      weights: Iterable[tuple[str, CheckpointTensor]]) -> Iterator[tuple[str, CheckpointTensor]]:
        """The checkpoint tensors (HF names) cut to this rank's slices; the rest pass through whole."""
        n, d = self.world_size, cfg.head_dim
        q_rows = _span(self.rank, cfg.num_heads // n * d)
        first_kv, num_kv = self.kv_heads(cfg)
        kv_rows = (first_kv * d, num_kv * d)
        mlp_rows = _span(self.rank, cfg.intermediate_size // n)
        rules: dict[str, tuple[int, tuple[int, int]]] = {  # projection -> (dim of W cut, (start, length))
            "q_proj": (0, q_rows), "k_proj": (0, kv_rows), "v_proj": (0, kv_rows),
            "gate_proj": (0, mlp_rows), "up_proj": (0, mlp_rows),
            "o_proj": (1, q_rows), "down_proj": (1, mlp_rows),
        }
        for name, tensor in weights:
            parts = name.rsplit(".", 2)
            rule = rules.get(parts[-2]) if len(parts) == 3 else None
            if rule is None:
                yield name, tensor
                continue
            dim, (start, length) = rule
            if parts[-1] == "bias" and dim == 1:  # a row-parallel bias is added once, after the sum
                yield name, tensor if self.rank == 0 else torch.zeros_like(tensor)
                continue
            yield name, _narrow(tensor, dim, start, length, name)


def _span(rank: int, length: int) -> tuple[int, int]:
    return rank * length, length


def _narrow(tensor: CheckpointTensor, dim: int, start: int, length: int, name: str) -> CheckpointTensor:
    """Rows (dim 0) of a checkpoint tensor, or its columns (dim 1) as an ``InputSlice`` that the
    layer's quantization method cuts (on its group boundaries where it can)."""
    if dim == 1:
        return InputSlice(tensor, start, length)
    if isinstance(tensor, torch.Tensor):
        return tensor[start:start + length].contiguous()
    return tensor[start:start + length]  # GGUF blocks: whole rows of blocks


def install_all_reduce(model: torch.nn.Module, all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Complete every row-parallel projection's partial sums: ``all_reduce`` runs on the output of
    each o_proj and down_proj (a forward hook, so the model's code is the single-rank one)."""
    def hook(module, inputs, output):
        return all_reduce(output)

    count = 0
    for layer in model.model.layers:
        layer.self_attn.o_proj.register_forward_hook(hook)
        layer.mlp.down_proj.register_forward_hook(hook)
        count += 2
    if count == 0:
        raise ValueError(f"{type(model).__name__} has no layers to shard")
