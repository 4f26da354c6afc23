"""Quantization methods behind one interface, keyed by name.

A ``QuantMethod`` owns how one ``Linear`` (or the vocabulary embedding, which is a Linear too when
it doubles as the tied output head) stores its weight: it creates the tensors on the layer, fills
them from a checkpoint tensor or a GGUF block tensor (whole, or a shard of rows for the fused
qkv/gate_up projections), and applies the weight to activations. Models never see the difference.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Union

import torch

from kvserve.model.layers.elementwise import silu_mul

if TYPE_CHECKING:
    from kvserve.model.gguf_file import GGUFBlocks
    from kvserve.model.layers.linear import Linear

CheckpointTensor = Union[torch.Tensor, "GGUFBlocks", "InputSlice"]


class InputSlice:
    """Columns ``start:start+length`` of a checkpoint matrix (a tensor-parallel rank's inputs of a
    row-parallel layer, model/sharding.py), kept whole until a method stores it: a quantized method
    can then quantize full rows and keep its columns, so per-row parameters match the unsplit layer's."""

    def __init__(self, full: torch.Tensor | GGUFBlocks, start: int, length: int) -> None:
        self.full, self.start, self.length = full, start, length

    @property
    def shape(self) -> tuple[int, int]:
        return (self.full.shape[0], self.length)

    def __getitem__(self, rows: slice) -> InputSlice:
        return InputSlice(self.full[rows], self.start, self.length)

    def dequantize(self) -> torch.Tensor:
        full = self.full if isinstance(self.full, torch.Tensor) else self.full.dequantize()
        return full[:, self.start:self.start + self.length].contiguous()


class QuantMethod(ABC):
    """How a layer's [out_features, in_features] weight W is stored and applied."""

    name: str = ""

    @abstractmethod
    def create_weights(self, layer: Linear) -> None:
        """Register the (uninitialised) tensors that hold W on ``layer``."""

    @abstractmethod
    def weight_names(self) -> tuple[str, ...]:
        """The attributes ``create_weights`` registers (removed again if the method is swapped)."""

    @abstractmethod
    def load(self, layer: Linear, tensor: CheckpointTensor, rows: tuple[int, int] | None) -> None:
        """Fill rows ``rows`` of W (all of W if None) from a float tensor or GGUF blocks."""

    @abstractmethod
    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] -> x W^T [..., out_features], in x's dtype (no bias)."""

    @abstractmethod
    def embed(self, layer: Linear, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of W in the layer's dtype (the embedding lookup)."""

    def apply_silu_mul(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """SiLU(gate) * up of ``apply`` for a gated layer (W = [W_gate; W_up]), [..., out_features / 2]."""
        return silu_mul(self.apply(layer, x))

    def finish_loading(self, layer: Linear) -> None:
        """Called once every checkpoint tensor is in (a method may quantize only now, e.g. to use
        other weights of the model); the default has nothing left to do."""

    def kernel_spec(self, layer: Linear, kernels):
        """How the C++ fused decoder applies this layer: a ``kernels.LinearSpec`` making the same
        calls as ``apply`` on the CPU, or None if it cannot (the eager model then runs every step)."""
        return

    def describe(self) -> str:
        return self.name


_METHODS: dict[str, Callable[..., QuantMethod]] = {}


def register_quant_method(name: str) -> Callable:
    """Class decorator: make a method constructible by name (``get_quant_method(name, **options)``)."""

    def wrap(factory: Callable[..., QuantMethod]) -> Callable[..., QuantMethod]:
        _METHODS[name] = factory
        return factory

    return wrap


def quant_method_names() -> list[str]:
    _register_builtin()
    return sorted(_METHODS)


def get_quant_method(name: str, **options) -> QuantMethod:
    _register_builtin()
    if name not in _METHODS:
        raise ValueError(f"quantization method {name!r} is not registered; registered: {quant_method_names()}")
    return _METHODS[name](**options)


def _register_builtin() -> None:
    from kvserve.model.quant import methods  # noqa: F401  (registers "dense", "int8", "int4")


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and persistent buffers, counting shared storage once."""
    seen: set[int] = set()
    total = 0
    for tensor in model.state_dict(keep_vars=True).values():
        ptr = tensor.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            total += tensor.untyped_storage().nbytes()
    return total


def describe_quantization(model: torch.nn.Module) -> str:
    """How many Linear layers use each method, e.g. "int4-g32 x210, int8-g32 x1, dense x0"."""
    counts: dict[str, int] = {}
    for module in model.modules():
        method = getattr(module, "method", None)
        if isinstance(method, QuantMethod):
            counts[method.describe()] = counts.get(method.describe(), 0) + 1
    return ", ".join(f"{name} x{n}" for name, n in sorted(counts.items(), key=lambda kv: -kv[1]))
