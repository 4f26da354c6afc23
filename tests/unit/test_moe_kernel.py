"""The experts' C++ call (layers/csrc/moe.cpp through layers/moe_kernel.py) against the per-expert
torch path on the same block: bitwise the same output for every weight format the experts can have
(packed and unpacked dense bf16, float32, int8, int4, GGUF Q8_0 / Q4_0 blocks), with tokens spread
unevenly (idle experts, one expert with every token), and each active expert's W read once."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve.config import MoeConfig
from kvserve.model.cpu_kernels import load_kernels
from kvserve.model.gguf_file import GGUFBlocks
from kvserve.model.layers.moe import SparseMoeBlock
from kvserve.model.layers.moe_kernel import weight_bytes
from kvserve.model.quant import gguf_blocks
from kvserve.model.quant.methods import GroupQuant
from kvserve.model.quant.registry import get_quant_method

HIDDEN, INTER, EXPERTS = 128, 96, 6

# format: (model dtype, how each expert Linear stores W)
FORMATS = {
    "bf16_packed": (torch.bfloat16, "dense"),
    "bf16_unpacked": (torch.bfloat16, "dense-unpacked"),  # CPUs without AVX512-BF16 or AVX2
    "float32": (torch.float32, "dense"),
    "int8": (torch.bfloat16, "int8"),
    "int8_float32": (torch.float32, "int8"),
    "int4": (torch.bfloat16, "int4"),
    "int4_g64_float16_scales": (torch.bfloat16, "int4-plain"),
    "gguf_q8_0": (torch.bfloat16, "Q8_0"),
    "gguf_q4_0": (torch.bfloat16, "Q4_0"),
}


def _kernels():
    kernels = load_kernels()
    if kernels is None:
        pytest.skip("the C++ kernels are not built here")
    return kernels


def _store(layer, how: str, w: torch.Tensor) -> None:
    """Fill ``layer`` with W as ``how`` says, as the loader would."""
    if how in ("Q8_0", "Q4_0"):
        import gguf

        qtype = gguf.GGMLQuantizationType[how]
        blocks = GGUFBlocks(gguf.quants.quantize(w.float().numpy().astype(np.float32), qtype), qtype, tuple(w.shape))
        layer.set_method(GroupQuant(*gguf_blocks.native_layout({how})))
        layer.method.load(layer, blocks, None)
    elif how == "int4-plain":
        layer.set_method(get_quant_method("int4", group=64, coded=False))
        layer.method.load(layer, w, None)
    else:
        if how not in ("dense", "dense-unpacked"):
            layer.set_method(get_quant_method(how))
        layer.method.load(layer, w.to(layer.dtype), None)
    if how != "dense-unpacked":
        layer.method.finish_loading(layer)


def _block(fmt: str, top_k: int = 2) -> SparseMoeBlock:
    dtype, how = FORMATS[fmt]
    block = SparseMoeBlock(HIDDEN, MoeConfig(EXPERTS, top_k, INTER), dtype)
    gen = torch.Generator().manual_seed(0)
    for expert in block.experts:
        for layer in (expert.gate_up_proj, expert.down_proj):
            _store(layer, how, torch.randn(layer.out_features, layer.in_features, generator=gen) * 0.1)
    return block


def _routing(tokens: int, spread: str, k: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 weights, expert ids) [tokens, k]: "even" cycles through the experts; "skewed" sends
    every token to expert 2 and the rest of its picks among 0, 5 and 4, leaving 1 and 3 idle."""
    t = torch.arange(tokens)
    if spread == "even":
        ids = torch.stack([(t + j) % EXPERTS for j in range(k)], dim=1)
    else:
        others = torch.tensor([[0, 5, 4], [5, 4, 0], [4, 0, 5]])[t % 3]
        ids = torch.cat([torch.full_like(t, 2)[:, None], others[:, :k - 1]], dim=1)
    weights = torch.rand(tokens, k, generator=torch.Generator().manual_seed(tokens))
    return weights, ids


def _run(block: SparseMoeBlock, x: torch.Tensor, weights, ids, cpp: bool):
    block.use_cpu_kernel = cpp
    block.bytes_read = torch.zeros(EXPERTS, 2, dtype=torch.long)
    with torch.no_grad():
        out = block.run_experts(x, weights, ids)
    return out, block.bytes_read


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_cpp_experts_equal_the_torch_path(fmt):
    _kernels()
    block = _block(fmt)
    assert block._kernel_for(torch.zeros(1, HIDDEN)) is not None  # every format runs in the C++ call
    for tokens, spread in [(1, "even"), (32, "even"), (32, "skewed"), (5, "skewed"), (150, "skewed")]:
        x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens)).to(block.gate.dtype)
        weights, ids = _routing(tokens, spread)
        ours, ours_read = _run(block, x, weights, ids, cpp=True)
        ref, ref_read = _run(block, x, weights, ids, cpp=False)
        assert torch.equal(ours, ref), (fmt, tokens, spread, (ours.float() - ref.float()).abs().max())
        # each active expert's W read once, by both paths; idle experts' not at all
        sizes = torch.tensor([[weight_bytes(e.gate_up_proj), weight_bytes(e.down_proj)] for e in block.experts])
        active = torch.bincount(ids.flatten(), minlength=EXPERTS) > 0
        assert torch.equal(ours_read, sizes * active[:, None]) and torch.equal(ref_read, ours_read)


@pytest.mark.parametrize("fmt", ["bf16_packed", "float32", "int4"])
@pytest.mark.parametrize("weights_dtype", [torch.float32, None], ids=["float32_weights", "model_dtype_weights"])
def test_top4_routing_and_weight_dtypes(fmt, weights_dtype):
    """Four experts a token (each token's four terms summed in float32, rounded once, as index_add_
    does), with router weights in float32 or in the model's dtype."""
    _kernels()
    block = _block(fmt, top_k=4)
    for tokens, spread in [(1, "even"), (32, "even"), (32, "skewed")]:
        x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens)).to(block.gate.dtype)
        weights, ids = _routing(tokens, spread, k=4)
        weights = weights.to(weights_dtype or x.dtype)
        ours, _ = _run(block, x, weights, ids, cpp=True)
        ref, _ = _run(block, x, weights, ids, cpp=False)
        assert torch.equal(ours, ref), (fmt, tokens, spread, (ours.float() - ref.float()).abs().max())


def test_experts_with_bias_or_clamped_swiglu_keep_the_torch_path():
    _kernels()
    gpt_oss = MoeConfig(4, 2, 64, activation="clamped_swiglu", swiglu_alpha=1.702, swiglu_limit=7.0,
                        expert_bias=True, router_bias=True, scoring="topk_softmax")
    block = SparseMoeBlock(HIDDEN, gpt_oss, torch.float32)
    assert block._kernel_for(torch.zeros(1, HIDDEN)) is None
    assert SparseMoeBlock(HIDDEN, MoeConfig(4, 2, 64), torch.float32)._kernel_for(torch.zeros(1, HIDDEN)) is not None


def test_kernel_checks_its_inputs():
    _kernels()
    block = _block("int8")
    kernel = block._kernel_for(torch.zeros(1, HIDDEN))
    x = torch.randn(4, HIDDEN).bfloat16()
    weights, ids = _routing(4, "even")
    with pytest.raises(RuntimeError, match="expert id 6 out of range"):
        kernel(x, weights, torch.full_like(ids, 6), None)
    with pytest.raises(RuntimeError, match="like ids"):
        kernel(x, weights[:, :1], ids, None)
    assert kernel(x[:0], weights[:0], ids[:0], None).shape == (0, HIDDEN)
