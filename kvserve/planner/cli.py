"""`kvserve plan MODEL`: how many users, how long a context, how fast and at what cost, before buying GPUs.

Registered on the main CLI through ``add_parser(subparsers)``; also runnable alone as
``python -m kvserve.planner.cli plan ...``. Comma-separated --gpu, --quantization and
--kv-cache-dtype values plan every combination side by side (and plot them together).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import re
import sys
from collections.abc import Sequence

from kvserve.planner.capacity import Setup
from kvserve.planner.hardware import GB, TFLOP, Hardware, lookup_gpu, measure_local
from kvserve.planner.models import resolve_model
from kvserve.planner.plan import Plan, plan
from kvserve.planner.report import format_json, format_text
from kvserve.planner.shape import ModelShape
from kvserve.planner.weights import QUANT_SCHEMES, canonical_dtype

DEFAULT_GPU = "H100-SXM"
_TOKEN_UNITS = {"": 1, "k": 1024, "m": 1024**2}
_BYTE_UNITS = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_tokens(text: str) -> int:
    """'4096', '4K' or '16k' (K = 1024 tokens, as context lengths are quoted)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a token count like 4096 or 16K")
    return int(float(m.group(1)) * _TOKEN_UNITS[m.group(2).lower()])


def parse_bytes(text: str, default_unit: str = "b") -> int:
    """'2GiB', '80GB', '2147483648'; a bare number is in ``default_unit``."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?(?:e\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = (m.group(2) or default_unit).lower() if m else ""
    if not m or unit not in _BYTE_UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 80GB, 94GiB or 2e9")
    return int(float(m.group(1)) * _BYTE_UNITS[unit])


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `plan` on a subparsers object; the parsed args carry ``func=run_plan``."""
    p = subparsers.add_parser("plan", help="capacity planner: memory, users, context, speed and cost",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default="default",
                   help="model folder (config.json), .gguf file, or a known name (default: the bundled model)")
    _add_hardware_args(p)
    p.add_argument("--dtype", default="auto", help="weight dtype: float32, bfloat16, float16 "
                   "(auto: bfloat16 on GPUs and on a local CPU with the bf16 kernels, else float32, as the "
                   "engine runs a 16-bit checkpoint)")
    p.add_argument("--quantization", type=_csv, default=["none"], help=f"weights: {', '.join(QUANT_SCHEMES)}")
    p.add_argument("--kv-cache-dtype", type=_csv, default=["auto"], help="auto (= dtype), bfloat16, fp8, int8...")
    p.add_argument("--context", type=parse_tokens, default=4096, help="tokens per user, e.g. 4096 or 16K")
    p.add_argument("--users", type=int, default=1, help="concurrent users (the decode batch)")
    p.add_argument("--price-per-hour", type=float, default=None,
                   help="USD per device-hour (default: the table's rough price)")
    p.add_argument("--overhead", type=float, default=0.10, help="fraction of memory kept for runtime overhead")
    p.add_argument("--block-size", type=int, default=16, help="KV block size in tokens (the engine's)")
    p.add_argument("--kv-cache-memory", type=parse_bytes, default=None,
                   help="fixed KV budget, like the engine's kv_cache_memory_bytes, e.g. 2GiB "
                   "(default: all memory left after weights and overhead)")
    p.add_argument("--full-attention", action="store_true",
                   help="size sliding-window layers for the full context (an engine that never frees their blocks)")
    p.add_argument("--plot", default=None, help="write the users-vs-context trade-off curve to this PNG")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=run_plan)
    return p


def _add_hardware_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpu", type=_csv, default=None,
                   help=f"accelerator(s) from the table, or 'local' to measure this machine (default {DEFAULT_GPU})")
    p.add_argument("--gpu-memory", type=lambda s: parse_bytes(s, "gb"), default=None, help="memory per device, GB")
    p.add_argument("--bandwidth", type=float, default=None, help="memory bandwidth per device, GB/s")
    p.add_argument("--flops", type=float, default=None, help="peak matmul TFLOP/s per device for the dtype")
    p.add_argument("--num-gpus", type=int, default=1, help="devices, tensor parallel (memory and speed add up)")


def resolve_dtype(dtype: str, gpu: str) -> str:
    """'auto' picks what the engine's "auto" runs a 16-bit checkpoint in: bfloat16 on an accelerator
    or a CPU with the bf16 kernels (AVX512-BF16 / AMX), else float32."""
    if dtype != "auto":
        return canonical_dtype(dtype)
    if gpu != "local":
        return "bfloat16"
    import torch

    if torch.cuda.is_available():
        return "bfloat16"
    from kvserve.model.cpu_kernels import cpu_has_native_bf16

    return "bfloat16" if cpu_has_native_bf16() else "float32"


def build_hardware(gpu: str | None, dtype: str, args: argparse.Namespace) -> Hardware:
    """A table entry, this machine measured, or a custom device; --gpu-memory etc. override fields."""
    overrides = {k: v for k, v in (("memory_bytes", args.gpu_memory),
                                   ("bandwidth", args.bandwidth and args.bandwidth * GB)) if v}
    if args.flops:
        flops = args.flops * TFLOP
        overrides.update(fp32_flops=flops, bf16_flops=flops, fp8_flops=flops)
    if gpu is None and {"memory_bytes", "bandwidth", "bf16_flops"} <= overrides.keys():
        return Hardware("custom", **overrides)
    hw = measure_local(dtype) if gpu == "local" else lookup_gpu(gpu or DEFAULT_GPU)
    return dataclasses.replace(hw, **overrides)


def build_setups(args: argparse.Namespace, model: ModelShape) -> list[Setup]:
    """One Setup per combination of --gpu, --quantization and --kv-cache-dtype."""
    setups = []
    for gpu, quant, kv in itertools.product(args.gpu or [None], args.quantization, args.kv_cache_dtype):
        dtype = resolve_dtype(args.dtype, gpu or "")
        setups.append(Setup(
            model=model, hardware=build_hardware(gpu, dtype, args), num_gpus=args.num_gpus, dtype=dtype,
            quantization=quant, kv_cache_dtype=kv, overhead_fraction=args.overhead,
            block_size=args.block_size, kv_cache_memory_bytes=args.kv_cache_memory,
            cap_sliding_window=not args.full_attention, price_per_hour=args.price_per_hour,
        ))
    return setups


def make_plans(args: argparse.Namespace) -> tuple[list[Setup], list[Plan]]:
    name, cfg = resolve_model(args.model)
    setups = build_setups(args, ModelShape.from_hf(cfg, name))
    return setups, [plan(s, args.context, args.users) for s in setups]


def run_plan(args: argparse.Namespace) -> int:
    """Print the plan (text or JSON), optionally plot it; 2 with a one-line message on a bad option."""
    try:
        setups, plans = make_plans(args)
    except ValueError as err:
        print(f"kvserve plan: error: {err}", file=sys.stderr)
        return 2
    sys.stdout.write(format_json(plans) if args.json else format_text(plans))
    if args.plot:
        from kvserve.planner.report import plot

        out = plot(setups, plans, args.plot)
        if not args.json:
            print(f"plot written to {out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvserve")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
