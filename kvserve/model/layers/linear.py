"""Linear layers whose weight storage is a pluggable quantization method (dense float by default).

Weights are created uninitialised: the loader picks each layer's method (``set_method``) and then
fills every weight through ``load_checkpoint``, routing shards of fused layers by rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from kvserve.model.layers.elementwise import silu_mul
from kvserve.model.quant.registry import CheckpointTensor, QuantMethod, get_quant_method


class Linear(torch.nn.Module):
    """y = x W^T (+ b). ``shards`` names the checkpoint tensors stacked into this weight, if any."""

    # Whether rows of W are looked up (token embeddings): a method must then be able to read a row of W
    # cheaply (the dense method keeps W as stored besides its packed copy; int4 / int8 strips gather it).
    row_lookup = False
    # Whether a quantization option may change this layer's storage (a MoE router may not).
    quantizable = True

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 shards: dict[str, tuple[int, int]] | None = None, gated: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features, self.dtype = in_features, out_features, dtype
        # gated: W = [W_gate; W_up], an MLP's fused projection whose output is only ever used as
        # SiLU(gate) * up (``project_silu_mul``); a method may store W so as to compute that directly.
        self.gated = gated
        self.bias = torch.nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        # shard name -> (row offset, rows) inside this fused weight, e.g. {"q_proj": (0, 576), ...}
        self.shards = shards or {}
        self.method: QuantMethod | None = None
        self.set_method(get_quant_method("dense"))
        # How much each input matters to the output, if the model knows (a [in_features] tensor from a
        # callable, read after loading): the preceding RMSNorm's squared weights, say. Quantizers
        # that search may weight their rounding error by it.
        self.input_importance: Callable[[], torch.Tensor] | None = None

    def set_method(self, method: QuantMethod) -> None:
        """Swap the weight storage (before loading): drops the old method's tensors, creates the new."""
        if self.method is not None:
            for name in self.method.weight_names():
                if hasattr(self, name):
                    delattr(self, name)
        self.method = method
        method.create_weights(self)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, x)
        return y if self.bias is None else y + self.bias

    def project_silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """SiLU(gate) * up of y = x W^T (+ b) = [gate | up]: [..., out_features / 2]."""
        if self.bias is not None:
            return silu_mul(self.project(x))
        return self.method.apply_silu_mul(self, x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x)

    def load_weight(self, kind: str, tensor: CheckpointTensor, rows: tuple[int, int] | None, name: str) -> None:
        """Fill the weight or bias (rows ``rows`` of it for a shard) from checkpoint tensor ``name``."""
        if kind == "bias":
            dest = self.bias.data if rows is None else self.bias.data[rows[0]:rows[0] + rows[1]]
            _copy_checked(dest, tensor, name)
            return
        want = (self.out_features if rows is None else rows[1], self.in_features)
        if tuple(tensor.shape) != want:
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {want}")
        self.method.load(self, tensor, rows)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, method={self.method.describe()}"


class VocabEmbedding(Linear):
    """Token embedding [vocab, hidden]; ``project`` uses it as the tied output head."""

    row_lookup = True

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__(hidden_size, vocab_size, False, dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.method.embed(self, ids)


def _copy_checked(dest: torch.Tensor, tensor: CheckpointTensor, name: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        tensor = tensor.dequantize()
    if tuple(dest.shape) != tuple(tensor.shape):
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
    dest.copy_(tensor)


def load_checkpoint(model: torch.nn.Module, weights: Iterable[tuple[str, CheckpointTensor]],
                    skip: tuple[str, ...] = ()) -> None:
    """Copy checkpoint tensors (HF names) into ``model``: Linear weights through their method (q/k/v
    and gate/up shards into their fused layer by rows), everything else into its parameter.

    Names starting with a prefix in ``skip`` are ignored. Raises ValueError if a tensor has no place
    or the wrong shape, or if something is left unfilled.
    """
    targets = _linear_targets(model)
    params = _plain_parameters(model)
    filled: set[str] = set()
    for name, tensor in weights:
        if name.startswith(skip) or "rotary_emb" in name:
            continue
        if name in targets:
            layer, kind, rows = targets[name]
            layer.load_weight(kind, tensor, rows, name)
        elif name in params:
            _copy_checked(params[name].data, tensor, name)
        else:
            raise ValueError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
        filled.add(name)
    missing = sorted(n for n in [*targets, *params] if n not in filled)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
    for layer in {id(t[0]): t[0] for t in targets.values()}.values():
        layer.method.finish_loading(layer)


def _linear_targets(model: torch.nn.Module) -> dict[str, tuple[Linear, str, tuple[int, int] | None]]:
    """Checkpoint name -> (layer, "weight" | "bias", rows or None) for every Linear."""
    out = {}
    for mod_name, mod in model.named_modules():
        if not isinstance(mod, Linear):
            continue
        kinds = ("weight", "bias") if mod.bias is not None else ("weight",)
        if mod.shards:
            parent = mod_name.rsplit(".", 1)[0]
            for shard, rows in mod.shards.items():
                out.update({f"{parent}.{shard}.{kind}": (mod, kind, rows) for kind in kinds})
        else:
            out.update({f"{mod_name}.{kind}": (mod, kind, None) for kind in kinds})
    return out


def _plain_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Parameters that are not a Linear's (norm weights...): filled by a plain copy."""
    owned = {f"{mod_name}.{p}" for mod_name, mod in model.named_modules() if isinstance(mod, Linear)
             for p, _ in mod.named_parameters(recurse=False)}
    return {n: p for n, p in model.named_parameters() if n not in owned}
