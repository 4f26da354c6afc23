"""Rotary position embeddings (RoPE) with a precomputed cos/sin table indexed by position.

Partial rotary (``rotary_fraction`` < 1, Phi-4-mini) rotates only the first R of a head's D dims,
pairing dim i with i + R/2. The kernels pair i with i + D/2 over the whole head, so q and k rows are
reordered at load time (``partial_rotary_order``) to put the rotating pairs at (i, i + D/2) for
i < R/2; the remaining pairs get cos 1, sin 0 and pass through unchanged. q and k share the order,
so their dot products, and so attention, are those of the checkpoint.
"""

from __future__ import annotations

import math

import torch

from kvserve.config import RopeConfig
from kvserve.model.layers.elementwise import apply_rotary_, apply_rotary_reference_


def rotary_dims(rope: RopeConfig, head_dim: int) -> int:
    """How many of a head's dims rotate (transformers: int(head_dim * partial_rotary_factor))."""
    dims = int(head_dim * rope.rotary_fraction)
    if dims <= 0 or dims % 2 or dims > head_dim:
        raise ValueError(f"partial_rotary_factor={rope.rotary_fraction} gives {dims} rotary dims of {head_dim}; "
                         "need an even number in (0, head_dim]")
    return dims


def partial_rotary_order(head_dim: int, dims: int) -> list[int]:
    """For each dim of the kernels' layout, the checkpoint dim it holds (see the module doc)."""
    half, rot_half = head_dim // 2, dims // 2
    first = list(range(rot_half)) + [dims + j for j in range(half - rot_half)]
    second = [rot_half + j for j in range(rot_half)] + [dims + half - rot_half + j for j in range(half - rot_half)]
    return first + second


def uses_long_factors(rope: RopeConfig, max_position: int) -> bool:
    """LongRoPE: transformers switches to the long factors once a sequence outgrows the original
    context, and then recomputes the whole cache with them. A paged cache shared across requests
    cannot re-rotate as one sequence grows, so the choice is made once, by the longest sequence the
    engine runs (as vLLM does): short factors within the original context, long ones beyond."""
    return max_position > rope.original_max_position


def inverse_frequencies(rope: RopeConfig, head_dim: int, max_position: int = 0) -> torch.Tensor:
    """Per-pair rotation frequencies of the rotating dims, with the scaling variants a config may
    name; ``max_position`` picks LongRoPE's factors."""
    dims = rotary_dims(rope, head_dim)
    exponent = torch.arange(0, dims, 2, dtype=torch.int64).float() / dims
    if rope.rope_type == "longrope":
        factors = rope.long_factor if uses_long_factors(rope, max_position) else rope.short_factor
        if len(factors) != dims // 2:
            raise ValueError(f"rope_scaling: LongRoPE needs {dims // 2} short and long factors, got "
                             f"{len(rope.short_factor)} and {len(rope.long_factor)}")
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * rope.theta**exponent)
    inv_freq = 1.0 / (rope.theta ** exponent)
    if rope.rope_type == "default":
        return inv_freq
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scaling(inv_freq, rope)
    if rope.rope_type == "yarn":
        return _yarn_scaling(rope.theta**exponent, rope, dims)
    raise ValueError(f"rope_type={rope.rope_type!r} is not supported; supported: default, linear, llama3, longrope, "
                     "yarn")


def _llama3_scaling(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, blend smoothly in between."""
    low_wavelen = rope.original_max_position / rope.low_freq_factor
    high_wavelen = rope.original_max_position / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, blended, scaled)


def _yarn_scaling(powers: torch.Tensor, rope: RopeConfig, dims: int) -> torch.Tensor:
    """YaRN: pair i (``powers[i]`` = theta ** (2i / dims), its unscaled frequency's inverse) keeps its
    frequency if it turns more than ``beta_fast`` times over the original context, is divided by
    ``factor`` if fewer than ``beta_slow``, and blends linearly in between (by pair index). Its gain
    on cos/sin is ``rope.attention_factor`` (config.py)."""

    def pair_of(turns: float) -> float:  # the (fractional) pair index that turns ``turns`` times
        return dims * math.log(rope.original_max_position / (turns * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = pair_of(rope.beta_fast), pair_of(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    if low == high:
        high += 0.001  # a step, not a division by zero
    ramp = ((torch.arange(dims // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # written as transformers computes it, so a float32 model's table matches bit for bit
    return 1.0 / (rope.factor * powers) * (1 - kept) + 1.0 / powers * kept


class RotaryEmbedding(torch.nn.Module):
    """Applies RoPE in the "rotate half" layout that Hugging Face checkpoints use."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_position: int) -> None:
        super().__init__()
        self.half, self.gain = head_dim // 2, rope.attention_factor
        self.register_buffer("inv_freq", inverse_frequencies(rope, head_dim, max_position), persistent=False)
        cos, sin = self._rows(torch.arange(max_position, dtype=torch.float32))
        self.register_buffer("cos", cos, persistent=False)  # [max_pos, D/2], float32
        self.register_buffer("sin", sin, persistent=False)
        # Attention sinks run sequences past the table; their positions' rows are computed per call.
        self.any_position = False

    def _rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None] * self.inv_freq[None, :]
        cos, sin = freqs.cos() * self.gain, freqs.sin() * self.gain
        rest = self.half - self.inv_freq.numel()
        if rest:  # partial rotary: the other pairs pass through
            cos = torch.cat((cos, cos.new_ones(len(positions), rest)), dim=1)
            sin = torch.cat((sin, sin.new_zeros(len(positions), rest)), dim=1)
        return cos, sin

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
        """Rotates q: [T, Hq, D] and k: [T, Hkv, D] in place (views into a fused qkv output are fine);
        positions: [T]."""
        if self.any_position and len(positions) and int(positions.max()) >= len(self.cos):
            cos, sin = self._rows(positions.float())  # the table's formula: the same rows where they overlap
            apply_rotary_(torch.arange(len(positions), device=positions.device), q, k, cos, sin)
            return
        apply_rotary_(positions, q, k, self.cos, self.sin)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> None:
        """Rotates x: [T, H, D] alone in place (PyTorch ops: a side path, not the hot one)."""
        cos, sin = self._rows(positions.float())
        apply_rotary_reference_(torch.arange(len(positions), device=positions.device), x, x[:, :0], cos, sin)
