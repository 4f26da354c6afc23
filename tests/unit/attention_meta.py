"""A mixed step's AttentionMetadata for the backend tests: decodes and prefill chunks over scattered blocks."""

from __future__ import annotations

import random

import torch

from kvserve.model.attention.backend import AttentionMetadata


def mixed_metadata(chunks: list[tuple[int, int]], block_size: int, num_blocks: int, seed: int = 0) -> AttentionMetadata:
    """A mixed step: sequence i has ``context`` cached tokens and brings ``new`` tokens (chunks[i])."""
    rng = random.Random(seed)
    free = list(range(num_blocks))
    rng.shuffle(free)
    seq_lens = [c + n for c, n in chunks]
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in seq_lens]
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    query_start = [0]
    slots, decode_seqs, prefill_seqs = [], [], []
    for i, (context, new) in enumerate(chunks):
        query_start.append(query_start[-1] + new)
        (decode_seqs if new == 1 else prefill_seqs).append(i)
        slots += [tables[i][p // block_size] * block_size + p % block_size for p in range(context, context + new)]
    decode_width = -(-max((seq_lens[i] for i in decode_seqs), default=0) // block_size)
    return AttentionMetadata(
        num_seqs=len(chunks), query_start=query_start, seq_lens=seq_lens, slot_mapping=torch.tensor(slots),
        block_tables=block_tables, seq_lens_t=torch.tensor(seq_lens), decode_seqs=decode_seqs,
        prefill_seqs=prefill_seqs, decode_token_index=torch.tensor([query_start[i] for i in decode_seqs]),
        decode_block_tables=block_tables[decode_seqs, :decode_width],
        decode_seq_lens=torch.tensor([seq_lens[i] for i in decode_seqs]), block_size=block_size)
