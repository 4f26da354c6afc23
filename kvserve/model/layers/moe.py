"""Sparse mixture-of-experts MLP (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2): a router picks the top k experts of
each token, their gated MLPs run on it and their outputs are summed, weighted by the router.

Routing follows transformers exactly (``route``). The experts run grouped: a step's (token, expert)
pairs are sorted by expert, each active expert multiplies its tokens in one matmul, and the results
are scattered back, so every expert's weights are read once per step, however many tokens chose it.
Each expert is a pair of ordinary ``Linear`` layers, so the quantization methods apply to them.
"""

from __future__ import annotations

import torch

from kvserve.config import MoeConfig
from kvserve.model.layers.linear import Linear


class GatedMLP(torch.nn.Module):
    """down(SiLU(gate x) * up x), gate and up fused into one matmul (HF names gate/up/down_proj)."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * inter, False, dtype,
                                   shards={"gate_proj": (0, inter), "up_proj": (inter, inter)}, gated=True)
        self.down_proj = Linear(inter, hidden, False, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.project_silu_mul(x))


class Router(Linear):
    """The router's logits, one per expert. Kept dense: rounding it would change which experts run."""

    quantizable = False


def route(logits: torch.Tensor, top_k: int, renormalize: bool, float32_weights: bool, num_groups: int = 1,
          topk_groups: int = 1, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k], expert ids [T, k]) from router logits [T, E], as transformers computes them:
    softmax in float32, top k, optionally renormalised to sum to 1, times ``scale`` (DeepSeek's
    routed_scaling_factor), then rounded to the logits' dtype unless ``float32_weights`` (Mixtral,
    DeepSeek). With ``num_groups`` > 1 the experts form that many equal groups and the top k come
    from the ``topk_groups`` groups with the best single expert (DeepSeek's group_limited_greedy)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    if num_groups > 1:
        probs = _keep_best_groups(probs, num_groups, topk_groups)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if scale != 1.0:
        weights = weights * scale
    return (weights if float32_weights else weights.to(logits.dtype)), ids


def _keep_best_groups(probs: torch.Tensor, num_groups: int, topk_groups: int) -> torch.Tensor:
    """probs with every expert outside the ``topk_groups`` best groups (by their best expert) set to 0."""
    grouped = probs.view(probs.shape[0], num_groups, -1)  # [T, groups, experts per group]
    best = torch.topk(grouped.max(dim=-1).values, topk_groups, dim=-1).indices
    keep = torch.zeros(grouped.shape[:2], dtype=torch.bool, device=probs.device).scatter_(1, best, True)
    return grouped.masked_fill(~keep[:, :, None], 0.0).view_as(probs)


class SparseMoeBlock(torch.nn.Module):
    """Router ``gate``, ``experts`` and, for Qwen2-MoE and DeepSeek, a ``shared_expert`` that every
    token passes through, scaled by sigmoid(``shared_expert_gate`` x) where the config gates it
    (Qwen2-MoE). Parameter names follow HF checkpoints (DeepSeek's ``shared_experts`` renamed at load)."""

    def __init__(self, hidden: int, moe: MoeConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_experts, self.top_k = moe.num_experts, moe.experts_per_token
        self.renormalize, self.float32_weights = moe.renormalize, moe.float32_weights
        self.num_groups, self.topk_groups, self.scale = moe.num_groups, moe.topk_groups, moe.routed_scaling_factor
        self.gate = Router(hidden, moe.num_experts, False, dtype)
        self.experts = torch.nn.ModuleList(GatedMLP(hidden, moe.expert_intermediate_size, dtype)
                                           for _ in range(moe.num_experts))
        shared = moe.shared_intermediate_size
        self.shared_expert = GatedMLP(hidden, shared, dtype) if shared else None
        self.shared_expert_gate = Router(hidden, 1, False, dtype) if shared and moe.shared_expert_gated else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize, self.float32_weights, self.num_groups,
                             self.topk_groups, self.scale)
        out = self.run_experts(x, weights, ids)
        if self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        elif self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return out

    def run_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) for every token t, one matmul per active expert.

        The pairs are sorted by expert (stably, so each token's terms are added in ascending expert
        order, as transformers adds them) and summed into zeros with one ``index_add_``."""
        flat_ids = ids.flatten()
        order = torch.argsort(flat_ids, stable=True)
        token_of = order // self.top_k
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()  # one host sync per layer
        gathered = x[token_of]
        y = torch.empty_like(gathered)
        start = 0
        for expert, count in zip(self.experts, counts):
            if count:
                y[start:start + count] = expert(gathered[start:start + count])
                start += count
        y = (y * weights.flatten()[order, None]).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token_of, y)
