"""Accelerators as data (memory, bandwidth, peak FLOP/s, rough price) and a quick measurement of this machine.

Figures are vendor datasheet peaks per device, dense (no 2:4 sparsity), decimal units
(1 GB = 1e9 bytes), so a plan is an ideal roofline: real kernels reach perhaps 60-80% of
bandwidth and less of peak FLOP/s. Prices are rough on-demand cloud rates in USD per GPU-hour,
only there to give a cost order of magnitude; pass --price-per-hour for a real quote.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

GB, TB, TFLOP = 1e9, 1e12, 1e12


@dataclass(frozen=True)
class Hardware:
    """One accelerator: how much it holds, how fast it streams memory, how fast it multiplies."""

    name: str
    memory_bytes: int
    bandwidth: float  # bytes/s from device memory
    fp32_flops: float
    bf16_flops: float  # also the fp16 rate
    fp8_flops: float | None = None  # None: no fp8 tensor cores, fp8 runs at the bf16 rate
    price_per_hour: float | None = None

    def __post_init__(self) -> None:
        for field in ("memory_bytes", "bandwidth", "fp32_flops", "bf16_flops"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field}={getattr(self, field)} for GPU {self.name!r} must be > 0")

    def peak_flops(self, compute: str) -> float:
        """Peak FLOP/s for a compute dtype: 'float32', 'bfloat16'/'float16' or 'fp8'."""
        if compute == "fp8":
            return self.fp8_flops or self.bf16_flops
        return self.fp32_flops if compute == "float32" else self.bf16_flops


GPU_TABLE: dict[str, Hardware] = {h.name: h for h in (
    Hardware("H100-SXM", int(80 * GB), 3.35 * TB, 67 * TFLOP, 989 * TFLOP, 1979 * TFLOP, 2.50),
    Hardware("H100-PCIe", int(80 * GB), 2.0 * TB, 51 * TFLOP, 756 * TFLOP, 1513 * TFLOP, 2.20),
    Hardware("H200", int(141 * GB), 4.8 * TB, 67 * TFLOP, 989 * TFLOP, 1979 * TFLOP, 3.50),
    Hardware("B200", int(180 * GB), 8.0 * TB, 75 * TFLOP, 2250 * TFLOP, 4500 * TFLOP, 6.00),
    Hardware("A100-80GB", int(80 * GB), 2.039 * TB, 19.5 * TFLOP, 312 * TFLOP, None, 1.80),
    Hardware("A100-40GB", int(40 * GB), 1.555 * TB, 19.5 * TFLOP, 312 * TFLOP, None, 1.30),
    Hardware("L40S", int(48 * GB), 0.864 * TB, 91.6 * TFLOP, 362 * TFLOP, 733 * TFLOP, 1.00),
    Hardware("L4", int(24 * GB), 0.300 * TB, 30.3 * TFLOP, 121 * TFLOP, 242.5 * TFLOP, 0.70),
    Hardware("A10", int(24 * GB), 0.600 * TB, 31.2 * TFLOP, 125 * TFLOP, None, 0.75),
    Hardware("RTX-4090", int(24 * GB), 1.008 * TB, 82.6 * TFLOP, 165.2 * TFLOP, 330.3 * TFLOP, 0.40),
    Hardware("T4", int(16 * GB), 0.320 * TB, 8.1 * TFLOP, 65 * TFLOP, None, 0.35),
    Hardware("MI300X", int(192 * GB), 5.3 * TB, 163.4 * TFLOP, 1307 * TFLOP, 2615 * TFLOP, 2.50),
)}
_ALIASES = {"h100": "H100-SXM", "a100": "A100-80GB", "4090": "RTX-4090", "mi300": "MI300X"}


def known_gpus() -> list[str]:
    return list(GPU_TABLE) + ["local"]


def lookup_gpu(name: str) -> Hardware:
    """A table entry by name (case-insensitive); ValueError lists the known names."""
    key = _ALIASES.get(name.lower(), name).lower()
    for gpu_name, hw in GPU_TABLE.items():
        if gpu_name.lower() == key:
            return hw
    raise ValueError(f"gpu={name!r} is not in the table; known: {', '.join(known_gpus())} "
                     "(or give --gpu-memory, --bandwidth and --flops)")


def measure_local(dtype: str = "float32", copy_bytes: int = 256 * 2**20, seconds: float = 0.5,
                  device: str | None = None) -> Hardware:
    """This machine, measured: copy bandwidth of a large tensor and matmul FLOP/s in ``dtype``.

    Uses ``device`` ("cpu" or "cuda"); by default the GPU when torch sees one, else the CPU and its
    RAM. Takes about ``2 * seconds``. The FLOP/s measured for ``dtype`` stands in for every compute
    dtype of the entry.
    """
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    bandwidth = _copy_bandwidth(torch, device, copy_bytes, seconds)
    flops = _matmul_flops(torch, device, getattr(torch, dtype), seconds)
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        name, memory = f"local ({props.name})", int(props.total_memory)
    else:
        name, memory = f"local (cpu, {torch.get_num_threads()} threads)", _physical_memory()
    return Hardware(name, memory, bandwidth, flops, flops, flops, None)


def _best_rate(work: float, fn, sync, seconds: float) -> float:
    """Best work/second over repeated runs within ``seconds`` (after one warm-up run)."""
    fn()
    sync()
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline or best == 0.0:
        start = time.perf_counter()
        fn()
        sync()
        best = max(best, work / max(time.perf_counter() - start, 1e-9))
    return best


def measure_copy_bandwidth(copy_bytes: int = 256 * 2**20, seconds: float = 0.5, device: str = "cpu") -> float:
    """``measure_local``'s bandwidth figure alone (bytes read plus written per second by a large copy)."""
    import torch

    return _copy_bandwidth(torch, device, copy_bytes, seconds)


def _copy_bandwidth(torch, device: str, nbytes: int, seconds: float) -> float:
    """Bytes read plus bytes written per second by ``dst.copy_(src)``, larger than any cache."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return _best_rate(2 * src.numel() * 4, lambda: dst.copy_(src), _sync(torch, device), seconds)


# (M, K, N) matmuls whose best rate is taken as the peak. On CPUs one shape is not enough: with 2
# threads and AMX, 1024^3 bf16 ran at 1.2 TFLOP/s here, 2048^3 at 2.1, and a small model's
# 2048 x 576 x 3072 projection at 2.7, so a single square size understated the peak by half.
_CPU_SHAPES = ((1024, 1024, 1024), (2048, 2048, 2048), (2048, 512, 4096), (2048, 576, 3072))
_CUDA_SHAPES = ((4096, 4096, 4096), (8192, 8192, 8192))


def _matmul_flops(torch, device: str, dtype, seconds: float) -> float:
    """The best FLOP/s over a few shapes, each product written into a preallocated output. On a CPU a
    16-bit dtype counts float32's rate too where that is higher: without bf16 arithmetic (AVX2) the
    kernels multiply bf16 weights in float32, and torch's own bf16 matmul is emulated there (5x slower)."""
    shapes = _CUDA_SHAPES if device == "cuda" else _CPU_SHAPES
    dtypes = [dtype] if device == "cuda" or dtype == torch.float32 else [dtype, torch.float32]
    best = 0.0
    for m, k, n in shapes:
        for dt in dtypes:
            a = torch.randn(m, k, device=device).to(dt)
            b = torch.randn(k, n, device=device).to(dt)
            out = torch.empty(m, n, device=device, dtype=dt)
            def product(a=a, b=b, out=out):
                return torch.mm(a, b, out=out)
            best = max(best, _best_rate(2 * m * k * n, product, _sync(torch, device),
                                        seconds / (len(shapes) * len(dtypes))))
    return best


def _sync(torch, device: str):
    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def _physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
