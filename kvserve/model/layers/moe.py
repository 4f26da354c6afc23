"""Sparse mixture-of-experts MLP (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3, gpt-oss): a router
picks the top k experts of each token, their gated MLPs run on it and their outputs are summed,
weighted by the router.

Routing follows transformers exactly (``route``). The experts run grouped: a step's (token, expert)
pairs are sorted by expert, each active expert multiplies its tokens in one matmul, and the results
are scattered back, so every expert's weights are read once per step, however many tokens chose it.
Each expert is a pair of ordinary ``Linear`` layers, so the quantization methods apply to them. On
the CPU all experts of a block run in one C++ call (moe_kernel.py); elsewhere, and for gpt-oss's
experts, one torch call per active expert.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvserve.config import MoeConfig
from kvserve.model.layers.linear import Linear
from kvserve.model.layers.moe_kernel import cpu_kernel_wanted, experts_kernel, weight_bytes


class GatedMLP(torch.nn.Module):
    """down(act(gate x, up x)), gate and up fused into one matmul (HF names gate/up/down_proj).

    ``act`` None: SiLU(gate) * up, which a quantization method may compute fused with the matmul;
    else a function of (gate, up), such as ``ClampedSwiGLU``. ``bias``: every projection has one."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, bias: bool = False,
                 act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> None:
        super().__init__()
        self.inter, self.act = inter, act
        self.gate_up_proj = Linear(hidden, 2 * inter, bias, dtype,
                                   shards={"gate_proj": (0, inter), "up_proj": (inter, inter)}, gated=act is None)
        self.down_proj = Linear(inter, hidden, bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act is None:
            return self.down_proj(self.gate_up_proj.project_silu_mul(x))
        gate, up = self.gate_up_proj(x).split((self.inter, self.inter), dim=-1)
        return self.down_proj(self.act(gate, up))


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's expert activation: the gate clamped above at ``limit``, up to [-limit, limit], then
    gate * sigmoid(alpha * gate) * (up + 1)."""

    alpha: float
    limit: float

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


def expert_activation(moe: MoeConfig) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """The experts' ``act`` for GatedMLP (None: SiLU(gate) * up)."""
    if moe.activation == "silu":
        return None
    if moe.activation == "clamped_swiglu":
        return ClampedSwiGLU(moe.swiglu_alpha, moe.swiglu_limit)
    raise ValueError(f"expert activation {moe.activation!r} is not supported; supported: silu, clamped_swiglu")


class Router(Linear):
    """The router's logits, one per expert. Kept dense: rounding it would change which experts run."""

    quantizable = False


def route(logits: torch.Tensor, moe: MoeConfig, choice_bias: torch.Tensor | None = None,
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k], expert ids [T, k]) from router logits [T, E], as transformers computes them:
    experts chosen by ``moe.scoring`` (MoeConfig), weights optionally renormalised to sum to 1, times
    ``routed_scaling_factor``, then rounded to the logits' dtype unless ``float32_weights`` (Mixtral,
    DeepSeek). ``choice_bias`` [E] (DeepSeek-V3's e_score_correction_bias) is added to the "sigmoid"
    scores only to choose the experts; each chosen one is weighted by its unbiased score."""
    k = moe.experts_per_token
    if moe.scoring == "topk_softmax":  # gpt-oss: a softmax over the k best logits, in their dtype
        top, ids = torch.topk(logits, k, dim=-1)
        weights = torch.softmax(top, dim=-1, dtype=top.dtype)
    elif moe.scoring == "sigmoid":
        scores = logits.float().sigmoid()
        biased = scores if choice_bias is None else scores + choice_bias
        ids = torch.topk(_keep_best_groups(biased, moe.num_groups, moe.topk_groups, 2), k, dim=-1).indices
        weights = scores.gather(1, ids)
    else:
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(_keep_best_groups(scores, moe.num_groups, moe.topk_groups, 1), k, dim=-1)
    if moe.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if moe.routed_scaling_factor != 1.0:
        weights = weights * moe.routed_scaling_factor
    return (weights if moe.float32_weights else weights.to(logits.dtype)), ids


def _keep_best_groups(scores: torch.Tensor, num_groups: int, topk_groups: int, best_of: int) -> torch.Tensor:
    """scores with every expert outside the ``topk_groups`` best groups set to -inf; a group's
    rank is the sum of its ``best_of`` highest scores. One group: the scores as they are."""
    if num_groups == 1:
        return scores
    grouped = scores.view(scores.shape[0], num_groups, -1)  # [T, groups, experts per group]
    rank = grouped.topk(best_of, dim=-1).values.sum(dim=-1) if best_of > 1 else grouped.max(dim=-1).values
    best = torch.topk(rank, topk_groups, dim=-1).indices
    keep = torch.zeros(grouped.shape[:2], dtype=torch.bool, device=scores.device).scatter_(1, best, True)
    return grouped.masked_fill(~keep[:, :, None], float("-inf")).view_as(scores)


class SparseMoeBlock(torch.nn.Module):
    """Router ``gate`` (with a bias for gpt-oss), ``experts`` and, for Qwen2-MoE and DeepSeek, a
    ``shared_expert`` that every token passes through, scaled by sigmoid(``shared_expert_gate`` x)
    where the config gates it (Qwen2-MoE). Parameter names follow HF checkpoints (DeepSeek's
    ``shared_experts`` and gpt-oss's ``router`` and stacked experts renamed at load)."""

    def __init__(self, hidden: int, moe: MoeConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.moe, self.num_experts, self.top_k = moe, moe.num_experts, moe.experts_per_token
        self.gate = Router(hidden, moe.num_experts, moe.router_bias, torch.float32 if moe.float32_router else dtype)
        act = expert_activation(moe)
        self.experts = torch.nn.ModuleList(GatedMLP(hidden, moe.expert_intermediate_size, dtype, moe.expert_bias, act)
                                           for _ in range(moe.num_experts))
        shared = moe.shared_intermediate_size
        self.shared_expert = GatedMLP(hidden, shared, dtype) if shared else None
        self.shared_expert_gate = Router(hidden, 1, False, dtype) if shared and moe.shared_expert_gated else None
        # DeepSeek-V3: added to the scores only to choose experts (HF name: gate.e_score_correction_bias)
        self.e_score_correction_bias = None
        if moe.scoring == "sigmoid":
            self.e_score_correction_bias = torch.nn.Parameter(torch.zeros(moe.num_experts), requires_grad=False)
        # The experts' C++ call (moe_kernel.py), made at the first forward on the CPU, once loaded.
        self.use_cpu_kernel = cpu_kernel_wanted()
        self._cpu_kernel, self._cpu_kernel_made = None, False
        # [experts, 2] int64 or None: if set, the bytes of W each expert's gate_up and down read in a
        # forward are added to it (tests and benchmarks check that each active expert reads its W once)
        self.bytes_read: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x.float() if self.moe.float32_router else x)
        weights, ids = route(logits, self.moe, self.e_score_correction_bias)
        out = self.run_experts(x, weights, ids)
        if self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        elif self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return out

    def run_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) for every token t, one matmul per active expert.

        The pairs are sorted by expert (stably, so each token's terms are added in ascending expert
        order, as transformers adds them) and summed into zeros with one ``index_add_``. The C++ call
        does all of it, bitwise the same."""
        kernel = self._kernel_for(x)
        if kernel is not None:
            return kernel(x.contiguous(), weights, ids.contiguous(), self.bytes_read)
        flat_ids = ids.flatten()
        order = torch.argsort(flat_ids, stable=True)
        token_of = order // self.top_k
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()  # one host sync per layer
        y = self._experts_in_torch(x[token_of], counts)
        y = (y * weights.flatten()[order, None]).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token_of, y)

    def _experts_in_torch(self, gathered: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Each active expert called on its rows of ``gathered`` (sorted by expert, ``counts`` each)."""
        y = torch.empty_like(gathered)
        start = 0
        for e, (expert, count) in enumerate(zip(self.experts, counts)):
            if count:
                y[start:start + count] = expert(gathered[start:start + count])
                start += count
                if self.bytes_read is not None:
                    self.bytes_read[e, 0] += weight_bytes(expert.gate_up_proj)
                    self.bytes_read[e, 1] += weight_bytes(expert.down_proj)
        return y

    def cpu_kernel(self):
        """The experts' C++ call for CPU tensors (made once), or None where it is switched off or
        cannot run these experts (the torch path)."""
        if not self.use_cpu_kernel:
            return None
        if not self._cpu_kernel_made:
            self._cpu_kernel, self._cpu_kernel_made = experts_kernel(self.experts), True
        return self._cpu_kernel

    def _kernel_for(self, x: torch.Tensor):
        """The experts' C++ call for x, or None (the torch path)."""
        return self.cpu_kernel() if x.device.type == "cpu" else None
