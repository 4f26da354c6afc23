"""This tree against an older revision with both C++ kernel builds for one target (KVSERVE_CPU_TARGET,
default avx2): the AVX2 kernels timed on a CPU that has more, alternating in one script.

Each round starts fresh processes per tree, the trees alternating and the order flipping every round:
  - `kvserve bench roofline --shipped --single-rounds 5 --batch-sizes 8 --json`: the bundled model as
    shipped, single stream against its bandwidth bound and against the dense bf16 single stream
    (one batch size only: the batched runs are dense bf16, which this comparison does not change);
  - `kvserve bench spec --workload grounded --speculative-method ngram --concurrency 1 --json`;
  - the bundled model with no options (dtype "auto": float32 without native bf16), one request,
    128 -> 256 tokens, greedy with EOS ignored, as `kvserve serve` with no flags runs it.
Once per tree, the greedy output of that default engine on a few chat prompts, compared token by token.

    .venv/bin/python benchmarks/ab_cpu_target.py --old 7d93151 [--rounds 2] [--json OUT]

The old revision is unpacked into a temporary folder, removed after (ab_trees.py). If its
kernel loader (model/cpu_kernels.py) predates KVSERVE_CPU_TARGET, its -march=native is replaced by the
target's flags, so both trees build their own kernels for the same target; each build compiles on
first use (a few minutes, cached).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from ab_trees import REPO, alternate, old_revision

LOADER = Path("kvserve/model/cpu_kernels.py")

# Run inside each tree's process: the default engine's single-stream speed and greedy output.
CHILD = r"""
import json, random, sys, time
from kvserve import LLM, SamplingParams
from kvserve.bench.spec import prompts_for
llm = LLM()
rng = random.Random(0)
prompt = [[rng.randrange(100, 30000) for _ in range(128)]]
params = SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True)
llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)  # warm-up
start = time.perf_counter()
out = llm.generate(prompt, params, use_tqdm=False)[0]
rate = len(out.outputs[0].token_ids) / (time.perf_counter() - start)
greedy = []
if sys.argv[1] == "1":
    chats = prompts_for("open", llm.get_tokenizer(), 6)
    outs = llm.generate(chats, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True), use_tqdm=False)
    greedy = [o.outputs[0].token_ids for o in outs]
print(json.dumps({"dtype": llm.engine.config.dtype,
                  "activation_quantization": getattr(llm.engine.config.quant, "activation_quantization", None),
                  "default_tokens_per_s": rate, "greedy": greedy}))
"""


def _run_json(tree: Path, env: dict, args: list[str]) -> dict:
    out = subprocess.run([sys.executable, *args], cwd=tree, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(args[:4])} failed in {tree}:\n{out.stderr[-3000:]}")
    text = out.stdout
    return json.loads(text[text.index("{"):])  # the JSON document; log lines go to stderr


def measure(tree: Path, target: str, greedy: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "KVSERVE_CPU_TARGET": target}
    roofline = _run_json(tree, env, ["-m", "kvserve.cli", "bench", "roofline", "--shipped", "--single-rounds", "5",
                                     "--batch-sizes", "8", "--json"])
    spec = _run_json(tree, env, ["-m", "kvserve.cli", "bench", "spec", "--workload", "grounded",
                                 "--speculative-method", "ngram", "--concurrency", "1", "--json"])
    default = _run_json(tree, env, ["-c", CHILD, "1" if greedy else "0"])
    shipped = roofline["shipped"]
    return {"shipped_tokens_per_s": shipped["single_stream"]["decode_tokens_per_s"],
            "shipped_fraction": shipped["single_stream"]["fraction"],
            "shipped_over_dense": shipped["over_dense_single_stream"],
            "dense_tokens_per_s": roofline["single_stream"]["decode_tokens_per_s"],
            "copy_bandwidth": shipped["single_stream"]["bandwidth"], "quantization": shipped["quantization"],
            "spec": spec["results"][0], "default": default, "roofline": roofline}


def agreement(old: list[list[int]], new: list[list[int]]) -> list[dict]:
    """Per prompt: the tokens up to the first difference, and the positions that match."""
    out = []
    for a, b in zip(old, new):
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        out.append({"tokens": len(a), "same_prefix": first, "same_positions": sum(x == y for x, y in zip(a, b))})
    return out


def _with_target_loader(tree: Path, target: str) -> None:
    """An old kernel loader without KVSERVE_CPU_TARGET gets the target's flags in place of -march=native."""
    sys.path.insert(0, str(REPO))
    from kvserve.model.cpu_kernels import target_flags

    loader = tree / LOADER
    text = loader.read_text()
    if "KVSERVE_CPU_TARGET" not in text:
        assert '"-march=native"' in text, f"{loader}: no -march=native to replace"
        loader.write_text(text.replace('"-march=native"', ", ".join(f'"{f}"' for f in target_flags(target))))


def describe(m: dict) -> str:
    return (f"shipped {m['shipped_tokens_per_s']:.1f} tok/s ({100 * m['shipped_fraction']:.0f}% of bound, "
            f"{m['shipped_over_dense']:.2f}x dense), spec {m['spec']['spec_tokens_per_s']:.1f} tok/s "
            f"(x{m['spec']['speedup']:.2f}), default {m['default']['default_tokens_per_s']:.1f} tok/s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", required=True, help="a git revision to compare this tree with")
    p.add_argument("--target", default="avx2", help="KVSERVE_CPU_TARGET for both trees' kernel builds")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", default=None, help="write the per-round figures here too")
    args = p.parse_args()
    if args.rounds < 1:
        raise SystemExit("--rounds must be >= 1")
    with old_revision(args.old) as old_tree:
        _with_target_loader(old_tree, args.target)
        rounds = alternate(old_tree, args.rounds, lambda tree, r: measure(tree, args.target, greedy=r == 0), describe)
    summary = {}
    for name, runs in rounds.items():
        med = statistics.median
        summary[name] = {
            "shipped_tokens_per_s": med(m["shipped_tokens_per_s"] for m in runs),
            "shipped_fraction": med(m["shipped_fraction"] for m in runs),
            "shipped_over_dense": med(m["shipped_over_dense"] for m in runs),
            "dense_tokens_per_s": med(m["dense_tokens_per_s"] for m in runs),
            "spec_plain_tokens_per_s": med(m["spec"]["plain_tokens_per_s"] for m in runs),
            "spec_tokens_per_s": med(m["spec"]["spec_tokens_per_s"] for m in runs),
            "spec_speedup": med(m["spec"]["speedup"] for m in runs),
            "spec_identical": all(m["spec"]["identical"] for m in runs),
            "default_tokens_per_s": med(m["default"]["default_tokens_per_s"] for m in runs),
            "default_engine": {k: runs[0]["default"][k] for k in ("dtype", "activation_quantization")}}
    summary["greedy_agreement"] = agreement(rounds["old"][0]["default"]["greedy"], rounds["new"][0]["default"]["greedy"])
    for name in ("old", "new"):
        s = summary[name]
        print(f"{name}: shipped {s['shipped_tokens_per_s']:.1f} tok/s ({100 * s['shipped_fraction']:.0f}% of bound, "
              f"{s['shipped_over_dense']:.2f}x dense); spec x{s['spec_speedup']:.2f} ({s['spec_tokens_per_s']:.1f} tok/s, "
              f"identical {s['spec_identical']}); default engine {s['default_tokens_per_s']:.1f} tok/s "
              f"(medians of {args.rounds})")
    print("greedy, default engine, old vs new:", summary["greedy_agreement"])
    if args.json:
        Path(args.json).write_text(json.dumps({"old": args.old, "target": args.target, "rounds": rounds,
                                               "summary": summary}, indent=2))


if __name__ == "__main__":
    main()
