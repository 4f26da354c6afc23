"""Build (once, cached) and load kvserve's C++ CPU kernels.

Each build is keyed by its source's hash, this CPU's instruction-set flags (it is compiled with
-march=native) and the compiler flags. If no compiler is available the caller falls back to plain PyTorch.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
from functools import cache
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)
_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"
# at::parallel_for is an OpenMP pragma in the headers: without -fopenmp every kernel ran on one
# thread (one core reads ~11 GB/s here, two ~22).
_OPENMP = ["-fopenmp"]


def _cpu_signature() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    return flags


@cache
def build_extension(prefix: str, source: Path) -> ModuleType | None:
    """Compile ``source`` into a module named ``<prefix>_<hash>``, or None (with a warning) if it
    cannot be built here. Set KVSERVE_DISABLE_CPU_KERNELS=1 to force the pure-PyTorch paths."""
    if os.environ.get("KVSERVE_DISABLE_CPU_KERNELS") == "1":
        return None
    from torch.utils import cpp_extension

    from kvserve.frontend.tokenizer import cache_dir

    cflags = ["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", *_OPENMP]
    digest = hashlib.sha256(source.read_bytes() + _cpu_signature().encode() + " ".join(cflags).encode()).hexdigest()[:12]
    build_dir = cache_dir() / "kernels" / digest
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        return cpp_extension.load(
            name=f"{prefix}_{digest}", sources=[str(source)], build_directory=str(build_dir),
            extra_cflags=cflags, extra_ldflags=_OPENMP, verbose=False)
    except Exception as e:  # no compiler, no ninja, odd platform: the PyTorch path still works
        log.warning("kvserve: C++ CPU kernels (%s) unavailable (%s); using the PyTorch path", source.name, e)
        return None


@cache
def load_cpu_kernels() -> ModuleType | None:
    """The paged decode attention kernel (see csrc/paged_decode.cpp), or None."""
    return build_extension("kvserve_cpu", _SOURCE)
