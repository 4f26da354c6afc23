"""How a plan is shown: a text table for people, JSON for machines, a users-vs-context plot for both."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvserve.planner.capacity import Setup, users_context_curve
from kvserve.planner.plan import Plan
from kvserve.planner.roofline import Roofline


def gb(nbytes: float) -> str:
    """Decimal gigabytes, as GPU datasheets count them."""
    return f"{nbytes / 1e9:,.3g} GB" if abs(nbytes) < 1e9 else f"{nbytes / 1e9:,.2f} GB"


def _users(n: int) -> str:
    return f"{n:,} user" + ("" if n == 1 else "s")


def _seconds(s: float) -> str:
    return f"{s * 1e3:,.3g} ms" if s < 1 else f"{s:,.3g} s"


def format_plan(p: Plan) -> str:
    """The plan for one setup as aligned 'what  value' lines."""
    lines = [f"== {p.label} ==", *_memory_lines(p), *_speed_lines(p)]
    return "\n".join(lines)


def _memory_lines(p: Plan) -> list[str]:
    quant = f", {p.quantization} quantization" if p.quantization != "none" else ""
    fits = "fits" if p.fits else "DOES NOT FIT"
    note = f"  [{p.sliding_note}]" if p.sliding_note else ""
    room = f"{gb(p.kv_budget_bytes)} for KV" if p.kv_budget_bytes >= 0 else (
        f"the weights do not fit: {gb(-p.kv_budget_bytes)} short, add devices (--num-gpus) or quantize")
    return [
        (f"model       {p.attention}, {p.params_total / 1e9:,.3g} B parameters ({p.params_active / 1e9:,.3g} B "
         f"active per token), trained context {p.model_max_context:,}"),
        f"weights     {gb(p.weight_bytes)} ({p.dtype}{quant})",
        f"KV / token  {p.kv_bytes_per_token:,} B = {p.kv_formula}",
        f"KV / user   {gb(p.kv_bytes_per_user)} at {p.context:,} tokens{note}",
        (f"memory      {gb(p.memory_bytes)} on {p.num_gpus} x {p.gpu}: {gb(p.overhead_bytes)} runtime overhead, "
         f"{gb(p.weight_bytes)} weights, {room}"),
        (f"capacity    {p.kv_capacity_tokens:,} KV tokens in {p.block_size}-token blocks; "
         f"max {_users(p.max_users_at_context)} at {p.context:,} tokens; "
         f"max {p.max_context_at_users:,} tokens each at {_users(p.users)}{_limit_note(p)}"),
        f"requested   {_users(p.users)} x {p.context:,} tokens need {gb(p.kv_bytes_for_users)} of KV: {fits}",
    ]


def _limit_note(p: Plan) -> str:
    return " (the model's position limit)" if p.max_context_at_users >= p.model_max_context else ""


def _speed_lines(p: Plan) -> list[str]:
    lines = [
        (f"prefill     {p.context:,}-token prompt alone (TTFT): {_seconds(p.prefill.seconds)}, "
         f"{p.prefill.bound} bound ({p.compute_dtype} matmuls, ideal roofline)"),
        (f"decode      batch {p.users:,} at {p.context:,} tokens: {_seconds(p.decode.seconds)} per step, "
         f"{p.decode.bound} bound; {p.decode_tokens_per_s:,.4g} tok/s total, "
         f"{p.per_user_tokens_per_s:,.4g} tok/s per user"),
        (f"{_single_label(p)} {p.single_stream_tokens_per_s:,.4g} tok/s = {p.bandwidth / 1e9:,.0f} GB/s / "
         f"{gb(p.single_stream_bytes_per_token)} read per token (weights + KV at {p.context:,})"),
    ]
    if p.cost_per_million_output_tokens is not None:
        lines.append(f"cost        ${p.cost_per_million_output_tokens:,.3g} per 1M output tokens at "
                     f"${p.price_per_hour:,.2f}/h, batch {p.users:,}")
    return lines


def _single_label(p: Plan) -> str:
    if p.gpu.startswith("local"):
        return "PREDICTED single-stream decode on this machine:"
    return "1 stream   "


def format_text(plans: Sequence[Plan]) -> str:
    return "\n\n".join(format_plan(p) for p in plans) + "\n"


def plan_dict(p: Plan) -> dict[str, Any]:
    """A plan as JSON-ready data; roofline entries carry their time and bound."""
    out = dataclasses.asdict(p)
    for key in ("prefill", "decode"):
        roof: Roofline = getattr(p, key)
        out[key] = {**dataclasses.asdict(roof), "seconds": roof.seconds, "bound": roof.bound}
    return out


def format_json(plans: Sequence[Plan]) -> str:
    return json.dumps({"plans": [plan_dict(p) for p in plans]}, indent=2) + "\n"


def plot(setups: Sequence[Setup], plans: Sequence[Plan], path: str | Path) -> Path:
    """Max concurrent users against context, one curve per setup; a setup fits where its curve passes above the star."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for setup, p in zip(setups, plans):
        points = [(c, u) for c, u in users_context_curve(setup) if u > 0]
        if points:
            line, = ax.plot(*zip(*points), label=f"{p.label}: {p.max_users_at_context:,} users at {p.context:,}")
            ax.plot([p.context], [max(p.max_users_at_context, 1)], "o", color=line.get_color())
    ax.plot([plans[0].context], [plans[0].users], "k*", markersize=12,
            label=f"requested: {plans[0].users:,} users x {plans[0].context:,} tokens")
    ax.set(xscale="log", yscale="log", xlabel="context per user (tokens)", ylabel="max concurrent users",
           title="KV-cache capacity: concurrent users against context per user")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
