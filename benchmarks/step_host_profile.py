"""The host's share of a decode step at a large batch: ``EngineCore.step`` split into its phases on a
tiny random-weight Llama (2 layers, hidden 64, so the forward pass is small and the host's Python
shows), 256 requests decoding at once.

    .venv/bin/python benchmarks/step_host_profile.py [--batch 256] [--steps 64] [--cprofile 25]

Phases, in ms per pure-decode step: schedule (Scheduler.schedule), prepare (the runner's inputs),
forward, logits, sample, and the rest of the step (``outputs``: reading the sampled ids, appending
them, stop checks, counters, prefix-cache commits). ``--cprofile N`` prints the N functions with the
most own time over the timed steps. Driven through ``EngineCore.step`` (no detokenizing), timed
by the wall clock and by this thread's CPU time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from kvserve import LLM, SamplingParams
from kvserve.bench.random_model import write_random_model
from kvserve.runtime.heap import frozen_heap


def profile(llm: LLM, batch: int, steps: int, overlap: bool, cprofile: int) -> dict:
    core = llm.engine.core
    core.overlaps = overlap
    totals: dict[str, float] = defaultdict(float)
    decode = [False]

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            start, cpu = time.perf_counter(), time.thread_time()
            result = fn(*args, **kwargs)
            if decode[0]:
                totals[name] += time.perf_counter() - start
                totals[name + " cpu"] += time.thread_time() - cpu
            return result
        return wrapper

    runner = core.runner
    patched = {(core.scheduler, "schedule"), (runner, "_prepare"), (runner, "_forward"),
               (runner.model, "compute_logits"), (runner.sampler, "sample_on_device"), (core, "step")}
    for owner, attr in patched:
        setattr(owner, attr, timed(attr, getattr(owner, attr)))
    prompts = [[(7 * i + j) % 500 + 3 for j in range(16)] for i in range(batch)]
    params = SamplingParams(max_tokens=steps + 16, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(f"p{overlap}-{i}", p, params)
    for _ in range(8):  # the prompts and the first decodes, untimed
        core.step()
    assert len(core.scheduler.running) == batch
    prof = cProfile.Profile() if cprofile else None
    decode[0] = True
    if prof:
        prof.enable()
    start = time.perf_counter()
    with frozen_heap():  # as LLM.generate and the server run steps
        for _ in range(steps):
            core.step()
    wall = time.perf_counter() - start
    if prof:
        prof.disable()
    decode[0] = False
    while core.has_unfinished():
        core.step()
    for owner, attr in patched:
        delattr(owner, attr)  # the instance attribute: the class's method again
    ms = {name: 1000 * t / steps for name, t in totals.items()}
    names = {"schedule": "schedule", "prepare": "_prepare", "forward": "_forward", "logits": "compute_logits",
             "sample": "sample_on_device"}

    def phases(suffix: str) -> dict:
        out = {name: round(ms[key + suffix], 3) for name, key in names.items()}
        out["outputs"] = round(ms["step" + suffix] - sum(ms[key + suffix] for key in names.values()), 3)
        out["core.step"] = round(ms["step" + suffix], 3)
        return out

    # cpu: this thread's CPU time, which other processes on a shared machine do not inflate
    result = {"wall_ms_per_step": round(1000 * wall / steps, 3), "ms_per_step": phases(""),
              "cpu_ms_per_step": phases(" cpu")}
    if prof:
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(cprofile)
        result["cprofile"] = text.getvalue()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--cprofile", type=int, default=0)
    parser.add_argument("--modes", default="sync,async", help="in this order")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = write_random_model(Path(tmp) / "tiny", "LlamaForCausalLM")
        results = {}
        for name in args.modes.split(","):
            overlap = {"sync": False, "async": True}[name]
            # a fresh engine per mode: a second run on one engine starts with the first's blocks cached
            llm = LLM(model=str(path), max_num_seqs=args.batch, num_kv_blocks=4096, block_size=16,
                      enable_prefix_caching=True)
            results[name] = profile(llm, args.batch, args.steps, overlap, args.cprofile)
            text = results[name].pop("cprofile", None)
            print(name, json.dumps(results[name]), flush=True)
            if text:
                print(text)
    print(json.dumps({"batch": args.batch, "steps": args.steps, "results": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
