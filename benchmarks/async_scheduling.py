"""Async scheduling on and off: W1 (32 requests at once, prompt 128, output 128) and W3 (one request,
prompt 128, output 256) offline on one engine, greedy, EOS ignored, the two modes in alternating
rounds so both see the same machine. What the CPU default of ``async_scheduling`` is set from.

    .venv/bin/python benchmarks/async_scheduling.py [--rounds 2] [--model PATH] [--device cpu]

The mode is switched on the one loaded engine (``EngineCore.overlaps``, what the option sets), so
both modes share the weights, the KV pool and the warmed-up threads.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from kvserve import LLM, SamplingParams

WORKLOADS = {"W1": (32, 128, 128), "W3": (1, 128, 256)}  # requests, prompt tokens, output tokens


def run(llm: LLM, overlap: bool, workload: str) -> float:
    """Output tokens/s of one round."""
    llm.engine.core.overlaps = overlap
    num, prompt_len, output_len = WORKLOADS[workload]
    rng = random.Random(0)
    vocab = llm.engine.core.model_config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(num)]
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == output_len for o in outs)
    return num * output_len / elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model", default=None, help="default: the bundled model")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--workloads", default="W1,W3")
    args = parser.parse_args()
    llm = LLM(model=args.model, device=args.device, dtype="bfloat16", quantization="none",
              enable_prefix_caching=False)  # the same prompts every round: no cache hits
    results: dict = {}
    for workload in args.workloads.split(","):
        run(llm, False, workload)  # warm-up
        rates: dict[str, list[float]] = {"off": [], "on": []}
        for _ in range(args.rounds):
            for name, overlap in (("off", False), ("on", True)):
                rates[name].append(round(run(llm, overlap, workload), 1))
        results[workload] = {**rates, "median_on_over_off": round(statistics.median(rates["on"])
                                                                  / statistics.median(rates["off"]), 3)}
        print(workload, json.dumps(results[workload]), flush=True)
    print(json.dumps({"device": args.device, "results": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
