"""The cost of structured outputs: W1 (32 requests at once, prompt 128, output 128) on the bundled
model with a JSON schema on every request, against the same workload unconstrained, in one process
(alternating rounds, so both see the same machine), and the grammar mask's fill time per step.

    .venv/bin/python benchmarks/structured_cost.py [--rounds 2]

The schema is a list of records (a bounded string, an integer range, an enum, a nested array) with
more items required than fit in 128 tokens, so every request runs its full 128 tokens under the
grammar and both sides decode the same number of tokens.
"""

from __future__ import annotations

import argparse
import random
import time

from kvserve import LLM, SamplingParams
from kvserve.sample import grammar

SCHEMA = {"type": "array", "minItems": 60, "items": {
    "type": "object", "additionalProperties": False, "required": ["name", "age", "colour", "tags"],
    "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "colour": {"enum": ["red", "green", "blue"]},
                   "tags": {"type": "array", "maxItems": 2, "items": {"type": "string", "pattern": "^[a-z]{1,5}$"}}}}}
NUM_REQUESTS, PROMPT_LEN, OUTPUT_LEN = 32, 128, 128


class _FillClock:
    """Wraps MaskFiller._fill: total seconds and number of calls with ``NUM_REQUESTS`` rows."""

    def __init__(self) -> None:
        self.seconds, self.calls, self._orig = 0.0, 0, grammar.MaskFiller._fill

        def timed(filler, requests, num_rows):
            t = time.perf_counter()
            out = self._orig(filler, requests, num_rows)
            if num_rows == NUM_REQUESTS:
                self.seconds += time.perf_counter() - t
                self.calls += 1
            return out

        grammar.MaskFiller._fill = timed


def _run(llm: LLM, prompts: list[list[int]], constrained: bool) -> float:
    params = SamplingParams(max_tokens=OUTPUT_LEN, temperature=1.0, seed=0, ignore_eos=True,
                            structured_outputs={"json": SCHEMA} if constrained else None)
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == len(prompts) * OUTPUT_LEN, tokens  # every request ran its full length
    return tokens / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    llm = LLM(kv_cache_memory_bytes=512 * 1024**2)
    vocab = llm.engine.core.model_config.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(100, vocab) for _ in range(PROMPT_LEN)] for _ in range(NUM_REQUESTS)]
    clock = _FillClock()
    _run(llm, prompts[:4], True)  # compile the grammar, start the mask thread, warm the kernels
    _run(llm, prompts[:4], False)
    clock.seconds, clock.calls = 0.0, 0
    free, schema = [], []
    for _ in range(args.rounds):
        free.append(_run(llm, prompts, False))
        schema.append(_run(llm, prompts, True))
    f, s = sum(free) / len(free), sum(schema) / len(schema)
    print(f"unconstrained tok/s per round: {[round(x, 1) for x in free]}")
    print(f"json schema   tok/s per round: {[round(x, 1) for x in schema]}")
    print(f"ratio constrained/unconstrained: {s / f:.3f}")
    print(f"mask fill at {NUM_REQUESTS} rows: {1e3 * clock.seconds / max(clock.calls, 1):.3f} ms per step "
          f"over {clock.calls} steps (on the mask thread, overlapping the forward pass)")


if __name__ == "__main__":
    main()
