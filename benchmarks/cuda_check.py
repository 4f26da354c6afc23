"""The prepared GPU check (#7): CUDA correctness and speed in one run, for the few minutes a GPU is lent.

    python benchmarks/cuda_check.py --out DIR            # on a machine with a CUDA GPU
    python benchmarks/cuda_check.py --out DIR --dry-run  # the same steps on the CPU, tiny shapes

Each step's result goes into DIR/cuda_check.json as soon as it ends; a failed step is recorded and
the next one still runs. The steps run in the order parity, speed, speed_8b, profile, tests by default.

1. tests: pytest of the Triton kernels (attention, elementwise) against the PyTorch reference (adds
   bfloat16 on the GPU) and of the engine on them against transformers, with decode steps replayed
   from CUDA graphs.
2. parity: a random-weight 4-layer Llama (head_dim 64, GQA 8/2, 32K vocabulary) in float32:
   greedy outputs of 8 prompts through the engine (Triton + CUDA graphs) against transformers on
   the same GPU, token by token.
3. speed: a random-weight Llama of TinyLlama-1.1B's shape in bfloat16 through
   ``kvserve bench roofline --device cuda``, with CUDA graphs and with ``--enforce-eager``:
   single-stream decode tok/s against the bandwidth bound, batched tok/s against the matmul peak;
   and with ``--no-async-scheduling`` (``sync_steps``, batches 1, 64, 256), since the default on
   CUDA schedules each step while the previous one runs.
4. speed_8b: the same (CUDA graphs only) on a random-weight Llama of Llama-3-8B's shape (16 GB of
   weights), where a decode step's time is the weights' reading rather than ~250 kernel launches.
5. profile: where a step's time goes on the 1B model (CUDA graphs on), at batch 1 and 256: each
   phase of the engine loop timed with the device synchronized around it, by step kind.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PARITY_SHAPE = dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                    num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
                    initializer_range=0.05)


def _run_logged(cmd: list[str], log: Path, timeout: float) -> tuple[int, str, str]:
    """Run ``cmd`` with stdout going to ``log`` and stderr to ``log``.err as they are written (a lease can
    end mid-run); returns the exit code (-9 after ``timeout`` seconds), stdout and stderr."""
    err = log.with_suffix(".err")
    with log.open("w") as f, err.open("w") as g:
        try:
            code = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=g, timeout=timeout, check=False).returncode
        except subprocess.TimeoutExpired:
            code = -9
    return code, log.read_text(errors="replace"), err.read_text(errors="replace")


def run_tests(device: str, out: Path) -> dict:
    tests = ["tests/unit/test_triton_attention.py", "tests/unit/test_triton_elementwise.py",
             "tests/models/test_triton_backend.py"]
    code, text, err = _run_logged([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
                                  out / "tests.log", timeout=300)
    return {"returncode": code, "summary": text.strip().splitlines()[-1:], "tail": text[-4000:] + err[-1000:]}


def run_parity(device: str, workdir: Path) -> dict:
    import random

    import torch

    from kvserve import LLM, SamplingParams
    from kvserve.bench.random_model import write_random_model
    from tests.models.reference import check_greedy_matches, load_hf

    path = write_random_model(workdir / "parity-llama", **PARITY_SHAPE)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, PARITY_SHAPE["vocab_size"]) for _ in range(rng.randint(8, 300))] for _ in range(8)]
    # chunked prefill shares steps with decodes; async scheduling as on CUDA by default, the dry run included
    llm = LLM(model=str(path), device=device, dtype="float32", num_kv_blocks=512, block_size=16,
              max_num_batched_tokens=256, async_scheduling=True)
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True), use_tqdm=False)
    hf = load_hf(path).to(device)
    compared, mismatch = 0, None
    for prompt, out in zip(prompts, outs):
        try:
            compared += check_greedy_matches(_OnDevice(hf, device), prompt, out.token_ids)
        except AssertionError as e:
            mismatch = str(e)
    runner = llm.engine.core.runner
    # Sampling on the device: seeded requests repeat exactly, unseeded ones differ, top-k/top-p run.
    sampled = [[o.token_ids for o in llm.generate(prompts[:3], SamplingParams(
        max_tokens=16, temperature=0.8, top_p=0.9, top_k=50, seed=s, ignore_eos=True), use_tqdm=False)]
        for s in (1, 1, None)]
    return {"prompts": len(prompts), "tokens_compared": compared, "tokens_generated": 32 * len(prompts),
            "mismatch": mismatch, "backend": type(runner.backend).__name__,
            "cuda_graph_buckets": sorted(runner.decode_graphs.graphs) if runner.decode_graphs else None,
            "seeded_sampling_repeats": sampled[0] == sampled[1], "unseeded_differs": sampled[2] != sampled[0],
            "ok": mismatch is None and compared >= 16 * len(prompts) and sampled[0] == sampled[1],
            "torch": torch.__version__}


class _OnDevice:
    """The reference model called with CPU ids (as check_greedy_matches builds them) on ``device``."""

    def __init__(self, model, device: str) -> None:
        self.model, self.device = model, device

    def __call__(self, ids):
        out = self.model(ids.to(self.device))
        out.logits = out.logits.cpu()
        return out


def run_speed(device: str, workdir: Path, out: Path, dry_run: bool, size: str = "1b") -> dict:
    """``kvserve bench roofline`` on the random ``size`` model; the 1B one also without CUDA graphs."""
    # On the H200 the best batch was the largest tried (256), with the host's Python most of a step:
    # 512 and 1,024 show whether a larger batch lifts the matmul fraction.
    batch_sizes = "2,4" if dry_run else ("1,32,64,128,256,512,1024" if size == "1b" else "1,64,128,256")
    start = time.perf_counter()
    path, shape = _random_llama(size, device, workdir, dry_run)
    result = {"model_shape": shape, "write_seconds": round(time.perf_counter() - start, 1)}
    # Async scheduling is on by default on CUDA: "sync_steps" is the same engine with it off, at fewer batch sizes.
    sync_sizes = "2,4" if dry_run else "1,64,256"
    modes = ((("cuda_graphs", [], batch_sizes), ("sync_steps", ["--no-async-scheduling"], sync_sizes),
              ("eager", ["--enforce-eager"], batch_sizes)) if size == "1b" else (("cuda_graphs", [], batch_sizes),))
    for name, extra, sizes in modes:
        cmd = [sys.executable, "-c", "import sys; from kvserve.cli import main; sys.exit(main())",
               "bench", "roofline", "--model", str(path), "--device", device, "--dtype", "bfloat16",
               "--batch-sizes", sizes, "--kv-cache-memory", "0.05" if dry_run else "40",
               "--prompt-len", "16" if dry_run else "128", "--single-output-len", "8" if dry_run else "256",
               "--output-len", "8" if dry_run else "128", "--json", *extra]
        code, text, err = _run_logged(cmd, out / f"roofline_{size}_{name}.log", timeout=300)
        if code != 0:
            result[name] = {"returncode": code, "error": err[-3000:]}
            continue
        report = json.loads(text[text.index("{"):])
        best = next(b for b in report["batched"] if b["batch_size"] == report["best_batch_size"])
        result[name] = {"report": report, "single_stream_tok_s": report["single_stream"]["decode_tokens_per_s"],
                        "single_stream_fraction": report["single_stream"]["fraction"],
                        "best_batch": best["batch_size"], "best_tok_s": best["output_tokens_per_s"],
                        "best_flops_fraction": best["flops_fraction"]}
    return result


def _random_llama(size: str, device: str, workdir: Path, dry_run: bool) -> tuple[Path, dict]:
    """A random-weight bf16 Llama of TinyLlama-1.1B's (``1b``) or Llama-3-8B's (``8b``) shape."""
    import torch

    from kvserve.bench.random_model import LLAMA_1B_SHAPE, LLAMA_8B_SHAPE, write_random_model

    shape = dict({"1b": LLAMA_1B_SHAPE, "8b": LLAMA_8B_SHAPE}[size], initializer_range=0.02)
    if dry_run:
        shape.update(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=32, vocab_size=1024)
    path = workdir / f"llama-{size}"
    if not (path / "config.json").exists():
        write_random_model(path, dtype=torch.bfloat16, device=device, **shape)
        if device == "cuda":
            torch.cuda.empty_cache()  # the writer's copy of the weights: the benchmark runs in another process
    return path, shape


_PHASES = {"engine.step": ("engine", "step"), "core.step": ("core", "step"), "schedule": ("scheduler", "schedule"),
           "prepare": ("runner", "_prepare"), "forward": ("runner", "_forward"),
           "logits": ("model", "compute_logits"), "sample": ("sampler", "sample_on_device"),
           "update": ("scheduler", "update_after_step")}


def run_profile(device: str, workdir: Path, dry_run: bool) -> dict:
    """Seconds per step in each phase of the loop (device synchronized before and after each, so a
    phase's time includes the GPU work it waits for), split into pure-decode and other steps."""
    from collections import defaultdict

    import torch

    from kvserve import LLM, SamplingParams

    path, _ = _random_llama("1b", device, workdir, dry_run)
    batches = (1, 256)  # the dry run too: the host's share of a step at 256 rows shows on the CPU as well
    llm = LLM(model=str(path), device=device, dtype="bfloat16", max_num_seqs=max(batches), quantization="none",
              enable_prefix_caching=False, kv_cache_memory_bytes=(1 if dry_run else 20) * 2**30)
    core = llm.engine.core
    owners = {"engine": llm.engine, "core": core, "scheduler": core.scheduler, "runner": core.runner,
              "model": core.runner.model, "sampler": core.runner.sampler}
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    kind = ["other"]
    totals: dict = defaultdict(lambda: defaultdict(float))
    steps: dict = defaultdict(int)

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            sync()
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            sync()
            totals[kind[0]][name] += time.perf_counter() - start
            return result
        return wrapper

    schedule = core.scheduler.schedule

    def schedule_and_classify():
        """Sets the step's kind as soon as it is scheduled: every phase timed after this (the
        schedule call itself included) is counted under it."""
        out = schedule()
        if not out.is_empty:
            kind[0] = "decode" if all(len(s.token_ids) == 1 for s in out.scheduled) else "other"
            steps[kind[0]] += 1
        return out

    core.scheduler.schedule = schedule_and_classify
    for name, (owner, attr) in _PHASES.items():
        setattr(owners[owner], attr, timed(name, getattr(owners[owner], attr)))
    result = {"async_scheduling": core.overlaps}  # the synchronize around each phase undoes its overlap
    for batch in batches:
        prompts = [[(7 * i + j) % 1000 + 3 for j in range(128)] for i in range(batch)]
        params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
        llm.generate(prompts, params, use_tqdm=False)  # warm-up
        totals.clear()
        steps.clear()
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        result[f"batch_{batch}"] = {"wall_s": round(wall, 4), "steps": dict(steps), "ms_per_step": {
            k: {name: round(1000 * t / max(1, steps[k]), 3) for name, t in phases.items()} for k, phases in totals.items()}}
    return result


def _host_facts() -> dict:
    """The host side of the machine, which bounds the engine's Python per step: the CPU, the cores
    this process may use, and a cgroup CPU quota if there is one (a GPU host's CPU can be slower per
    step than a CPU-only machine's)."""
    import os
    import platform

    facts = {"cpu": platform.processor() or platform.machine(), "usable_cores": len(os.sched_getaffinity(0))}
    for path in ("/sys/fs/cgroup/cpu.max", "/sys/fs/cgroup/cpu/cpu.cfs_quota_us"):
        try:
            facts["cgroup_cpu"] = Path(path).read_text().strip()
            break
        except OSError:
            pass
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        facts["model_name"] = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return facts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: checks this script, not CUDA")
    parser.add_argument("--steps", default="parity,speed,speed_8b,profile,tests",
                        help="the order matters if the lease ends early")
    args = parser.parse_args()

    import torch

    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device visible to torch; use --dry-run to check the script on the CPU", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu (dry run)",
                     "torch": torch.__version__, "python": sys.version.split()[0], "host": _host_facts()}
    try:
        import triton

        results["triton"] = triton.__version__
    except ImportError:
        results["triton"] = None
    out_file = args.out / "cuda_check.json"
    with tempfile.TemporaryDirectory() as tmp:
        for step in args.steps.split(","):
            start = time.perf_counter()
            try:
                if step == "tests":
                    results[step] = run_tests(device, args.out)
                elif step == "parity":
                    results[step] = run_parity(device, Path(tmp))
                elif step == "profile":
                    results[step] = run_profile(device, Path(tmp), args.dry_run)
                elif step in ("speed", "speed_8b"):
                    size = "8b" if step == "speed_8b" else "1b"
                    results[step] = run_speed(device, Path(tmp), args.out, args.dry_run, size)
                else:
                    raise ValueError(f"unknown step {step!r}")
            except Exception:
                results[step] = {"error": traceback.format_exc()[-3000:]}
            results[step]["seconds"] = round(time.perf_counter() - start, 1)
            out_file.write_text(json.dumps(results, indent=2))
            print(f"{step}: done in {results[step]['seconds']} s", flush=True)
    print(json.dumps({k: v for k, v in results.items() if not k.startswith(("speed", "profile"))}, indent=2)[:3000])
    print(json.dumps(results.get("profile"), indent=1)[:4000])
    for step, name in (("speed", "cuda_graphs"), ("speed", "sync_steps"), ("speed", "eager"),
                       ("speed_8b", "cuda_graphs")):
        entry = results.get(step, {}).get(name, {})
        if "best_tok_s" in entry:
            print(f"{step} {name}: single stream {entry['single_stream_tok_s']:.1f} tok/s "
                  f"({100 * entry['single_stream_fraction']:.0f}% of bandwidth bound); best batch "
                  f"{entry['best_batch']}: {entry['best_tok_s']:.1f} tok/s "
                  f"({100 * entry['best_flops_fraction']:.1f}% of matmul peak)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
