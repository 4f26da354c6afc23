"""How fast the CPU decode attention kernel reads a paged KV cache, against a plain read of memory.

Builds `--layers` caches of bf16 K/V blocks (head_dim 64, 3 kv heads, 9 query heads: the default
model's shape) holding `--batch` sequences of `--context` tokens, then times
`paged_decode_attention` over every layer with the blocks in random order (as a busy pool leaves
them) and in order, and a float32 sum over the same pools (a read of memory at its best rate).

    .venv/bin/python benchmarks/kv_read_bandwidth.py --batch 64 --context 400
"""

from __future__ import annotations

import argparse
import time

import torch

from kvserve.model.cpu_kernels import load_kernels

BLOCK, KV_HEADS, HEADS, HEAD_DIM = 16, 3, 9, 64


def _best(fn, reps: int = 5) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[reps // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=400)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args()
    kernels = load_kernels()
    if kernels is None:
        raise SystemExit("the C++ kernels are not available here")
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    per_seq = -(-args.context // BLOCK)
    num_blocks = args.batch * per_seq + 1
    shuffled = (torch.randperm(num_blocks - 1, generator=g) + 1).view(args.batch, per_seq).contiguous()
    ordered = (torch.arange(num_blocks - 1) + 1).view(args.batch, per_seq).contiguous()
    lens = torch.full((args.batch,), args.context, dtype=torch.int64)
    q = torch.randn(args.batch, HEADS, HEAD_DIM, generator=g).bfloat16()
    caches = [tuple(torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g).bfloat16() for _ in range(2))
              for _ in range(args.layers)]
    kv_bytes = 2 * args.batch * args.context * KV_HEADS * HEAD_DIM * 2 * args.layers
    pool_bytes = 2 * args.layers * caches[0][0].numel() * 2

    def attend(tables):
        for k, v in caches:
            kernels.paged_decode_attention(q, k, v, tables, lens, HEAD_DIM ** -0.5, 0, 0)

    def read_all():
        for k, v in caches:
            k.view(torch.float32).sum()
            v.view(torch.float32).sum()

    print(f"{args.batch} sequences x {args.context} tokens x {args.layers} layers ({kv_bytes / 1e6:.0f} MB of KV), "
          f"{args.threads} threads")
    print(f"  kernel, blocks shuffled: {kv_bytes / _best(lambda: attend(shuffled)) / 1e9:5.1f} GB/s")
    print(f"  kernel, blocks in order: {kv_bytes / _best(lambda: attend(ordered)) / 1e9:5.1f} GB/s")
    print(f"  float32 sum of the pools: {pool_bytes / _best(read_all) / 1e9:5.1f} GB/s")


if __name__ == "__main__":
    main()
