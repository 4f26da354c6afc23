"""W1 and W3 through the offline API, this tree against an older revision, alternating in one script.

Each round starts one fresh process per tree (the bundled model as shipped, unless --engine-args
says otherwise) that times W1 (32 requests at once, 128 -> 128 tokens) and W3 (one request,
128 -> 256), greedy with EOS ignored, on the same seeded token-id prompts. The trees alternate, the
order flipping every round, so both see the same machine; the ratios of the medians are the result.

    .venv/bin/python benchmarks/ab_revisions.py --old 9c2fef9~1 [--rounds 4] [--json OUT]

``--measure weight-stream`` times the quantized linears alone instead, one row of x as in a single
stream's decode: all of the model's int4 layers in order, then the int8 head, each pass after an L3
flush so that W comes from memory (GB/s of W read; each layer called through its quantization method).

The old revision is unpacked into a temporary folder and removed after (ab_trees.py).
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

# Run inside each tree's process; prints one JSON line of output tokens/s per workload.
CHILD = r"""
import json, random, sys, time
from kvserve import LLM, SamplingParams
engine_args = json.loads(sys.argv[1])
llm = LLM(**engine_args)
rng = random.Random(0)
def prompts(n, length):
    return [[rng.randrange(100, 30000) for _ in range(length)] for _ in range(n)]
def tok_s(batch, max_tokens):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(batch, params)
    seconds = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outs) / seconds
tok_s(prompts(4, 32), 16)  # warm-up
w1, w3 = prompts(32, 128), prompts(1, 128)
print(json.dumps({"W1": tok_s(w1, 128), "W3": tok_s(w3, 256)}))
"""

STREAM_CHILD = r"""
import json, statistics, sys, time
import torch
from kvserve import LLM
llm = LLM(**json.loads(sys.argv[1]))
model = llm.engine.core.runner.model
layers = [m for m in model.modules() if getattr(m, "qweight", None) is not None]
def nbytes(m):
    return sum(t.nbytes for t in (m.qweight, m.scales, m.zeros, m.factors) if t is not None)
def timed(group):
    xs = [torch.randn(1, m.in_features) for m in group]
    flush, seconds = torch.ones(96 << 18), []  # 96 MB, more than the L3
    for _ in range(25):
        flush.sum()
        start = time.perf_counter()
        for m, x in zip(group, xs):
            m.method.apply(m, x)
        seconds.append(time.perf_counter() - start)
    return sum(nbytes(m) for m in group) / statistics.median(seconds) / 1e9
int4 = [m for m in layers if m.method.bits == 4]
head = [m for m in layers if m.method.bits == 8]
print(json.dumps({"int4 layers": timed(int4), "int8 head": timed(head)}))
"""
CHILDREN = {"workloads": (CHILD, "tok/s"), "weight-stream": (STREAM_CHILD, "GB/s")}


def measure(tree: Path, child: str, engine_args: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", child, json.dumps(engine_args)], cwd=tree, check=True,
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(tree)})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", required=True, help="a git revision to compare this tree with")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--engine-args", default="{}", help='LLM(...) keywords as JSON, e.g. \'{"dtype": "bfloat16"}\'')
    p.add_argument("--measure", choices=sorted(CHILDREN), default="workloads",
                   help="W1 and W3 (workloads), or the quantized linears' read rate (weight-stream)")
    p.add_argument("--json", default=None, help="write the per-round figures here too")
    args = p.parse_args()
    if args.rounds < 1:
        raise SystemExit("--rounds must be >= 1")
    engine_args = json.loads(args.engine_args)
    child, unit = CHILDREN[args.measure]
    with old_revision(args.old) as old_tree:
        rounds = alternate(old_tree, args.rounds, lambda tree, r: measure(tree, child, engine_args),
                           lambda m: ", ".join(f"{k} {v:.1f} {unit}" for k, v in m.items()))
    summary = {}
    for name in rounds["new"][0]:
        old = statistics.median(x[name] for x in rounds["old"])
        new = statistics.median(x[name] for x in rounds["new"])
        summary[name] = {"old": old, "new": new, "unit": unit, "new_over_old": new / old}
        print(f"{name}: old {old:.1f} {unit}, new {new:.1f} {unit}, new/old {new / old:.3f} (medians of {args.rounds})")
    if args.json:
        Path(args.json).write_text(json.dumps({"old": args.old, "measure": args.measure, "engine_args": engine_args,
                                               "rounds": rounds, "summary": summary}, indent=2))


if __name__ == "__main__":
    main()
