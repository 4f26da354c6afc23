"""Build (once, cached) and load kvserve's C++ CPU kernels: one extension from every csrc/ file, so
the fused decoder (models/csrc/llama_decode.cpp) can call the other kernels directly.

The build is keyed by the sources' hash, this CPU's instruction-set flags (it is compiled with
-march=native, or for the target KVSERVE_CPU_TARGET names), the compiler flags and the torch installation (its version and folder: two Python
environments on one machine rebuilt each other's kernels on every alternation when they shared a
build folder). A first build says so on stderr and how long it took (1-5 minutes). If it cannot be
built, callers fall back to plain PyTorch.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import os
import platform
import sys
import time
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from types import ModuleType

from kvserve.runtime.disk_cache import cache_dir, file_version, write_atomically

log = logging.getLogger(__name__)
_MODEL = Path(__file__).parent
_HEADERS = [_MODEL / "csrc"]
_SOURCES = [
    _MODEL / "csrc" / "module.cpp",
    _MODEL / "layers" / "csrc" / "elementwise.cpp",
    _MODEL / "layers" / "csrc" / "packed_linear.cpp",
    _MODEL / "layers" / "csrc" / "moe.cpp",
    _MODEL / "quant" / "csrc" / "quant_linear.cpp",
    _MODEL / "quant" / "csrc" / "quant_linear_avx2.cpp",
    _MODEL / "quant" / "csrc" / "quant_embed.cpp",
    _MODEL / "attention" / "csrc" / "kv_write.cpp",
    _MODEL / "attention" / "csrc" / "paged_decode.cpp",
    _MODEL / "attention" / "csrc" / "paged_prefill.cpp",
    _MODEL / "models" / "csrc" / "llama_decode.cpp",
]
# KVSERVE_CPU_TARGET: the instruction sets the kernels are compiled for. "native" (the default) is this
# CPU's own; "avx2" (x86-64-v3: AVX2 + FMA + F16C, no AVX-512) builds the 8-lane kernels an AVX2-only
# CPU runs, so they can be tested and timed on a newer one; "avx2-vnni" adds AVX-VNNI (Alder Lake,
# Zen 5 client parts), whose 256-bit vpdpbusd the AVX2 integer kernels use when present.
CPU_TARGETS = {
    "native": ["-march=native"],
    "avx2": ["-march=x86-64-v3"],
    "avx2-vnni": ["-march=x86-64-v3", "-mavxvnni"],
}
# at::parallel_for is an OpenMP pragma in the headers: without -fopenmp every kernel runs on one
# thread, and one core reads only about half the memory bandwidth two do.
_OPENMP = ("-fopenmp",)


def _cpu_signature() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    return flags


# AMD's CPU family from Zen 5 on (Zen 3 and 4 are family 25).
_ZEN5_FAMILY = 26


def vendor_flags(vendor: str, family: int | None) -> list[str]:
    """Kernel constants tuned per CPU (packed_linear.cpp's few-row streaming of W): AMD, and among
    AMD CPUs Zen 5 and later, whose tuning differs from Zen 4's."""
    if vendor != "AuthenticAMD":
        return []
    return ["-DKVSERVE_AMD", *(["-DKVSERVE_AMD_ZEN5"] if (family or 0) >= _ZEN5_FAMILY else [])]


def target_flags(target: str) -> list[str]:
    """The -march flags for KVSERVE_CPU_TARGET=``target`` (CPU_TARGETS)."""
    if target not in CPU_TARGETS:
        raise ValueError(f"KVSERVE_CPU_TARGET={target!r} is not a kernel target; choose one of {sorted(CPU_TARGETS)}")
    return CPU_TARGETS[target]


@cache
def load_kernels() -> ModuleType | None:
    """The compiled module, or None (with a warning) if it cannot be built here.
    Set KVSERVE_DISABLE_CPU_KERNELS=1 to force the pure-PyTorch paths, KVSERVE_CPU_TARGET to build for
    an older instruction set than this CPU's (CPU_TARGETS)."""
    if os.environ.get("KVSERVE_DISABLE_CPU_KERNELS") == "1":
        return None
    from kvserve.runtime.threads import cpu_family, cpu_vendor

    cflags = ["-O3", *target_flags(os.environ.get("KVSERVE_CPU_TARGET", "native")), "-ffast-math",
              "-fno-finite-math-only", *_OPENMP, *vendor_flags(cpu_vendor(), cpu_family())]
    digest = build_key(cflags)
    build_dir = cache_dir() / "kernels" / digest
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        with _build_lock(build_dir):
            name = f"kvserve_kernels_{digest}"
            library, built = build_dir / f"{name}.so", build_dir / "built"
            if built.is_file() and library.is_file() and built.read_text() == file_version(library):
                return _import_library(name, library)
            from torch.utils import cpp_extension  # 0.2 s of imports, only to build

            sources, include = _staged_sources(build_dir)
            first = not library.is_file()
            if first:
                _say(f"kvserve: compiling the C++ CPU kernels into {build_dir} (once per machine and torch "
                     "installation; 1-5 minutes)...")
            start = time.monotonic()
            module = cpp_extension.load(
                name=name, sources=sources, build_directory=str(build_dir),
                extra_cflags=cflags, extra_ldflags=list(_OPENMP),  # a copy: the loader appends to it
                extra_include_paths=[include], verbose=False)
            if first:
                _say(f"kvserve: C++ CPU kernels built in {time.monotonic() - start:.0f} s")
            try:
                write_atomically(built, file_version(library).encode())
            except OSError:  # the next start goes through the build tool again, nothing worse
                pass
            return module
    except Exception as e:  # no compiler, no ninja, odd platform: the PyTorch path still works
        log.warning("kvserve: C++ CPU kernels unavailable (%s); using the PyTorch path", e)
        return None


def _import_library(name: str, library: Path) -> ModuleType:
    """The module of a finished build, imported directly: the folder's name already keys everything
    the build depends on, and the ``built`` stamp says the library was whole when it last loaded, so
    the build tool (and its imports) need not run again."""
    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_key(cflags: list[str]) -> str:
    """The build folder's name: everything the compiled module depends on."""
    code = b"".join(p.read_bytes() for p in [*_SOURCES, *sorted(_HEADERS[0].glob("*.h"))])
    return hashlib.sha256(code + _cpu_signature().encode() + " ".join(cflags).encode()
                          + torch_signature().encode()).hexdigest()[:12]


def torch_signature() -> str:
    """The torch installation the kernels link against: its version and where it lives."""
    import torch

    return f"{torch.__version__}:{Path(torch.__file__).resolve().parent}"


def _say(message: str) -> None:
    """A line on stderr and in the log: a first start should not look hung while it compiles."""
    if logging.getLogger().handlers:
        log.warning(message)
    else:  # logging is not configured (a script, the LLM class): print it
        print(message, file=sys.stderr, flush=True)


@contextmanager
def _build_lock(build_dir: Path):
    """Holds an flock on the build directory, which the kernel releases when its holder dies. torch's
    own lock is a plain file that a build stopped midway (Ctrl-C, a killed server) leaves behind, and
    every later start then waited for it forever; while we hold the flock nobody else is building
    here, so such a file is stale and is removed."""
    with open(build_dir / "kvserve.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            (build_dir / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def cpu_has_native_bf16() -> bool:
    """This CPU runs the C++ kernels' bf16 paths (AVX512-BF16 or AMX): what dtype "auto" asks."""
    kernels = load_kernels()
    return kernels is not None and kernels.native_bf16()


def _staged_sources(build_dir: Path) -> tuple[list[str], str]:
    """Copies of the sources and headers in the build directory (written only if they differ), so the
    paths torch's extension loader sees do not depend on where kvserve is installed: it keys its
    build on those paths, and rebuilt (~70 s on two cores) for a second checkout of the same code."""
    staged = build_dir / "src"
    staged.mkdir(exist_ok=True)
    paths = []
    for source in [*_SOURCES, *sorted(_HEADERS[0].glob("*.h"))]:
        target = staged / source.name
        code = source.read_bytes()
        if not target.is_file() or target.read_bytes() != code:
            # write then rename: another process starting at the same time never compiles a half-written file
            partial = staged / f".{source.name}.{os.getpid()}"
            partial.write_bytes(code)
            os.replace(partial, target)
        if source.suffix == ".cpp":
            paths.append(str(target))
    return paths, str(staged)
