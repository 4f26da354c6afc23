"""The decode step of ``LlamaForCausalLM`` as one C++ call on the CPU (csrc/llama_decode.cpp).

In a step where every sequence brings one new token, the eager forward spends more time in Python
than in arithmetic at small batches: ~30 dispatched calls per layer, and OpenMP threads that fall
asleep between kernels. The fused decoder runs the same kernels in the same order from C++, so its
hidden states are bitwise those of the eager model. It needs the C++ kernels, the torch backend's
paged cache layout (the backend says which kind, see ``TorchAttentionBackend.fused_cache_kind``),
and a kernel spec from every Linear's quantization method; otherwise there is none and the eager
model runs every step. KVSERVE_FUSED_DECODE=0 turns it off (for comparisons). Mixture-of-experts
layers with plain softmax routing (Mixtral, Qwen3-MoE) run in it too: router, top k and the
experts' C++ call (``MoeSpec``), the same ATen ops and kernel as ``SparseMoeBlock``.

Speculative verification (``verify``) runs through it too: a sequence's k + 1 query tokens become
k + 1 decode rows, each attending to the cache up to its own position. The step writes all their
K/V before any attention reads, so row j sees the proposals before it, as causal attention would.
Each row then meets the same kernels, cut over the threads the same way, as in a plain decode step of
that token, so greedy verification emits what plain decoding would.
"""

from __future__ import annotations

import os

import torch

from kvserve.model.attention.backend import AttentionMetadata
from kvserve.model.cpu_kernels import load_kernels
from kvserve.model.layers.moe import SparseMoeBlock
from kvserve.model.models.llama import LlamaForCausalLM


class FusedDecoder:
    """Hidden states after the final norm for a pure decode step: ``decoder(input_ids, positions, meta)``."""

    def __init__(self, model: LlamaForCausalLM, native) -> None:
        self.embed_tokens = model.model.embed_tokens
        self.native = native

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return self.native.forward(x, positions, meta.slot_mapping, meta.decode_block_tables, meta.decode_seq_lens)

    def verify(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states for a step in which sequences bring several tokens each (a verify step: the
        last token and its proposals), every token as a decode row of its own (see the module doc).
        Meant for a few tokens a sequence: each row reads its sequence's cache again."""
        counts = torch.tensor([b - a for a, b in zip(meta.query_start, meta.query_start[1:])], device=positions.device)
        tables = meta.block_tables.repeat_interleave(counts, dim=0)
        x = self.embed_tokens(input_ids)
        # split_batch: each row is cut over the threads as a plain decode step of num_seqs sequences cuts it
        return self.native.forward(x, positions, meta.slot_mapping, tables, positions + 1, meta.num_seqs)


def build_fused_decoder(model: torch.nn.Module, kv_caches: list[torch.Tensor],
                        cache_kind: int | None) -> FusedDecoder | None:
    """The fused decoder for ``model`` over these caches, or None where it cannot run (see the module doc)."""
    kernels = load_kernels()
    if (kernels is None or cache_kind is None or os.environ.get("KVSERVE_FUSED_DECODE") == "0"
            or not isinstance(model, LlamaForCausalLM) or not type(model).fused_decode or model.attention_sinks):
        return None
    backbone, cfg = model.model, model.config
    if any(t.device.type != "cpu" for t in kv_caches) or backbone.norm.weight.device.type != "cpu":
        return None
    layers = []
    for layer in backbone.layers:
        attn, mlp = layer.self_attn, layer.mlp
        moe = _moe_spec(mlp, kernels) if isinstance(mlp, SparseMoeBlock) else None
        if isinstance(mlp, SparseMoeBlock) and moe is None:
            return None
        linears = [attn.qkv_proj, attn.o_proj] + ([] if moe is not None else [mlp.gate_up_proj, mlp.down_proj])
        specs = [lin.method.kernel_spec(lin, kernels) for lin in linears]
        if any(s is None for s in specs):
            return None
        norms = [layer.input_layernorm, layer.post_attention_layernorm, attn.q_norm, attn.k_norm]
        if any(n is not None and n.eps != cfg.rms_norm_eps for n in norms):
            return None
        q_norm, k_norm = (None, None) if attn.q_norm is None else (attn.q_norm.weight, attn.k_norm.weight)
        gate_up, down = (None, None) if moe is not None else specs[2:]
        layers.append(kernels.LayerSpec(specs[0], specs[1], gate_up, down, layer.input_layernorm.weight,
                                        layer.post_attention_layernorm.weight, q_norm, k_norm, moe))
    first = backbone.layers[0].self_attn
    native = kernels.LlamaDecoder(layers, backbone.norm.weight, model.rotary.cos, model.rotary.sin, kv_caches,
                                  first.num_heads, first.num_kv_heads, first.head_dim, cfg.rms_norm_eps, first.scale,
                                  cache_kind, [layer.self_attn.window or 0 for layer in backbone.layers])
    return FusedDecoder(model, native)


def _moe_spec(block: SparseMoeBlock, kernels):
    """``kernels.MoeSpec`` for a MoE block whose routing is the plain float32 softmax and top k (Mixtral,
    Qwen3-MoE) and whose experts run in the C++ call; None for the others (expert groups, a scaling
    factor, a float32 router, shared experts, experts on the torch path)."""
    moe = block.moe
    if (moe.scoring != "softmax" or moe.num_groups != 1 or moe.routed_scaling_factor != 1.0 or moe.float32_router
            or block.shared_expert is not None):
        return None
    router = block.gate.method.kernel_spec(block.gate, kernels)
    experts = block.cpu_kernel()
    if router is None or experts is None:
        return None
    return kernels.MoeSpec(router, experts, moe.experts_per_token, moe.renormalize, moe.float32_weights)
