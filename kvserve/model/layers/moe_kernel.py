"""The routed experts of a MoE block in one C++ call on the CPU (layers/csrc/moe.cpp): from the
router's weights and expert ids to the block's output.

Per projection, the rows of W of every active expert are cut into strips that the threads take
together in one parallel region, instead of one region (and one Python call) per expert and
projection: with a few tokens per expert, the threads otherwise spend the step waking up and
waiting on one small matrix at a time. The pairs' sort, gather, weighting and sum happen in the
call too. The output is bitwise the torch path's (``SparseMoeBlock.run_experts``). Experts with
another activation than SiLU(gate) * up or with biases (gpt-oss) keep the torch path, as does
every other device.
"""

from __future__ import annotations

import os

import torch

from kvserve.model.cpu_kernels import load_kernels

# "0": the experts run one Python call each (the torch path), e.g. to compare the two.
SWITCH = "KVSERVE_MOE_CPU_KERNEL"


def cpu_kernel_wanted() -> bool:
    """Whether MoE blocks use the C++ call where they can (the SWITCH environment variable)."""
    return os.environ.get(SWITCH, "1") != "0"


def experts_kernel(experts: torch.nn.ModuleList):
    """``kernels.MoeExperts`` for these GatedMLP experts, or None where the kernels are not built or
    an expert cannot run in it (an activation of its own, biases, a weight without a kernel spec)."""
    kernels = load_kernels()
    if kernels is None:
        return None
    gate_up, down = [], []
    for expert in experts:
        if expert.act is not None:
            return None
        for layer, specs in ((expert.gate_up_proj, gate_up), (expert.down_proj, down)):
            spec = None if layer.bias is not None else layer.method.kernel_spec(layer, kernels)
            if spec is None:
                return None
            specs.append(spec)
    return kernels.MoeExperts(gate_up, down)


def weight_bytes(layer: torch.nn.Module) -> int:
    """Bytes of the tensors that hold a Linear's W: what one pass over it reads."""
    return sum(t.nbytes for name in layer.method.weight_names()
               if isinstance(t := getattr(layer, name, None), torch.Tensor))
