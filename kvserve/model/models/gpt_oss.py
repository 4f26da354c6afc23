"""gpt-oss: the MoE decoder (moe_decoder.py) with OpenAI's differences.

- every head has a learned sink logit that joins its softmax denominator (a key with no value), so
  a head may attend to nothing; the backends take it as ``sink_logits``;
- sliding-window and full-attention layers alternate (``layer_types``); q/k/v and o_proj have biases;
- RoPE with YaRN scaling (layers/rotary.py);
- the router has a bias and softmaxes only the top k logits; the experts have biases and a clamped
  SwiGLU (layers/moe.py ``ClampedSwiGLU``).

Checkpoints stack the experts: ``experts.gate_up_proj`` [E, hidden, 2 * inter] with gate and up
interleaved by column, ``experts.down_proj`` [E, inter, hidden], and their biases; released ones
store the two matrices as MXFP4 ``*_blocks`` / ``*_scales`` (already [E, out, in]), dequantized here
at load (quant/mxfp4.py). Each is split into the per-expert Linears of the shared MoE block.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from kvserve.config import ModelConfig
from kvserve.model.attention.backend import AttentionBackend, AttentionMetadata
from kvserve.model.layers.linear import Linear
from kvserve.model.layers.rotary import RotaryEmbedding
from kvserve.model.models.llama import Attention
from kvserve.model.models.moe_decoder import MoeDecoderLayer, MoeForCausalLM
from kvserve.model.quant.mxfp4 import dequantize_mxfp4


class GptOssAttention(Attention):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, layer: int) -> None:
        super().__init__(cfg, dtype, layer)
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.attention_bias, dtype)
        # the checkpoint's ``self_attn.sinks``; renamed so as not to be read as StreamingLLM's ``sinks``
        self.sink_logits = torch.nn.Parameter(torch.empty(cfg.num_heads, dtype=dtype), requires_grad=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, rotary: RotaryEmbedding, kv_cache: torch.Tensor,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        q, k, v = self.project_qkv(x)
        rotary(positions, q, k)
        out = backend.forward(q, k, v, kv_cache, meta, self.scale, window=self.window, sink_logits=self.sink_logits)
        return self.o_proj(out.reshape(out.shape[0], -1))


class GptOssDecoderLayer(MoeDecoderLayer):
    attention_class = GptOssAttention


class GptOssForCausalLM(MoeForCausalLM):
    layer_class = GptOssDecoderLayer

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__(cfg, dtype)
        self.weight_dtype = dtype  # what MXFP4 experts are dequantized to

    def use_attention_sinks(self, sinks: int, window: int) -> None:
        raise ValueError("attention_sinks: gpt-oss has learned sink logits and sliding-window layers of its own; "
                         "StreamingLLM sinks are for models that attend fully")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_hf_to_ours(weights, self.weight_dtype))


_EXPERTS = ".mlp.experts."
_MXFP4 = ("_blocks", "_scales")


def _hf_to_ours(weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint tensors under the names of our modules (see the module doc); an MXFP4 pair is
    dequantized once both halves have been read. Raises ValueError for a half without its partner."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        if name.endswith(".self_attn.sinks"):
            yield name.removesuffix("sinks") + "sink_logits", tensor
        elif ".mlp.router." in name:
            yield name.replace(".mlp.router.", ".mlp.gate."), tensor
        elif _EXPERTS in name and name.endswith(_MXFP4):
            base, part = name[:-len("_blocks")], name[-len("_blocks"):]
            pending.setdefault(base, {})[part] = tensor
            if len(pending[base]) == 2:
                pair = pending.pop(base)
                blocks, scales = pair["_blocks"], pair["_scales"]
                rows = (dequantize_mxfp4(blocks[e], scales[e], dtype) for e in range(blocks.shape[0]))
                yield from _per_expert(base, "weight", rows)
        elif _EXPERTS in name and name.endswith("_bias"):
            yield from _per_expert(name.removesuffix("_bias"), "bias", iter(tensor))
        elif _EXPERTS in name:  # a float [E, in, out] stack
            yield from _per_expert(name, "weight", (m.T for m in tensor))
        else:
            yield name, tensor
    if pending:
        base, parts = next(iter(pending.items()))
        raise ValueError(f"checkpoint has {base}{next(iter(parts))} but not its MXFP4 partner")


def _per_expert(stacked: str, kind: str, tensors: Iterable[torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """Names of expert e's Linears for the e-th [out, in] weight (or [out] bias) of ``stacked``
    (``...experts.gate_up_proj`` or ``...experts.down_proj``); gate and up rows alternate."""
    prefix, proj = stacked.rsplit(".", 1)
    if proj not in ("gate_up_proj", "down_proj"):
        raise ValueError(f"checkpoint tensor {stacked!r}: unknown gpt-oss expert tensor")
    for e, t in enumerate(tensors):
        if proj == "gate_up_proj":
            yield f"{prefix}.{e}.gate_proj.{kind}", t[0::2]
            yield f"{prefix}.{e}.up_proj.{kind}", t[1::2]
        else:
            yield f"{prefix}.{e}.down_proj.{kind}", t
