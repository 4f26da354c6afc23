"""Where greedy speculative output can differ from plain decoding: speculation, or the batch?

The grounded prompts of `kvserve bench spec` (prefix caching off, so every prompt is computed from
scratch) through a plain and an n-gram engine, all 32 at once and one at a time. It counts the
prompts whose outputs differ between each pair, and for plain decoding at 32 against plain alone it
prints where they part and the two leading tokens' logprobs there (scored in a one-request step).

    .venv/bin/python benchmarks/spec_batch_identity.py [--dtype auto|float32] [--count 32]

With bf16 weights and activations the row count of a step picks the kernels (int8-activation
few-row kernels up to 8 rows, AMX tiles beyond; prefill chunks cut differently), so a token whose
two best logits are within a bf16 step of each other can go either way with the batch it is in.
"""

from __future__ import annotations

import argparse

from kvserve import LLM, SamplingParams
from kvserve.bench.spec import prompts_for


def _ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--count", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    opts = {"dtype": args.dtype, "enable_prefix_caching": False}
    plain, spec = LLM(**opts), LLM(**opts, speculative_method="ngram")
    tokenizer = plain.get_tokenizer()
    prompts = prompts_for("grounded", tokenizer, args.count)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    plain_batch, spec_batch = (_ids(llm.generate(prompts, params, use_tqdm=False)) for llm in (plain, spec))
    plain_alone = [_ids(plain.generate([p], params, use_tqdm=False))[0] for p in prompts]
    spec_alone = [_ids(spec.generate([p], params, use_tqdm=False))[0] for p in prompts]

    def differ(a, b) -> int:
        return sum(x != y for x, y in zip(a, b))

    print(f"dtype {plain.engine.config.dtype}, {len(prompts)} prompts that differ: spec vs plain, both batched "
          f"{differ(spec_batch, plain_batch)}; plain batched vs alone {differ(plain_batch, plain_alone)}; "
          f"spec batched vs plain alone {differ(spec_batch, plain_alone)}; spec alone vs plain alone "
          f"{differ(spec_alone, plain_alone)}")
    for i, (batched, alone) in enumerate(zip(plain_batch, plain_alone)):
        j = next((j for j, (x, y) in enumerate(zip(batched, alone)) if x != y), None)
        if j is None:
            continue
        prefix = tokenizer(prompts[i], add_special_tokens=False)["input_ids"] + alone[:j]
        scored = plain.generate([prefix], SamplingParams(max_tokens=1, temperature=0, logprobs=2), use_tqdm=False)
        top = scored[0].outputs[0].logprobs[0].top[:2]
        print(f"  prompt {i}: parts at token {j}: alone {alone[j]}, batched {batched[j]}; top two "
              f"{[(t, round(lp, 4)) for t, lp in top]}, margin {top[0][1] - top[1][1]:.4f}")


if __name__ == "__main__":
    main()
