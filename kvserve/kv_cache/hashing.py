"""Chained block hashes: a full block is identified by its tokens, its parent block's hash and an
optional extra key (anything else that changes the KV, e.g. a LoRA adapter later).

The pool stores the whole key beside each cached block and compares it on lookup, so a hash
collision can never hand a request the wrong KV; the chain makes each key cover the whole prefix.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass


@dataclass(frozen=True)
class BlockKey:
    hash: int
    parent: int | None
    tokens: tuple[int, ...]
    extra: Hashable = None


def block_key(parent: BlockKey | None, tokens: tuple[int, ...], extra: Hashable = None) -> BlockKey:
    parent_hash = None if parent is None else parent.hash
    return BlockKey(hash((parent_hash, tokens, extra)), parent_hash, tokens, extra)


def chain_keys(token_ids: list[int], block_size: int, start: list[BlockKey], extra: Hashable = None) -> list[BlockKey]:
    """Extend ``start`` (keys already computed) with the keys of every further full block."""
    keys = list(start)
    for i in range(len(keys), len(token_ids) // block_size):
        tokens = tuple(token_ids[i * block_size:(i + 1) * block_size])
        keys.append(block_key(keys[-1] if keys else None, tokens, extra))
    return keys
