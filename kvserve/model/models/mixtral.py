"""Mixtral: Mistral's decoder with a sparse MoE block in every layer; the top-k routing weights are
always renormalised and kept in float32 (config.MoeConfig).

Its checkpoints name the block ``block_sparse_moe`` and an expert's gate/down/up projections
w1/w2/w3; they are loaded under the names of the shared MoE modules.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from kvserve.model.models.moe_decoder import MoeForCausalLM

_EXPERT = re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w([123])\.")
_PROJ = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}


def _hf_to_ours(name: str) -> str:
    name = _EXPERT.sub(lambda m: f".block_sparse_moe.experts.{m[1]}.{_PROJ[m[2]]}.", name)
    return name.replace(".block_sparse_moe.", ".mlp.")


class MixtralForCausalLM(MoeForCausalLM):
    fused_decode = True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights((_hf_to_ours(name), tensor) for name, tensor in weights)
