"""The AVX2 kernels (KVSERVE_CPU_TARGET=avx2: 256-bit vectors, no bf16 arithmetic, no VNNI) on a
CPU that also has AVX-512: the quantized-linear, decode attention and fused decode parity tests,
run in a subprocess against a build for that target (a second build of the extension, cached like
the first)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.model.cpu_kernels import load_kernels

ROOT = Path(__file__).resolve().parents[2]
# The kernel tests of the quantized linears and of decode attention, then the fused decoder against
# the eager model (bf16 and float32 x, int4 / int8 weights, the bundled Q4_1 model, speculative
# verification through it).
TESTS = [["tests/unit/test_quant_packing.py", "-k", "kernel or rows or activation or exact or vector_bits or strip"],
         ["tests/unit/test_attention_backend.py", "-k", "kernel or verify"],
         ["tests/models/test_fused_decode.py"]]


def _cpu_runs_avx2() -> bool:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return False
    return {"avx2", "fma", "f16c"} <= set(flags.split())


@pytest.mark.slow
@pytest.mark.skipif(not _cpu_runs_avx2() or load_kernels() is None, reason="no AVX2 CPU, or no kernel build here")
def test_the_avx2_build_passes_the_kernel_tests():
    env = {**os.environ, "KVSERVE_CPU_TARGET": "avx2", "PYTHONPATH": str(ROOT)}
    # the build first: a failed one would only make the tests below skip
    probe = ("from kvserve.model.cpu_kernels import load_kernels; k = load_kernels(); "
             "assert k is not None and k.vector_bits() == 256 and not k.native_bf16(), k")
    built = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=1800)
    assert built.returncode == 0, built.stderr[-4000:]
    for tests in TESTS:
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests]
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
