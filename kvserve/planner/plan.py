"""One answer per setup: the memory plan and the speed estimate, as plain data for text, JSON and plots."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.planner import capacity as cap
from kvserve.planner.roofline import Roofline, compute_dtype, decode_step, prefill, weight_bytes_read


@dataclass(frozen=True)
class Plan:
    """Everything `kvserve plan` reports for one setup at one (context, users) point."""

    label: str
    model: str
    attention: str
    gpu: str
    num_gpus: int
    dtype: str
    quantization: str
    kv_cache_dtype: str
    compute_dtype: str
    params_total: int
    params_active: int
    weight_bytes: int
    kv_bytes_per_token: int
    kv_formula: str
    sliding_note: str
    context: int
    users: int
    kv_bytes_per_user: int
    kv_bytes_for_users: int
    memory_bytes: int
    overhead_bytes: int
    kv_budget_bytes: int
    kv_capacity_tokens: int
    block_size: int
    max_users_at_context: int
    max_context_at_users: int
    model_max_context: int
    fits: bool
    prefill: Roofline
    decode: Roofline
    decode_tokens_per_s: float  # all users together
    per_user_tokens_per_s: float
    single_stream_bytes_per_token: float
    single_stream_tokens_per_s: float
    bandwidth: float
    price_per_hour: float | None
    cost_per_million_output_tokens: float | None


def plan(setup: cap.Setup, context: int, users: int) -> Plan:
    """Plan ``users`` concurrent sequences of ``context`` tokens on ``setup``."""
    if context < 1:
        raise ValueError(f"context={context} must be >= 1")
    if users < 1:
        raise ValueError(f"users={users} must be >= 1")
    decode = decode_step(setup, users, context)
    throughput = users / decode.seconds
    single = _single_stream_bytes(setup, context)
    per_user = cap.kv_bytes_per_user(setup, context)
    budget = cap.kv_budget_bytes(setup)
    price = setup.hourly_price
    return Plan(
        label=setup.label, model=setup.model.name, attention=setup.model.attention_kind,
        gpu=setup.hardware.name, num_gpus=setup.num_gpus, dtype=setup.dtype,
        quantization=setup.quantization, kv_cache_dtype=setup.kv_cache_dtype,
        compute_dtype=compute_dtype(setup),
        params_total=setup.inventory.total_params, params_active=setup.inventory.active_params,
        weight_bytes=setup.weights.total, kv_bytes_per_token=cap.kv_bytes_per_token_of(setup),
        kv_formula=cap.kv_formula(setup), sliding_note=cap.sliding_note(setup),
        context=context, users=users, kv_bytes_per_user=per_user, kv_bytes_for_users=users * per_user,
        memory_bytes=cap.total_memory(setup), overhead_bytes=cap.overhead_bytes(setup),
        kv_budget_bytes=budget, kv_capacity_tokens=cap.kv_capacity_tokens_of(setup),
        block_size=setup.block_size, max_users_at_context=cap.max_users(setup, context),
        max_context_at_users=cap.max_context(setup, users), model_max_context=setup.model.max_position,
        fits=budget >= 0 and users * per_user <= budget,
        prefill=prefill(setup, context), decode=decode,
        decode_tokens_per_s=throughput, per_user_tokens_per_s=1 / decode.seconds,
        single_stream_bytes_per_token=single,
        single_stream_tokens_per_s=setup.hardware.bandwidth * setup.num_gpus / single,
        bandwidth=setup.hardware.bandwidth * setup.num_gpus, price_per_hour=price,
        cost_per_million_output_tokens=None if price is None else price / 3600 / throughput * 1e6,
    )


def _single_stream_bytes(setup: cap.Setup, context: int) -> float:
    """Bytes one lone sequence reads per generated token: all weights it touches plus its KV."""
    return weight_bytes_read(setup, 1) + cap.kv_bytes_per_user(setup, context)
