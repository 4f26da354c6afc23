"""Pure decode steps on CUDA, replayed from captured CUDA graphs.

A decode step launches a few hundred small kernels; on a GPU their launch cost, not their work,
bounds a small batch. Capturing the step once per batch-size bucket and replaying it costs one
launch. A graph reads and writes fixed addresses, so each bucket's step is captured over static
buffers (token ids, positions, slots, block tables, sequence lengths) that every replay first fills:

- a batch of B runs in the smallest bucket >= B; rows B.. are padding with slot -1 (the K/V store
  skips it) and sequence length 0 (attention reads nothing), and their outputs are dropped;
- block tables are as wide as ``max_model_len`` needs, so any decode fits; entries past a row's
  length are never read.

Only backends whose decode launches depend on nothing but device buffers can be captured
(``supports_cuda_graphs``); prefill and mixed steps always run eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from kvserve.model.attention.backend import AttentionMetadata

log = logging.getLogger(__name__)

Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def bucket_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64 and every 32 after it; the last is ``max_batch``."""
    sizes = [1, 2, 4, 8, *range(16, 65, 8), *range(96, max_batch + 1, 32)]
    return sorted({s for s in sizes if s < max_batch} | {max_batch})


class DecodeGraphs:
    """One captured decode step per bucket, sharing one memory pool and one set of input buffers."""

    def __init__(self, forward: Forward, max_batch: int, max_blocks: int, block_size: int,
                 device: torch.device) -> None:
        self.block_size = block_size
        self.sizes = bucket_sizes(max_batch)
        long = dict(dtype=torch.long, device=device)
        self.input_ids = torch.zeros(max_batch, **long)
        self.positions = torch.zeros(max_batch, **long)
        self.slots = torch.full((max_batch,), -1, **long)
        self.seq_lens = torch.zeros(max_batch, **long)
        self.block_tables = torch.zeros(max_batch, max_blocks, **long)
        self.query_start = torch.arange(max_batch + 1, **long)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._capture(forward, device)

    def _capture(self, forward: Forward, device: torch.device) -> None:
        """Record each bucket's step into ``self.graphs`` with its output buffer in ``self.outputs``."""
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):  # largest first: the smaller ones reuse its pool memory
            meta = self._metadata(size)
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):  # warm-up: compiles the Triton kernels, settles allocations
                forward(self.input_ids[:size], self.positions[:size], meta)
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = forward(self.input_ids[:size], self.positions[:size], meta)
            self.graphs[size] = graph
        torch.cuda.synchronize(device)

    def _replay(self, size: int) -> None:
        self.graphs[size].replay()

    def _metadata(self, size: int) -> AttentionMetadata:
        rows = list(range(size))
        return AttentionMetadata(
            num_seqs=size, query_start=list(range(size + 1)), seq_lens=[1] * size,
            slot_mapping=self.slots[:size], block_tables=self.block_tables[:size], seq_lens_t=self.seq_lens[:size],
            decode_seqs=rows, prefill_seqs=[], decode_token_index=self.query_start[:size],
            decode_block_tables=self.block_tables[:size], decode_seq_lens=self.seq_lens[:size],
            block_size=self.block_size, query_start_t=self.query_start[:size + 1])

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """Hidden states [B, hidden] of a pure decode step, or None when no bucket fits it.

        The result is a view of the bucket's output buffer: valid until the next replay.
        """
        batch, width = meta.num_seqs, meta.block_tables.shape[1]
        size = next((s for s in self.sizes if s >= batch), None)
        if size is None or width > self.block_tables.shape[1]:
            return None
        self.input_ids[:batch].copy_(input_ids)
        self.positions[:batch].copy_(positions)
        self.slots[:batch].copy_(meta.slot_mapping)
        self.seq_lens[:batch].copy_(meta.seq_lens_t)
        self.block_tables[:batch, :width].copy_(meta.block_tables)
        if size > batch:  # padding rows: store nothing, attend to nothing
            self.slots[batch:size].fill_(-1)
            self.seq_lens[batch:size].zero_()
        self._replay(size)
        return self.outputs[size][:batch]


def capture_decode_graphs(forward: Forward, max_batch: int, max_model_len: int, block_size: int,
                          device: torch.device) -> DecodeGraphs | None:
    """DecodeGraphs for ``device``, or None (with a warning) if capture fails: decode then runs eagerly."""
    try:
        with torch.inference_mode():  # as the steps that replay them run: buffers and outputs are inference tensors
            return DecodeGraphs(forward, max_batch, -(-max_model_len // block_size), block_size, device)
    except Exception as e:  # an op that syncs or allocates on the host cannot be captured
        log.warning("CUDA graph capture failed (%s); decode steps run eagerly", e)
        return None
