"""Roofline time estimates: a step takes max(FLOPs / peak FLOP/s, bytes moved / bandwidth).

Decode reads every weight once per step whatever the batch, plus each user's KV, and does about
2 FLOPs per active parameter per token: at small batch the bytes win (memory bound), which is why
batching raises throughput almost for free until the FLOPs catch up. Prefill multiplies a whole
prompt against each weight it reads, so it is compute bound for all but the shortest prompts.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.planner.capacity import Setup, kv_bytes_per_token_of, kv_bytes_per_user
from kvserve.planner.weights import quant_scheme


@dataclass(frozen=True)
class Roofline:
    """One step's work and the time each resource alone would take."""

    flops: float
    bytes: float
    compute_seconds: float
    memory_seconds: float

    @property
    def seconds(self) -> float:
        return max(self.compute_seconds, self.memory_seconds)

    @property
    def bound(self) -> str:
        return "compute" if self.compute_seconds >= self.memory_seconds else "memory"


def compute_dtype(setup: Setup) -> str:
    """The dtype matmuls run in: fp8 for W8A8 schemes, else the model dtype (weights dequantized)."""
    return "fp8" if quant_scheme(setup.quantization).compute == "fp8" else setup.dtype


def _roofline(setup: Setup, flops: float, nbytes: float) -> Roofline:
    hw, n = setup.hardware, setup.num_gpus
    peak = hw.peak_flops(compute_dtype(setup)) * n
    return Roofline(flops, nbytes, flops / peak, nbytes / (hw.bandwidth * n))


def attention_flops(setup: Setup, pairs: float, pairs_sliding: float) -> float:
    """FLOPs of QK^T and AV over ``pairs`` (query, key) pairs per full layer, ``pairs_sliding`` per sliding one.

    For one decoding token the pairs are its context; for a prompt, the causal triangle.
    """
    m = setup.model
    if m.mla is not None:  # absorbed MLA: scores against latent + rope key, values from the latent
        width = m.mla.kv_lora_rank + m.mla.qk_rope_head_dim + m.mla.kv_lora_rank
    else:
        width = 2 * m.head_dim
    sliding = m.num_sliding_layers if setup.cap_sliding_window and m.sliding_window else 0
    per_layer = 2 * m.num_heads * width
    return per_layer * ((m.num_layers - sliding) * pairs + sliding * pairs_sliding)


def _window(setup: Setup, context: int) -> int:
    return min(context, setup.model.sliding_window or context)


def expected_experts_touched(num_experts: int, per_token: int, tokens: int) -> float:
    """Distinct experts a batch of ``tokens`` routes to, if routing were uniform and independent."""
    return num_experts * (1 - (1 - per_token / num_experts) ** tokens)


def weight_bytes_read(setup: Setup, tokens: int) -> float:
    """Weight bytes a forward pass over ``tokens`` tokens streams from memory.

    Every dense weight and the output head once; of the experts only those routed to; of an
    untied input embedding only the looked-up rows.
    """
    w, m = setup.weights, setup.model
    routed = w.routed_linear
    if m.moe is not None:
        routed *= expected_experts_touched(m.moe.num_experts, m.moe.experts_per_token, tokens) / m.moe.num_experts
    embed = w.embedding if m.tie_word_embeddings else w.embedding * min(tokens / m.vocab_size, 1.0)
    return w.dense_linear + routed + embed + w.lm_head + w.vectors


def _matmul_params_per_token(setup: Setup) -> float:
    """Parameters one token multiplies through in the layers (routed experts by their share)."""
    inv = setup.inventory
    routed = sum(m.params for m in inv.matrices if m.routed)
    return inv.linear_params - routed * (1 - inv.active_expert_fraction)


def decode_step(setup: Setup, users: int, context: int) -> Roofline:
    """One decode step for ``users`` sequences each at ``context`` tokens: one new token each."""
    head = setup.inventory.lm_head.rows * setup.inventory.lm_head.cols  # tied or not, the head multiplies
    flops_per_token = 2 * (_matmul_params_per_token(setup) + head)
    flops = users * (flops_per_token + attention_flops(setup, context, _window(setup, context)))
    nbytes = weight_bytes_read(setup, users) + users * kv_bytes_per_user(setup, context)
    return _roofline(setup, flops, nbytes)


def prefill(setup: Setup, prompt_tokens: int) -> Roofline:
    """Prefill of one prompt (the time to first token when it runs alone).

    Every prompt token goes through the layers; only the last one through the output head. Causal
    attention sums 1..T attended tokens (capped at the window on sliding layers).
    """
    t = max(prompt_tokens, 1)
    head = setup.inventory.lm_head.rows * setup.inventory.lm_head.cols
    w = setup.model.sliding_window or t
    causal_full = t * (t + 1) / 2
    causal_window = causal_full if t <= w else w * (w + 1) / 2 + (t - w) * w
    flops = 2 * (t * _matmul_params_per_token(setup) + head) + attention_flops(setup, causal_full, causal_window)
    nbytes = weight_bytes_read(setup, t) + t * kv_bytes_per_token_of(setup)
    return _roofline(setup, flops, nbytes)


def prefill_batch(setup: Setup, users: int, prompt_tokens: int) -> Roofline:
    """Prefill of ``users`` prompts of ``prompt_tokens`` together: their FLOPs, the weights read once."""
    one = prefill(setup, prompt_tokens)
    tokens = users * max(prompt_tokens, 1)
    nbytes = weight_bytes_read(setup, tokens) + tokens * kv_bytes_per_token_of(setup)
    return _roofline(setup, users * one.flops, nbytes)


def attended_keys(start: int, tokens: int, window: int | None) -> float:
    """Keys attended, summed over a chunk of ``tokens`` prompt tokens after ``start`` cached ones:
    token i (from 1) attends to i keys, at most ``window``."""
    lo, hi = start + 1, start + tokens
    if window is None or hi <= window:
        return (lo + hi) * tokens / 2
    below = max(0, window - lo + 1)  # the chunk's tokens that attend to fewer than ``window`` keys
    return (2 * lo + below - 1) * below / 2 + (tokens - below) * window


def mixed_step(setup: Setup, decode_contexts: list[int], prefill_chunks: list[tuple[int, int]]) -> Roofline:
    """One continuous-batching step: a token for each sequence in ``decode_contexts`` (its context),
    and for each ``(start, tokens)`` of ``prefill_chunks`` a prompt chunk after ``start`` tokens already
    cached (a prefix hit or earlier chunks). Weights are read once for the whole step."""
    head = setup.inventory.lm_head.rows * setup.inventory.lm_head.cols
    tokens = len(decode_contexts) + sum(n for _, n in prefill_chunks)
    window = setup.model.sliding_window
    flops = 2 * tokens * _matmul_params_per_token(setup) + 2 * head * (len(decode_contexts) + len(prefill_chunks))
    flops += sum(attention_flops(setup, c, _window(setup, c)) for c in decode_contexts)
    flops += sum(attention_flops(setup, attended_keys(s, n, None), attended_keys(s, n, window))
                 for s, n in prefill_chunks)
    nbytes = (weight_bytes_read(setup, tokens) + sum(kv_bytes_per_user(setup, c) for c in decode_contexts)
              + sum(s + n for s, n in prefill_chunks) * kv_bytes_per_token_of(setup))
    return _roofline(setup, flops, nbytes)
