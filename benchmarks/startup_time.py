"""How long `kvserve serve` takes to answer /health with 200, and where that time goes.

    .venv/bin/python benchmarks/startup_time.py                 # serve --dtype bfloat16, 3 starts
    .venv/bin/python benchmarks/startup_time.py --breakdown     # also time each loading stage in-process
    .venv/bin/python benchmarks/startup_time.py --quantization none   # bf16 dense: GGUF blocks dequantized
    .venv/bin/python benchmarks/startup_time.py --dtype auto --old REV   # alternate with an older revision

The breakdown runs the stages the server runs, in order, in a fresh process (so imports count),
with the caches (converted tokenizer and weights, compiled kernel) already warm as they are after a
first start; every run starts the server once untimed first, to fill them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from ab_trees import alternate, old_revision

from kvserve.bench.launch import free_port, wait_for_health

BREAKDOWN = r'''
import json, sys, time
stages, t = {}, time.perf_counter()
def lap(name):
    global t
    now = time.perf_counter(); stages[name] = now - t; t = now
import kvserve, torch; lap("import kvserve: torch, transformers")
import gc; gc.disable()  # the server imports its web stack and loads with collection paused (runtime/heap.py)
import fastapi, uvicorn, kvserve.entrypoints.openai.app; lap("import the server: fastapi, uvicorn")
from kvserve.model.default_model import verified_default_model_path
path = verified_default_model_path(); lap("sha256 of the GGUF file (checked once per file version)")
from kvserve.model import gguf_file
gguf_file.read_config(path); lap("GGUF header (cached index; gguf.GGUFReader on a first start)")
from kvserve.config import EngineConfig, QuantConfig
from kvserve.model.loader import load_model, resolve_auto
quant = None if sys.argv[2] == "default" else sys.argv[2]
dtype, quant = resolve_auto(sys.argv[1], QuantConfig(quant), path, torch.device("cpu"))  # as EngineCore does
model, cfg = load_model(path, getattr(torch, dtype), torch.device("cpu"), quant, weight_cache_gb=EngineConfig().weight_cache_gb)
lap(f"build model ({dtype}), read its kept weights")
from kvserve.frontend.tokenizer import load_tokenizer
load_tokenizer(path); lap("tokenizer (cached conversion)")
from kvserve.model.cpu_kernels import load_kernels as load_cpu_kernels
load_cpu_kernels(); lap("C++ kernel (cached build)")
print(json.dumps(stages))
'''


def time_to_health(dtype: str, extra: list[str], timeout: float = 300.0, tree: Path | None = None) -> float:
    """Seconds from launching `kvserve serve` (of ``tree``, default this one) to /health's 200."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvserve.cli", "serve", "--dtype", dtype, "--port", str(port),
           "--log-level", "warning", *extra]
    env = None if tree is None else {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        return wait_for_health(f"http://127.0.0.1:{port}", proc, timeout)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def breakdown(dtype: str, quantization: str) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", BREAKDOWN, dtype, quantization], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--starts", type=int, default=3)
    p.add_argument("--breakdown", action="store_true")
    p.add_argument("--quantization", default="default", help="none, int8, int4 (default: the checkpoint's own)")
    p.add_argument("--serve-args", type=str.split, default=[], help="extra `kvserve serve` flags, one string")
    p.add_argument("--old", default=None,
                   help="a git revision whose starts alternate with this tree's, --starts of each (ab_trees.py)")
    args = p.parse_args(argv)
    if args.quantization != "default":
        args.serve_args = ["--quantization", args.quantization, *args.serve_args]
    if args.old:
        with old_revision(args.old) as old_tree:
            for tree in (old_tree, None):  # untimed: the caches a first start fills (kernels, tokenizer, weights)
                time_to_health(args.dtype, args.serve_args, tree=tree)
            rounds = alternate(old_tree, args.starts,
                               lambda tree, _: {"seconds": time_to_health(args.dtype, args.serve_args, tree=tree)},
                               lambda m: f"/health 200 after {m['seconds']:.2f} s")
        old, new = (statistics.median(m["seconds"] for m in rounds[name]) for name in ("old", "new"))
        print(f"median of {args.starts}: {args.old} {old:.2f} s, this tree {new:.2f} s")
    else:
        time_to_health(args.dtype, args.serve_args)  # untimed: fills the caches a first start fills
        for i in range(args.starts):
            seconds = time_to_health(args.dtype, args.serve_args)
            print(f"start {i + 1}: /health 200 after {seconds:.1f} s (load avg {os.getloadavg()[0]:.1f})", flush=True)
    if args.breakdown:
        stages = breakdown(args.dtype, args.quantization)
        for name, seconds in stages.items():
            print(f"  {name:48} {seconds:6.2f} s")
        print(f"  {'total':48} {sum(stages.values()):6.2f} s (load avg {os.getloadavg()[0]:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
